"""`make bench`: for each real model, prefill and decode speed (minillm bench -p 512 -n 128),
cold start (a new `minillm generate MODEL -p Hello -n 1` process, compile cache warm) and peak
resident memory (of the bench process, and of that generate process, which also holds the
tokenizer and a context of up to 4096); prints one table and writes the figures as JSON.

    python -m minillm.cli.benchmarks MODEL [MODEL ...] [--out bench-results.json] [--llama-bench PATH]

With --llama-bench (llama.cpp's llama-bench; tests/llama_ref/build.sh builds it), llama.cpp
runs the same pp512/tg128 on each model right after minillm, with as many threads, so both
are measured in one run on the same machine state. Run it on an idle machine: any other
multi-threaded job ruins the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _run(args: list[str]) -> tuple[float, float, str]:
    """(wall seconds, peak RSS MiB, stdout) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "minillm", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"minillm {' '.join(args)} failed with status {proc.returncode}")
    return wall, usage.ru_maxrss / 1024, out


def llama_bench(binary: str, path: str, threads: int) -> dict:
    """llama.cpp's pp512 and tg128 tokens/s on one model (llama-bench -o json)."""
    proc = subprocess.run([binary, "-m", path, "-t", str(threads), "-p", "512", "-n", "128", "-r", "2", "-o", "json"],
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{binary} failed with status {proc.returncode}: {proc.stderr.strip()[-300:]}")
    figures = {}
    for test in json.loads(proc.stdout):
        key = "llama_pp512_tokens_per_s" if test["n_prompt"] else "llama_tg128_tokens_per_s"
        figures[key] = round(test["avg_ts"], 2)
    return figures


def bench_model(path: str) -> dict:
    _run(["generate", path, "-p", "Hello", "-n", "1", "--temp", "0"])  # warm the compile cache
    starts = [_run(["generate", path, "-p", "Hello", "-n", "1", "--temp", "0"]) for _ in range(3)]
    _, peak_rss, out = _run(["bench", path, "-p", "512", "-n", "128", "-r", "2", "--json"])
    speed = json.loads(out)
    return {
        "model": Path(path).name,
        "file_mib": round(Path(path).stat().st_size / 2**20, 1),
        "pp512_tokens_per_s": speed["pp_tokens_per_s"],
        "tg128_tokens_per_s": speed["tg_tokens_per_s"],
        "load_s": speed["load_s"],
        "cold_start_s": round(min(wall for wall, _, _ in starts), 3),
        "peak_rss_mib": round(peak_rss, 1),
        "generate_peak_rss_mib": round(max(rss for _, rss, _ in starts), 1),
        "threads": speed["threads"],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--out", default="bench-results.json")
    parser.add_argument("--llama-bench", help="llama.cpp's llama-bench, run beside minillm on each model")
    args = parser.parse_args(argv)
    rows = []
    for model in args.models:
        row = bench_model(model)
        if args.llama_bench:
            row.update(llama_bench(args.llama_bench, model, row["threads"]))
        rows.append(row)
    header = ["model", "pp512 tok/s", "tg128 tok/s", "cold start s", "peak RSS MiB", "generate RSS MiB", "file MiB"]
    keys = ["model", "pp512_tokens_per_s", "tg128_tokens_per_s", "cold_start_s", "peak_rss_mib",
            "generate_peak_rss_mib", "file_mib"]
    if args.llama_bench:
        header[3:3] = ["llama.cpp pp512", "llama.cpp tg128"]
        keys[3:3] = ["llama_pp512_tokens_per_s", "llama_tg128_tokens_per_s"]
    widths = [max(len(h), *(len(str(r[k])) for r in rows)) for h, k in zip(header, keys)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(r[k]).ljust(w) for k, w in zip(keys, widths)))
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"(written to {args.out})", file=sys.stderr)


if __name__ == "__main__":
    main()
