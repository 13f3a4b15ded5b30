"""The F16 cache's one-chunk attention walk (kernels/cpu/head_walk.py) against the same steps
written in Numba code, and its in-line expf against libm's."""
import math

import numba as nb
import numpy as np
import pytest

from minillm.kernels.cpu import attention as A
from minillm.kernels.cpu import ops
from minillm.kernels.cpu.head_walk import expf_exact


@nb.njit(cache=True)
def _expf_both(bits):
    x = bits.view(np.float32)
    ours, libm = np.empty_like(x), np.empty_like(x)
    for i in range(x.size):
        ours[i] = expf_exact(x[i])
        libm[i] = np.float32(math.exp(x[i]))  # Numba calls libm's expf for a float32
    return ours, libm


def test_inline_expf_equals_libms_for_every_exponent_attention_takes():
    """Attention's exponents are <= 0 (or NaN): every 61st float32 from -0 down to -inf, the
    range ends (the table's 32 entries, underflow near -103.97) and NaN, bit for bit."""
    bits = np.concatenate([np.arange(0x80000000, 0xFF800001, 61, dtype=np.uint64),
                           np.arange(0xC2CF0000, 0xC2D10000, dtype=np.uint64),  # about -103.5 .. -104.5
                           np.arange(0x80000000, 0x80010000, dtype=np.uint64),  # -0 and the tiniest
                           np.array([0, 0xFF800000, 0xFFC00000, 0x7FC00000], np.uint64)]).astype(np.uint32)
    ours, libm = _expf_both(bits)
    assert np.array_equal(ours.view(np.uint32), libm.view(np.uint32))


@nb.njit(cache=True)
def _walk_both(kcache, vcache, row_at, q16, scale):
    G, D = q16.shape
    k, v = kcache.reshape(kcache.size), vcache.reshape(vcache.size)
    q = q16.reshape(G * D)
    acc, m, s = np.empty(G * D, np.float32), np.empty(G, np.float32), np.empty(G, np.float32)
    A.heads_walk_f16(k, v, row_at, row_at.shape[0], q, scale, acc, m, s, D)
    ref_acc, ref_m, ref_s = np.empty(G * D, np.float32), np.empty(G, np.float32), np.empty(G, np.float32)
    for g in range(G):
        ref_m[g], ref_s[g] = A._head_walk(k, v, row_at * D, q, g * D, scale, np.float32(0.0), ref_acc, g * D, D)
    return acc, m, s, ref_acc, ref_m, ref_s


@pytest.mark.parametrize("D, G, n_cells", [(64, 3, 193), (64, 1, 1), (32, 2, 64), (96, 4, 70), (128, 2, 33),
                                           (256, 4, 100), (64, 3, 0), (64, 12, 70)])
def test_walk_equals_ggmls_steps_one_cell_at_a_time(D, G, n_cells):
    """The blocked walk (scores, then softmax, then sums, 32 cells a pass; the softmax 8 heads
    a vector, so 12 heads take two) gives each head exactly the M, S and f16 V sum of ggml's
    cell-by-cell steps, over cells in any order of the cache's rows, with scores that keep
    setting new maxima (rising keys) and that do not."""
    rng = np.random.default_rng(D * 100 + G * 10 + n_cells)
    rows, n_kv = 300, 2
    kcache = rng.standard_normal((rows, n_kv, D)).astype(np.float16)
    kcache[:, 1] += np.linspace(0, 3, rows, dtype=np.float16)[:, None]  # KV head 1: rising scores
    vcache = (rng.standard_normal((rows, n_kv, D)) * 4).astype(np.float16)
    q16 = rng.standard_normal((G, D)).astype(np.float16).astype(np.float32)
    for kvh in range(n_kv):
        row_at = rng.permutation(rows)[:n_cells] * n_kv + kvh
        got = _walk_both(kcache.view(np.uint16), vcache.view(np.uint16), row_at.astype(np.int64), q16,
                         np.float32(1 / math.sqrt(D)))
        for ours, ref in zip(got[:3], got[3:]):
            assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), (kvh, D, G)


@nb.njit(cache=True)
def _softmax_rows_both(rows, bias, scale):
    """Each row (a multiple of 16 values) through the tiled path's vector steps
    (scaled_masked_max, then exp_sum_rows for AVX-512 and exp_sum_rows8 for AVX2), and through
    their scalar definitions: ggml_v_expf one lane at a time, each SIMD width's hsum added in
    double."""
    n_rows, n = rows.shape
    outs = np.empty((4, n_rows, n), np.float32)
    sums = np.empty((4, n_rows))
    tops = np.empty((2, n_rows), np.float32)
    for r in range(n_rows):
        row = rows[r].copy()
        tops[0, r] = A.scaled_masked_max(row, 0, bias[r], 0, scale, n // 16)
        scaled = rows[r] * scale + bias[r]
        tops[1, r] = scaled.max()
        shift = tops[1, r]
        for variant in range(2):  # 0: AVX-512, 1: AVX2
            vec = row.copy()
            sums[variant, r] = (A.exp_sum_rows(vec, 0, shift, n // 16) if variant == 0
                                else A.exp_sum_rows8(vec, 0, shift, n // 16))
            outs[variant, r] = vec
            ref = np.empty(n, np.float32)
            for i in range(n):
                ref[i] = ops.v_expf_avx512(scaled[i] - shift) if variant == 0 else ops.v_expf_avx2(scaled[i] - shift)
            total = 0.0
            for at in range(0, n, 16 if variant == 0 else 8):
                total += np.float64(A._reduce16(ref, at) if variant == 0 else A._reduce8(ref, at))
            outs[2 + variant, r] = ref
            sums[2 + variant, r] = total
    return outs, sums, tops


def test_the_tiled_softmax_vector_steps_equal_ggmls_scalar_steps():
    """The tiled path's softmax rows in vectors (the mask as ggml's 0/-inf bias, the max, ggml_v_expf
    as built for AVX-512 and for AVX2, the double sum of SIMD-width hsums) bit for bit against
    the same steps one value at a time, over scores that reach exp's underflow."""
    rng = np.random.default_rng(7)
    rows = np.concatenate([rng.normal(0, 3, (60, 64)), rng.uniform(-900, 50, (20, 64))]).astype(np.float32)
    bias = np.where(rng.random(rows.shape) < 0.3, -np.inf, 0).astype(np.float32)
    bias[0] = -np.inf  # a row that sees nothing
    outs, sums, tops = _softmax_rows_both(rows, bias, np.float32(0.125))
    assert np.array_equal(tops[0], tops[1]) and tops[0, 0] == -np.inf
    seen = slice(1, None)  # the masked row's shift is -inf (the caller zeroes it)
    assert np.array_equal(outs[0, seen].view(np.uint32), outs[2, seen].view(np.uint32))
    assert np.array_equal(outs[1, seen].view(np.uint32), outs[3, seen].view(np.uint32))
    assert np.array_equal(sums[0, seen], sums[2, seen]) and np.array_equal(sums[1, seen], sums[3, seen])
    assert (outs[0, seen] == 0).any() and not np.array_equal(outs[0, seen], outs[1, seen])
