"""`minillm bench`: load time, prefill and decode throughput, measured like llama-bench
(pp: a batch of random tokens on an empty cache; tg: one token at a time from position 0)."""
from __future__ import annotations

import time

import numpy as np

from .model import Model


def run_bench(path, n_prompt: int, n_gen: int, reps: int, threads, log=print, device: str = "cpu") -> dict:
    t0 = time.perf_counter()
    model = Model(path, threads=threads, device=device)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    n_ctx = max(n_prompt, n_gen) + 1
    model.warm_up(log=log)
    model.eval(rng.integers(0, model.n_vocab, size=min(8, n_ctx)), model.new_cache(n_ctx), logits_from=7)

    result = {"model": model.path.name, "device": model.device, "threads": model.threads, "load_s": round(load_s, 3),
              "n_prompt": n_prompt, "n_gen": n_gen}
    if n_prompt:
        best = min(_time_prefill(model, rng, n_prompt) for _ in range(reps))
        result["pp_tokens_per_s"] = round(n_prompt / best, 2)
    if n_gen:
        best = min(_time_decode(model, rng, n_gen) for _ in range(reps))
        result["tg_tokens_per_s"] = round(n_gen / best, 2)
    return result


def _time_prefill(model: Model, rng, n: int) -> float:
    ids = rng.integers(0, model.n_vocab, size=n)
    cache = model.new_cache(n)
    t = time.perf_counter()
    model.eval(ids, cache, logits_from=n - 1)
    return time.perf_counter() - t


def _time_decode(model: Model, rng, n: int) -> float:
    ids = rng.integers(0, model.n_vocab, size=n)
    cache = model.new_cache(n)
    t = time.perf_counter()
    for i in range(n):
        model.eval(ids[i:i + 1], cache)
    return time.perf_counter() - t
