"""A client for a running `minillm serve` (or another OpenAI-compatible server), on the standard
library alone: `minillm generate --server URL` and `minillm chat --server URL` use it instead of
loading a model, so a script pays no cold start."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Iterator

from ..errors import MinillmError
from ..sequence import Chunk, Timings
from ..sampling import SamplingParams


class ServerClient:
    def __init__(self, url: str, api_key: str | None = None, timeout: float = 3600):
        base = url.rstrip("/")
        self.base = base[:-3] if base.endswith("/v1") else base
        self.api_key, self.timeout = api_key, timeout

    def post(self, path: str, body: dict):
        """The open response to a POST (MinillmError with the server's message on an error status)."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.base + path, json.dumps(body).encode(), headers)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            raise MinillmError(f"the server answered {exc.code}: {_message(exc.read())}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise MinillmError(f"cannot reach the server at {self.base}: {reason}") from None

    def complete(self, path: str, body: dict) -> dict:
        with self.post(path, dict(body, stream=False)) as response:
            return json.loads(response.read())

    def events(self, path: str, body: dict) -> Iterator[dict]:
        """The JSON objects of a streamed answer's server-sent events, up to [DONE]."""
        with self.post(path, dict(body, stream=True, stream_options={"include_usage": True})) as response:
            for raw in response:
                line = raw.decode("utf-8").rstrip("\r\n")
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if isinstance(event, dict) and event.get("error"):
                    raise MinillmError(f"the server failed: {_message(json.dumps(event).encode())}")
                yield event

    def chunks(self, prompt: str | list[dict], max_tokens: int, params: SamplingParams, stop=(),
               ignore_eos: bool = False, model: str = "") -> Iterator[Chunk]:
        """A generation streamed as Model.generate streams it (tokens are not sent: None)."""
        chat = not isinstance(prompt, str)
        body = request_body(prompt, max_tokens, params, stop, ignore_eos, model)
        timings, finish = Timings(), None
        for event in self.events("/v1/chat/completions" if chat else "/v1/completions", body):
            if event.get("usage"):
                timings.n_prompt = event["usage"]["prompt_tokens"]
                timings.n_generated = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                text = (choice.get("delta", {}).get("content") if chat else choice.get("text")) or ""
                if text:
                    yield Chunk(text, None, None, timings)
                finish = choice.get("finish_reason") or finish
        yield Chunk("", None, finish, timings)


def request_body(prompt, max_tokens: int, params: SamplingParams, stop=(), ignore_eos: bool = False,
                 model: str = "") -> dict:
    body = {"model": model, "max_tokens": max_tokens, "stop": list(stop), "ignore_eos": ignore_eos,
            **{k: v for k, v in params.as_dict().items() if v is not None}}
    body["messages" if not isinstance(prompt, str) else "prompt"] = prompt
    return body


def _message(raw: bytes) -> str:
    try:
        error = json.loads(raw)["error"]
        return error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:500] or "no message"
