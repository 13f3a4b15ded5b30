"""`minillm bench`: load time, prefill and decode throughput, measured like llama-bench
(pp: a batch of random tokens on an empty cache; tg: one token at a time from position 0; with
a depth d, both start after d tokens already in the cache, untimed, as llama-bench -d)."""
from __future__ import annotations

import time

import numpy as np

from ..kv_cache import F16_CACHE
from ..model import Model
from ..timing import time_decode, time_prefill


def run_bench(path, n_prompt: int, n_gen: int, reps: int, threads, on_compile=None, device: str = "cpu",
              cache_types=F16_CACHE, depth: int = 0) -> dict:
    t0 = time.perf_counter()
    model = Model(path, threads=threads, device=device, cache_types=cache_types, on_compile=on_compile)
    load_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    n_ctx = max(n_prompt, n_gen) + 1
    model.warm_up(on_compile)
    model.eval(rng.integers(0, model.n_vocab, size=min(8, n_ctx)), model.new_cache(n_ctx), logits_from=7)

    result = {"model": model.path.name, "device": model.device, "threads": model.threads, "load_s": round(load_s, 3),
              "n_prompt": n_prompt, "n_gen": n_gen, "depth": depth, "cache_type_k": model.cache_types[0],
              "cache_type_v": model.cache_types[1],
              "kv_cache_bytes": model.new_cache(depth + max(n_prompt, n_gen)).nbytes}
    if n_prompt:
        best = min(time_prefill(model, rng, n_prompt, depth) for _ in range(reps))
        result["pp_tokens_per_s"] = round(n_prompt / best, 2)
    if n_gen:
        best = min(time_decode(model, rng, n_gen, depth) for _ in range(reps))
        result["tg_tokens_per_s"] = round(n_gen / best, 2)
    return result


def run_parallel_bench(path, levels: list[int], n_prompt: int, n_gen: int, threads, on_compile=None,
                       device: str = "cpu", reps: int = 1) -> dict:
    """Aggregate throughput of the batching scheduler with N sequences at once, in
    llama-batched-bench's terms: every sequence gets n_prompt random tokens, all prompts are
    evaluated together (S_PP = N * n_prompt / t_pp), then each decodes n_gen tokens, one row a
    sequence a step (S_TG = N * n_gen / t_tg); greedy, end tokens ignored. With reps > 1 the
    levels run in turn reps times and each level reports its median times: a machine whose
    speed drifts over minutes then weighs on every level alike."""
    model = Model(path, threads=threads, device=device, on_compile=on_compile)
    model.warm_up(on_compile)
    rng = np.random.default_rng(0)
    result = {"model": model.path.name, "device": model.device, "threads": model.threads, "n_prompt": n_prompt,
              "n_gen": n_gen, "reps": reps, "levels": []}
    runs = {n_seq: [] for n_seq in levels}  # (t_pp, t_tg) of each repetition
    for _ in range(reps):
        for n_seq in levels:
            runs[n_seq].append(_parallel_run(model, rng, n_seq, n_prompt, n_gen))
    for n_seq in levels:
        t_pp, t_tg = (float(np.median(times)) for times in zip(*runs[n_seq]))
        level = {"parallel": n_seq, "t_pp": round(t_pp, 4), "s_pp": round(n_seq * n_prompt / t_pp, 2),
                 "t_tg": round(t_tg, 4), "s_tg": round(n_seq * n_gen / t_tg, 2)}
        if reps > 1:
            level["s_tg_runs"] = [round(n_seq * n_gen / t, 2) for _, t in runs[n_seq]]
        result["levels"].append(level)
    result["admission"] = admission_gaps(model, rng)
    return result


def _parallel_run(model: Model, rng, n_seq: int, n_prompt: int, n_gen: int) -> tuple[float, float]:
    """(t_pp, t_tg) of one run of run_parallel_bench's level n_seq."""
    from ..sampling import SamplingParams
    from ..serving.scheduler import Request

    scheduler = model.scheduler(parallel=n_seq, n_ctx=n_prompt + n_gen + 2, batch=n_seq * n_prompt)
    prompts = [rng.integers(0, model.n_vocab, size=n_prompt).tolist() for _ in range(n_seq)]
    # one extra token each: n_gen decode rows follow the first token, sampled after prefill
    greedy = SamplingParams(temperature=0)
    handles = [scheduler.submit(Request(p, n_gen + 1, greedy, ignore_eos=True)) for p in prompts]
    t0 = time.perf_counter()
    scheduler.step()  # every prompt in one forward, first tokens sampled
    t_pp = time.perf_counter() - t0
    scheduler.run(handles)
    return t_pp, time.perf_counter() - t0 - t_pp


def admission_gaps(model: Model, rng, long_prompt: int = 1000, before: int = 32) -> dict:
    """A stream's inter-token gaps while a long prompt is admitted beside it: the median of its
    gaps before (decoding alone, 32 tokens in) and the median and p99 of its gaps from the
    submission until the long prompt's first token (greedy, end tokens ignored). The stream's
    own context grows by a token a step meanwhile, so its later gaps cost more even alone."""
    from ..sampling import SamplingParams
    from ..serving.scheduler import Request

    greedy = SamplingParams(temperature=0)
    scheduler = model.scheduler(parallel=2, n_ctx=long_prompt + 1024)
    stream = scheduler.submit(Request(rng.integers(0, model.n_vocab, size=32).tolist(), 1000, greedy,
                                      ignore_eos=True))
    times, big = [], None
    for _ in stream:
        times.append(time.perf_counter())
        if len(times) == before:
            big = scheduler.submit(Request(rng.integers(0, model.n_vocab, size=long_prompt).tolist(), 1, greedy,
                                           ignore_eos=True))
        if big is not None and big.done:
            stream.cancel()
            break
    gaps = np.diff(np.array(times)) * 1e3  # ms; gaps[i] ends at token i + 1
    alone, during = gaps[1:before - 1], gaps[before - 1:]
    return {"prompt": long_prompt, "median_alone_ms": round(float(np.median(alone)), 2),
            "median_ms": round(float(np.median(during)), 2), "p99_ms": round(float(np.percentile(during, 99)), 2),
            "p99_over_median": round(float(np.percentile(during, 99) / np.median(during)), 2),
            "p99_over_median_alone": round(float(np.percentile(during, 99) / np.median(alone)), 2),
            "admission_steps": len(during)}
