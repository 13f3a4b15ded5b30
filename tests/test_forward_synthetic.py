"""Tiny synthetic models of each architecture and format against a plain NumPy forward."""
import numpy as np
import pytest

import minillm
from minillm.kernels.cpu import layers
from synthetic import SyntheticModel, reference_logits

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "F16", "F32", "BF16"]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_forward_matches_numpy_reference(tmp_path, arch, fmt):
    # gemma3 with 7 layers: 6 local sliding-window layers (window 8) and one global layer
    sm = SyntheticModel(arch, fmt, n_layer=2 if arch == "llama" else 7).build()
    model = minillm.load(sm.write(tmp_path / "m.gguf"))
    ids = np.random.default_rng(1).integers(0, sm.n_vocab, 20)
    ours = model.logits(ids)
    ref = reference_logits(sm, ids)
    assert ours.shape == (20, sm.n_vocab) and ours.dtype == np.float32
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    corr = np.corrcoef(ours.ravel(), ref.ravel())[0, 1]
    if fmt in ("F32", "F16"):
        assert rel < 0.005, rel  # only f16 rounding of the KV cache and Q differ
    else:  # activations quantized to 8 bits (BF16: rounded to bf16) as llama.cpp does
        assert rel < 0.06 and corr > 0.998, (rel, corr)


def test_batched_and_incremental_evaluation_agree(tmp_path):
    # Q4_0 products are summed the same way whatever the batch (ggml's vec_dot), and batches
    # under 64 tokens attend the same way: the split cannot change a single bit
    sm = SyntheticModel("gemma3", "Q4_0", n_layer=7).build()
    model = minillm.load(sm.write(tmp_path / "m.gguf"))
    ids = np.random.default_rng(2).integers(0, sm.n_vocab, 24)
    whole = model.logits(ids)
    cache = model.new_cache(24)
    parts = [model.eval(ids[:10], cache), model.eval(ids[10:11], cache), model.eval(ids[11:], cache)]
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    tail = model.logits(ids, start=20)
    np.testing.assert_array_equal(tail, whole[20:])


def test_q4_k_rows_follow_llama_cpps_gemm_and_gemv(tmp_path):
    # llama.cpp's repacked Q4_K kernels sum whole groups of 4 rows (gemm) differently from the
    # rest (gemv): a row evaluated alone matches the last row of a batch of 5, not of a batch of 4
    sm = SyntheticModel("llama", "Q4_K", n_layer=1).build()
    model = minillm.load(sm.write(tmp_path / "m.gguf"))
    w = model.backend.layers[0][1]  # wq
    x = np.random.default_rng(3).standard_normal((5, sm.n_embd)).astype(np.float32)
    alone = layers.linear(w, x[3:4])
    assert np.array_equal(layers.linear(w, x[3:5])[0], alone[0])   # gemv rows (batch of 2)
    assert not np.array_equal(layers.linear(w, x[:4])[3], alone[0])  # gemm group
    np.testing.assert_allclose(layers.linear(w, x[:4])[3], alone[0], rtol=1e-4, atol=1e-4)


def test_out_of_vocabulary_ids_are_refused(tmp_path):
    sm = SyntheticModel("llama", "Q8_0", n_layer=1).build()
    model = minillm.load(sm.write(tmp_path / "m.gguf"))
    with pytest.raises(minillm.MinillmError, match="outside the vocabulary"):
        model.logits([1, sm.n_vocab])


@pytest.mark.parametrize("n_kv_heads,n_q_tiles", [(1, 8), (3, 8), (2, 5), (1, 1)])
def test_tiled_attention_jobs_cover_every_tile_and_balance_two_threads(n_kv_heads, n_q_tiles):
    """Every (KV head, query tile) is one job; two equal runs of jobs (prange's split over two
    threads) get nearly equal work, counted in KV tiles read (tile i reads i + 1)."""
    from minillm.kernels.cpu.attention import Q_TILE, _tiled_job

    n_jobs = n_kv_heads * n_q_tiles
    jobs = [_tiled_job(j, n_jobs, n_kv_heads) for j in range(n_jobs)]
    assert sorted(jobs) == [(h, i * Q_TILE) for h in range(n_kv_heads) for i in range(n_q_tiles)]
    work = [t0 // Q_TILE + 1 for _, t0 in jobs]
    half = (n_jobs + 1) // 2
    assert abs(sum(work[:half]) - sum(work[half:])) <= n_q_tiles


def test_geglu_reads_ggmls_table_by_the_float16_bits():
    """gelu(g) * up as ggml with GGML_GELU_FP16: 0 below -10, g above 10, else the f16 table at
    float16(g)'s bits (rounded to nearest even, subnormals included)."""
    from minillm.kernels.cpu import ops

    rng = np.random.default_rng(0)
    every_f16 = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
    g = np.concatenate([every_f16[np.isfinite(every_f16)], rng.uniform(-12, 12, 100_000),
                        rng.uniform(-1e-4, 1e-4, 100_000)]).astype(np.float32).reshape(4, -1)
    up = rng.uniform(-2, 2, g.shape).astype(np.float32)
    out = np.empty_like(g)
    ops.geglu(g, up, out)
    with np.errstate(over="ignore"):
        table = ops.GELU_F16[g.astype(np.float16).view(np.uint16)]
    expected = np.where(g <= -10, np.float32(0), np.where(g >= 10, g, table) * up).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))


def test_both_ggml_v_expf_variants_are_exp():
    """ggml_v_expf as built for AVX2 and for AVX-512 (minillm takes the host's: the two round
    differently, see docs/fidelity.md): each within 2.5 units in the last place of exp over the
    float32 range (ggml: 1.45 plus the rounding), 0 below it and inf above."""
    import numba as nb

    from minillm.kernels.cpu import ops

    @nb.njit
    def run(x, avx2):
        out = np.empty_like(x)
        for i in range(x.size):
            out[i] = ops.v_expf_avx2(x[i]) if avx2 else ops.v_expf_avx512(x[i])
        return out

    x = np.concatenate([np.linspace(-87.3, 88.7, 300_001), np.linspace(-1, 1, 10_001)]).astype(np.float32)
    exact = np.exp(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    for avx2 in (True, False):
        got = run(x, avx2).astype(np.float64)
        assert (np.abs(got - exact) / ulp).max() <= 2.5, avx2
        edges = run(np.array([-200.0, -104.0, 89.0, 200.0], np.float32), avx2)
        assert edges[0] == 0 and edges[1] == 0 and np.isinf(edges[2]) and np.isinf(edges[3])


def test_a_cpu_model_keeps_freed_activation_memory_in_the_heap(tmp_path):
    """glibc would unmap each freed activation array of more than 128 KiB and fault its pages
    in again on the next pass; a CPU model raises its thresholds once (memory.keep_freed_memory)."""
    import sys

    from minillm import memory

    minillm.load(SyntheticModel("llama", "Q8_0", n_layer=1).build().write(tmp_path / "m.gguf"))
    assert sys.platform.startswith("linux") and memory._kept_freed_memory
    assert memory.keep_freed_memory() is True  # once: a second call changes nothing
