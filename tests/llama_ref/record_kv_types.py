"""Record llama.cpp's logits with quantized KV caches (-ctk/-ctv q8_0 and q4_0) into
tests/data/kv_cache_reference.json (run from the repository root, after build.sh):

    python tests/llama_ref/record_kv_types.py /tmp/llama_ref

Per model and cache type: the prompt ids (a prompt batch, then single tokens), and for the
logits after the batch and after each single token the sha256 of the float32 row and its ten
largest entries. The logits are those of ggml's build for this CPU (AVX2 or AVX-512, which round
differently): they go under that build's key, next to those recorded on the other kind of CPU."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent.parent
MODELS = {"smollm2": ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf",
          "gemma3": ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"}
TEXT = ("The history of the city begins in the Roman period, when a small fort was built on the river. "
        "Merchants followed the soldiers, and by the third century a market town had grown around the walls.")
N_SINGLE = 8


def main(workdir: str) -> None:
    import minillm

    cases = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in MODELS.items():
            ids = minillm.load(path).tokenize(TEXT)
            n_prompt = len(ids) - N_SINGLE
            (Path(tmp) / "ids.txt").write_text(" ".join(map(str, ids)))
            for cache_type in ("q8_0", "q4_0"):
                env = dict(os.environ, DUMP_EVALS="0", DUMP_CTK=cache_type, DUMP_CTV=cache_type)
                subprocess.run([str(Path(workdir) / "dump"), str(path), f"{tmp}/ids.txt", f"{tmp}/out", str(n_prompt), "2"],
                               env=env, check=True, capture_output=True)
                logits = np.fromfile(f"{tmp}/out.logits", np.float32).reshape(N_SINGLE + 1, -1)
                top = np.argsort(-logits, axis=1, kind="stable")[:, :10]
                cases[f"{name}/{cache_type}"] = {
                    "ids": [int(i) for i in ids], "n_prompt": n_prompt,
                    "sha256": [hashlib.sha256(row.tobytes()).hexdigest() for row in logits],
                    "top": [[[int(i), float(row[i])] for i in order] for row, order in zip(logits, top)],
                }
                print(f"{name} {cache_type}: {n_prompt} prompt tokens + {N_SINGLE}")
    from minillm.kernels.cpu.ops import ggml_build  # the build of ggml llama.cpp ran (this CPU's)

    out = ROOT / "tests" / "data" / "kv_cache_reference.json"
    record = json.loads(out.read_text()) if out.exists() else {"builds": {}}
    record.update({"_source": "llama.cpp b11434 (tests/llama_ref/dump.cpp, DUMP_CTK/DUMP_CTV), 2 threads",
                   "n_single": N_SINGLE})
    record["builds"][ggml_build()] = cases
    out.write_text(json.dumps(record) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama_ref")
