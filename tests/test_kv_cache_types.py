"""Quantized KV caches (-ctk/-ctv q8_0, q4_0) against llama.cpp b11434 run with the same cache
types (tests/data/kv_cache_reference.json, tests/llama_ref/record_kv_types.py); memory; the
batching scheduler and the command line with them."""
import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import DATA, REPORT, model_path

import minillm
from minillm.errors import MinillmError
from minillm.kernels.cpu.ops import ggml_build
from minillm.sampling import SamplingParams
from minillm.serving.scheduler import Request

REF = json.loads((DATA / "kv_cache_reference.json").read_text())
HOST_BUILD = ggml_build()
SAME_BUILD = HOST_BUILD in REF["builds"]   # else another build's logits, compared within a tolerance
CASES = REF["builds"][HOST_BUILD if SAME_BUILD else next(iter(REF["builds"]))]
_models = {}


def quantized_model(name: str, cache_type: str) -> minillm.Model:
    key = (name, cache_type)
    if key not in _models:
        _models[key] = minillm.Model(model_path(name), cache_types=(cache_type, cache_type))
    return _models[key]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_equal_llama_cpp_with_the_same_cache_types(case):
    name, cache_type = case.split("/")
    ref = CASES[case]
    m = quantized_model(name, cache_type)
    ids, n_prompt = ref["ids"], ref["n_prompt"]
    cache = m.new_cache(256)
    rows = [m.eval(ids[:n_prompt], cache, n_prompt - 1)[-1]]
    rows += [m.eval(ids[i:i + 1], cache)[-1] for i in range(n_prompt, len(ids))]
    if SAME_BUILD:
        same = [hashlib.sha256(row.tobytes()).hexdigest() == digest for row, digest in zip(rows, ref["sha256"])]
        REPORT.append(f"{case} KV cache: {sum(same)}/{len(same)} logit rows bit-identical to llama.cpp")
        assert all(same)
    for row, top in zip(rows, ref["top"]):   # another ggml build: the same top tokens, close logits
        assert int(np.argmax(row)) == top[0][0]
        assert np.allclose([row[i] for i, _ in top], [v for _, v in top], atol=0.1)


def test_cache_memory_and_refusals():
    f16 = minillm.load(model_path("smollm2")).new_cache(1024)
    q8 = quantized_model("smollm2", "q8_0").new_cache(1024)
    q4 = quantized_model("smollm2", "q4_0").new_cache(1024)
    assert q8.nbytes / f16.nbytes == pytest.approx(34 / 64) and q4.nbytes / f16.nbytes == pytest.approx(18 / 64)
    for types, message in ((("q8_0", "f16"), "both f16, or both quantized"), (("q5_0", "q5_0"), "expected one of")):
        with pytest.raises(MinillmError, match=message):
            minillm.Model(model_path("smollm2"), cache_types=types)


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_a_memory_budget_holds_more_cells_when_quantized(name):
    """Scheduler(kv_memory=...): the pool as large as the bytes allow (Gemma's windowed rings
    included); q8_0 fits 64/34 as many context cells, so more sequences before preemption."""
    mib = {"smollm2": 64, "gemma3": 192}[name]   # Gemma: 8 sequences' 1,024-row rings in 15 local layers
    pools = {t: quantized_model(name, t).scheduler(parallel=8, n_ctx=2048, kv_memory=mib << 20).pool
             for t in ("f16", "q8_0")}
    for pool in pools.values():
        assert (mib << 20) * 0.97 <= pool.nbytes <= mib << 20
    assert pools["q8_0"].n_cells / pools["f16"].n_cells >= 1.8
    REPORT.append(f"{name}: a {mib} MiB KV pool holds {pools['f16'].n_cells} cells in f16, "
                  f"{pools['q8_0'].n_cells} in q8_0")
    with pytest.raises(MinillmError, match="less than one context of 2048: it needs"):
        quantized_model(name, "f16").scheduler(parallel=8, n_ctx=2048, kv_memory=1 << 20)


@pytest.mark.slow
def test_scheduler_with_a_quantized_cache_is_batch_invariant():
    m = quantized_model("smollm2", "q8_0")
    requests = [Request(f"Tell me about {topic}.", max_tokens=10, id=i,
                        sampling=SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=0.8, seed=i))
                for i, topic in enumerate(["the sea", "bread", "chess", "rain"])]
    scheduler = m.scheduler(parallel=4)
    together = [h.result() for h in [scheduler.submit(r) for r in requests]]
    assert scheduler.pool.nbytes < minillm.load(model_path("smollm2")).scheduler(parallel=4).pool.nbytes * 0.54
    for request, result in zip(requests, together):
        single = m.scheduler(parallel=1).submit(request).result()
        assert result.tokens == single.tokens, request.id
    # the scheduler's rows are the lone-token path: the same greedy tokens as generate
    session_tokens = m.generate("Tell me about bread.", max_tokens=10, temperature=0).tokens
    alone = m.scheduler(parallel=1).submit(Request("Tell me about bread.", max_tokens=10,
                                                   sampling=SamplingParams(temperature=0))).result()
    assert alone.tokens == session_tokens[:len(alone.tokens)]


def test_cli_cache_types(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "minillm", *map(str, args)], capture_output=True, text=True,
                              timeout=600)
    smol = model_path("smollm2")
    out = cli("generate", smol, "-p", "The capital of France is", "-n", "8", "--temp", "0", "--json",
              "-ctk", "q8_0", "-ctv", "q8_0")
    assert out.returncode == 0, out.stderr
    expected = quantized_model("smollm2", "q8_0").generate("The capital of France is", max_tokens=8, temperature=0)
    assert json.loads(out.stdout)["tokens"] == expected.tokens
    bench = cli("bench", smol, "-p", "16", "-n", "8", "-d", "64", "-ctk", "q4_0", "-ctv", "q4_0", "--json")
    assert bench.returncode == 0, bench.stderr
    figures = json.loads(bench.stdout)
    assert figures["depth"] == 64 and figures["cache_type_k"] == "q4_0" and figures["tg_tokens_per_s"] > 0
    bad = cli("generate", smol, "-p", "x", "-ctk", "q8_0")
    assert bad.returncode == 1 and "both f16, or both quantized" in bad.stderr and "Traceback" not in bad.stderr
