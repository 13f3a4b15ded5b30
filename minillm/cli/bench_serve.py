"""`make bench-serve`: N clients at once streaming chat completions over HTTP from `minillm serve`
(and, given its path, from llama-server with `-np N`, the same threads and context per slot), for
N in 1, 4, 8, 16; plus the same load through the scheduler in this process, the ceiling HTTP is
measured against. Reports aggregate generated tokens/s, time to first token and the gaps between
a stream's tokens (p50/p99). Every client sends its own prompt, the same for every server.

    python -m minillm.cli.bench_serve MODEL [--llama-server PATH] [--levels 1,4,8,16] [--device cuda] [--out FILE]
    python -m minillm.cli.bench_serve MODEL --replicas 2 -t 1 [--levels 16]   (Ray Serve scaling)
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import numpy as np

TOPICS = ["the sea", "a lighthouse", "bread", "the moon", "a small town", "a red bicycle", "the sky", "a library",
          "volcanoes", "a letter", "rain", "chess", "a forest", "the first computer", "honey bees", "a train"]
CTX_PER_SLOT = 1024
START_TIMEOUT_S = 900


def request_body(i: int, n_gen: int) -> dict:
    return {"model": "bench", "messages": [{"role": "user", "content": f"Tell me a long story about {TOPICS[i % 16]}."}],
            "max_tokens": n_gen, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def stream_one(port: int, body: dict) -> dict:
    """One streamed request: arrival times of its content events, and its token count."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
    times, n_tokens = [], 0
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        event = json.loads(line[5:])
        if event.get("usage"):
            n_tokens = event["usage"]["completion_tokens"]
        if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
            times.append(time.perf_counter())
    conn.close()
    return {"start": t0, "times": times, "tokens": n_tokens or len(times)}


def whole_one(port: int, body: dict) -> dict:
    """One request answered whole: its token count, the time it took."""
    body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    answer = response.read()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {answer[:300]!r}")
    conn.close()
    return {"start": t0, "times": [time.perf_counter()], "tokens": json.loads(answer)["usage"]["completion_tokens"]}


def run_level(port: int, n: int, n_gen: int, stream: bool = True) -> dict:
    """n clients at once; aggregate tokens/s over the whole round, latency percentiles (streams)."""
    results: list = [None] * n
    barrier = threading.Barrier(n)
    one = stream_one if stream else whole_one

    def client(i: int) -> None:
        barrier.wait()
        results[i] = one(port, request_body(i, n_gen))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    start = min(r["start"] for r in results)
    end = max(r["times"][-1] for r in results)
    out = {"clients": n, "tokens_per_s": sum(r["tokens"] for r in results) / (end - start)}
    if not stream:
        return out
    ttft = [r["times"][0] - r["start"] for r in results]
    gaps = np.concatenate([np.diff(r["times"]) for r in results])
    return out | {"ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)), "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
                  "gap_p50_ms": 1e3 * float(np.percentile(gaps, 50)), "gap_p99_ms": 1e3 * float(np.percentile(gaps, 99))}


