"""A stand-in for the Hugging Face Hub on 127.0.0.1, for the tests of models by name: the
endpoints huggingface_hub calls (the repository listing with file sizes and LFS sha256, a
file's metadata by HEAD, its bytes by GET with Range), pointed to by HF_ENDPOINT.

Faults on demand: a gated repository (401 without the token), a file whose bytes do not match
the sha256 the listing gives, and connections dropped part-way through a file.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

TOKEN = "hf_test_token"
CHUNK = 1 << 20


@dataclass
class HubRepo:
    files: dict[str, bytes | Path]           # path in the repository -> its bytes, or a file holding them
    architecture: str | None = None         # what the listing's gguf.architecture says
    gated: bool = False
    corrupt: set[str] = field(default_factory=set)  # files served with one byte changed
    commit: str = ""

    def data(self, path: str) -> bytes | Path:
        return self.files[path]

    def size(self, path: str) -> int:
        data = self.files[path]
        return data.stat().st_size if isinstance(data, Path) else len(data)


_SHA256: dict[Path, str] = {}


def sha256_of(data: bytes | Path) -> str:
    if isinstance(data, bytes):
        return hashlib.sha256(data).hexdigest()
    if data not in _SHA256:
        h = hashlib.sha256()
        with open(data, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        _SHA256[data] = h.hexdigest()
    return _SHA256[data]


class FakeHub:
    """Use as a context manager: `with FakeHub(repos) as hub: hub.endpoint`."""

    def __init__(self, repos: dict[str, HubRepo]):
        self.repos = repos
        for name, repo in repos.items():
            repo.commit = repo.commit or hashlib.sha1(name.encode()).hexdigest()
        self.drops: dict[str, list[int]] = {}   # path -> bytes to send before dropping, one per GET
        self.log: list[tuple[str, str, str]] = []  # (method, url path, Range header)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def downloads(self, path_part: str = "") -> list[tuple[str, str, str]]:
        """The GETs of file bytes so far (whose url contains path_part)."""
        return [entry for entry in self.log if entry[0] == "GET" and "/resolve/" in entry[1] and path_part in entry[1]]

    def listing(self, name: str) -> dict:
        repo = self.repos[name]
        siblings = []
        for path, data in repo.files.items():
            entry = {"rfilename": path, "size": repo.size(path), "blobId": hashlib.sha1(path.encode()).hexdigest()}
            if path.endswith((".gguf", ".safetensors")):
                entry["lfs"] = {"size": repo.size(path), "sha256": sha256_of(data), "pointerSize": 134}
            siblings.append(entry)
        info = {"id": name, "modelId": name, "sha": repo.commit, "private": False,
                "gated": "auto" if repo.gated else False, "siblings": siblings}
        if repo.architecture:
            info["gguf"] = {"architecture": repo.architecture, "total": 1}
        return info

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._answer(body=True)

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def _answer(self, body: bool) -> None:
                path = self.path.split("?", 1)[0]
                hub.log.append((self.command, path, self.headers.get("Range", "")))
                api = re.match(r"^/api/models/([^/]+/[^/]+?)(?:/revision/[^/]+)?$", path)
                resolve = re.match(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$", path)
                name = (api or resolve).group(1) if (api or resolve) else None
                if name not in hub.repos:
                    return self._error(404, "RepoNotFound", "Repository not found")
                repo = hub.repos[name]
                if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._error(401, "GatedRepo", f"Access to model {name} is restricted.")
                if api:
                    return self._send(200, json.dumps(hub.listing(name)).encode(), {"Content-Type": "application/json"},
                                      body)
                file_path = resolve.group(3)
                if file_path not in repo.files:
                    return self._error(404, "EntryNotFound", "Entry not found", {"X-Repo-Commit": repo.commit})
                self._file(repo, file_path, body)

            def _file(self, repo: HubRepo, file_path: str, body: bool) -> None:
                data, size = repo.data(file_path), repo.size(file_path)
                etag = sha256_of(data)
                headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{etag}"', "X-Linked-Etag": f'"{etag}"',
                           "X-Linked-Size": str(size), "Accept-Ranges": "bytes",
                           "Content-Type": "application/octet-stream"}
                start = 0
                m = re.match(r"bytes=(\d+)-$", self.headers.get("Range", ""))
                if m and body:
                    start = int(m.group(1))
                    headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
                headers["Content-Length"] = str(size - start)
                self.send_response(206 if start else 200)
                for key, value in headers.items():
                    self.send_header(key, value)
                self.end_headers()
                if not body:
                    return
                drops = hub.drops.get(file_path)
                limit = drops.pop(0) if drops else None
                sent = 0
                for offset, chunk in _chunks(data, start, size):
                    if file_path in repo.corrupt and offset <= size // 2 < offset + len(chunk):
                        i = size // 2 - offset
                        chunk = chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1:]
                    if limit is not None and sent + len(chunk) > limit:
                        self.wfile.write(chunk[:limit - sent])
                        self.wfile.flush()
                        self.close_connection = True
                        self.connection.shutdown(2)
                        return
                    self.wfile.write(chunk)
                    sent += len(chunk)

            def _error(self, status: int, code: str, message: str, extra: dict | None = None) -> None:
                self._send(status, json.dumps({"error": message}).encode(),
                           {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message,
                            **(extra or {})}, self.command != "HEAD")

            def _send(self, status: int, payload: bytes, headers: dict, body: bool) -> None:
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(payload))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if body:
                    self.wfile.write(payload)

        return Handler


def _chunks(data: bytes | Path, start: int, size: int):
    """(offset, bytes) pieces of data from start to its end."""
    if isinstance(data, bytes):
        for offset in range(start, size, CHUNK):
            yield offset, data[offset:offset + CHUNK]
        return
    with open(data, "rb") as f:
        f.seek(start)
        offset = start
        while chunk := f.read(CHUNK):
            yield offset, chunk
            offset += len(chunk)
