"""Timing a model's passes as llama-bench does: prefill (pp) is one batch of random tokens, decode
(tg) one token at a time, both after `depth` untimed tokens already in the cache. `minillm bench`,
`make gpu-check` and `quantize --eval` all measure speed through these."""
from __future__ import annotations

import time


def filled_cache(model, rng, depth: int, n: int):
    """A cache for depth + n tokens, holding depth random ones (untimed)."""
    cache = model.new_cache(depth + n)
    if depth:
        model.eval(rng.integers(0, model.n_vocab, size=depth), cache, logits_from=depth)
    return cache


def time_prefill(model, rng, n: int, depth: int = 0) -> float:
    """Seconds to evaluate n random tokens in one call (the last one's logits only)."""
    cache = filled_cache(model, rng, depth, n)
    ids = rng.integers(0, model.n_vocab, size=n)
    t = time.perf_counter()
    model.eval(ids, cache, logits_from=n - 1)
    return time.perf_counter() - t


def time_decode(model, rng, n: int, depth: int = 0) -> float:
    """Seconds to evaluate n random tokens one at a time, each with its logits."""
    cache = filled_cache(model, rng, depth, n)
    ids = rng.integers(0, model.n_vocab, size=n)
    t = time.perf_counter()
    for i in range(n):
        model.eval(ids[i:i + 1], cache)
    return time.perf_counter() - t