def in_process(model, n: int, n_gen: int) -> float:
    """The same load through the scheduler in this process: aggregate tokens/s."""
    from ..serving.batch_input import make_request
    from ..sampling import SamplingParams

    scheduler = model.scheduler(parallel=n, n_ctx=CTX_PER_SLOT)
    bodies = [request_body(i, n_gen) for i in range(n)]
    t0 = time.perf_counter()
    handles = [scheduler.submit(make_request({"messages": b["messages"]}, n_gen, SamplingParams(temperature=0),
                                             ignore_eos=True)) for b in bodies]
    scheduler.run(handles)
    return sum(h.timings.n_generated for h in handles) / (time.perf_counter() - t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not become healthy")


def start_server(kind: str, model: str, n: int, threads: int, llama_server: str | None, replicas: int = 0,
                 device: str = "cpu") -> tuple:
    """The server with n slots (per replica, with replicas), listening on a free port."""
    port = free_port()
    if kind == "minillm":
        cmd = [sys.executable, "-m", "minillm", "serve", model, "--port", str(port), "--parallel", str(n),
               "--ctx", str(CTX_PER_SLOT), "--threads", str(threads), "--device", device]
        if replicas:  # on Ray Serve
            cmd += ["--replicas", str(replicas)]
    else:
        cmd = [llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(n),
               "-c", str(n * CTX_PER_SLOT), "-t", str(threads), "-tb", str(threads)]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(proc, port)
    return proc, port


def bench(model: str, levels: list[int], n_gen: int, threads: int, llama_server: str | None,
          device: str = "cpu") -> dict:
    """minillm serve (on device) and, given its path, llama-server, at each level of clients."""
    from ..model import Model

    m = Model(model, threads=threads, device=device)
    m.warm_up()
    out = {"model": os.path.basename(model), "device": m.device, "threads": threads, "n_gen": n_gen, "levels": []}
    for n in levels:
        row = {"clients": n, "in_process_tokens_per_s": in_process(m, n, n_gen)}
        for kind in ("minillm", "llama-server") if llama_server else ("minillm",):
            proc, port = start_server(kind, model, n, threads, llama_server, device=m.device)
            try:
                stream_one(port, request_body(99, 8))  # warm the server's paths
                row[kind] = run_level(port, n, n_gen)
            finally:
                proc.terminate()
                proc.wait(30)
        row["http_over_in_process"] = row["minillm"]["tokens_per_s"] / row["in_process_tokens_per_s"]
        out["levels"].append(row)
        print_row(row, file=sys.stderr)
    return out


def bench_replicas(model: str, levels: list[int], n_gen: int, threads: int, replicas: int) -> dict:
    """`serve --replicas 1` against `--replicas N` with the same flags (`threads` each, slots for
    n / N clients each), streamed and whole answers: how aggregate tokens/s scales with replicas.
    Each server answers a warm-up round of n requests first."""
    out = {"model": os.path.basename(model), "threads_per_replica": threads, "n_gen": n_gen, "levels": []}
    for n in levels:
        row = {"clients": n, "parallel_per_replica": -(-n // replicas)}
        for count in (1, replicas):
            proc, port = start_server("minillm", model, row["parallel_per_replica"], threads, None, replicas=count)
            try:
                run_level(port, n, 8, stream=False)
                row[f"replicas_{count}"] = {kind: run_level(port, n, n_gen, stream=kind == "streamed")
                                            for kind in ("streamed", "whole")}
            finally:
                proc.terminate()
                proc.wait(60)
        for kind in ("streamed", "whole"):
            one, many = row["replicas_1"][kind]["tokens_per_s"], row[f"replicas_{replicas}"][kind]["tokens_per_s"]
            row[f"scaling_{kind}"] = many / one
            print(f"{n:>2} clients, {kind:>8}: 1 replica {one:7.1f} tok/s, {replicas} replicas {many:7.1f} tok/s "
                  f"({many / one:.2f}x)", file=sys.stderr)
        out["levels"].append(row)
    return out


def print_row(row: dict, file=sys.stdout) -> None:
    def cells(r: dict) -> str:
        return (f"{r['tokens_per_s']:7.1f} tok/s  ttft {r['ttft_p50_ms']:6.0f}/{r['ttft_p99_ms']:6.0f} ms  "
                f"gap {r['gap_p50_ms']:5.1f}/{r['gap_p99_ms']:5.1f} ms")

    print(f"{row['clients']:>2} clients  minillm {cells(row['minillm'])}  (in process "
          f"{row['in_process_tokens_per_s']:.1f} tok/s, HTTP {100 * row['http_over_in_process']:.0f}%)", file=file)
    if "llama-server" in row:
        print(f"{'':>10}  llama-server {cells(row['llama-server'])}", file=file)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--llama-server", help="path to llama-server (tests/llama_ref/build.sh builds it)")
    parser.add_argument("--levels", default="1,4,8,16")
    parser.add_argument("-n", "--n-gen", type=int, default=128)
    parser.add_argument("-t", "--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--replicas", type=int, default=0,
                        help="instead: serve --replicas 1 against --replicas N (-t threads each), on Ray Serve")
    parser.add_argument("--device", default="cpu", help="minillm's device: cpu, cuda or auto")
    parser.add_argument("--out", help="also write the results as JSON")
    args = parser.parse_args()
    if not re.fullmatch(r"\d+(,\d+)*", args.levels):
        parser.error("--levels: counts separated by commas")
    levels = [int(v) for v in args.levels.split(",")]
    if args.replicas:
        result = bench_replicas(args.model, levels, args.n_gen, args.threads, args.replicas)
    else:
        result = bench(args.model, levels, args.n_gen, args.threads, args.llama_server, args.device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    print("\n".join(json.dumps(level) for level in result["levels"]))


if __name__ == "__main__":
    main()
