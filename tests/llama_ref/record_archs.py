"""Record llama.cpp's logits and greedy tokens on the small models of tests/arch_cases.py into
tests/data/arch_reference.npz (run from the repository root, after build.sh):

    python tests/llama_ref/record_archs.py [--avx2] /tmp/llama_ref [CASE ...]   (default: every case)

--avx2: with build.sh --avx2's dump-avx2, as ggml's AVX2 build computes them (on any x86 CPU).

Per case: the sha256 of the GGUF file, the logits after the prompt batch and after each single
token (N_DECODE + 1, V), and N_GREEDY greedy tokens after the prompt alone. The logits and tokens
are those of ggml's build for this CPU (AVX2 or AVX-512, which round differently): they are kept
under that build's name ("avx512_bf16/qwen3/logits"), next to those recorded on other kinds of CPU."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import arch_cases  # noqa: E402


def dump(binary: Path, model: Path, ids, n_prompt: int, out: Path, greedy: int = 0) -> None:
    (out.parent / "ids.txt").write_text(" ".join(map(str, ids)))
    env = dict(os.environ, DUMP_EVALS="0", DUMP_GREEDY=str(greedy))
    subprocess.run([str(binary), str(model), str(out.parent / "ids.txt"), str(out), str(n_prompt), "2"],
                   env=env, check=True, capture_output=True)


def main(workdir: str, names: list[str], avx2: bool = False) -> None:
    from minillm.kernels.cpu.ops import ggml_build  # the build of ggml llama.cpp runs (this CPU's)

    binary = Path(workdir) / ("dump-avx2" if avx2 else "dump")
    build = "avx2" if avx2 else ggml_build(bf16=True)
    out = Path(__file__).resolve().parent.parent / "data" / "arch_reference.npz"
    names = names or list(arch_cases.CASES)
    record = ({k: v for k, v in np.load(out).items() if not any(k.startswith(f"{build}/{n}/") for n in names)}
              if out.exists() else {})
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            path = arch_cases.build(name).write(Path(tmp) / f"{name}.gguf")
            ids = arch_cases.token_ids(name)
            dump(binary, path, ids, arch_cases.N_PROMPT, Path(tmp) / "out")
            logits = np.fromfile(Path(tmp) / "out.logits", np.float32).reshape(arch_cases.N_DECODE + 1, -1)
            dump(binary, path, ids[:arch_cases.N_PROMPT], arch_cases.N_PROMPT, Path(tmp) / "greedy",
                 arch_cases.N_GREEDY)
            lines = (Path(tmp) / "greedy.greedy").read_text().splitlines()
            greedy = np.array([int(line.split()[0]) for line in lines], np.int64)
            record[f"{name}/sha256"] = np.array(hashlib.sha256(path.read_bytes()).hexdigest())
            record[f"{build}/{name}/logits"] = logits
            record[f"{build}/{name}/greedy"] = greedy
            print(f"{name}: logits {logits.shape}, greedy {greedy.tolist()}")
    np.savez_compressed(out, **record)
    print(f"wrote {out}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--avx2"]
    main(args[0] if args else "/tmp/llama_ref", args[1:], avx2="--avx2" in sys.argv[1:])
