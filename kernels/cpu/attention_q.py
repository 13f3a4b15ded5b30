"""Attention over a quantized KV cache (-ctk/-ctv q8_0 or q4_0), computed as ggml's CPU
flash_attn_ext computes it then: with a quantized K or V ggml takes neither its tiled nor its
split path, so every query row (prefill, decode, a scheduler's row) is "one chunk":

    the query head is quantized to q8_0 (ggml's x86 quantize_row_q8_0);
    score = vec_dot(K row, query) (ggml_vec_dot_q8_0_q8_0 / _q4_0_q8_0: per 32-block the
            integer sums of 8 lanes of 4 values, acc[l] = fma(d_k * d_q, sum, acc[l]), then
            hsum_float_8), times the scale, soft-capped;
    online softmax cell by cell with the V sum in float32: a new maximum rescales the sum
            (VKQ *= exp(M_old - M)), then VKQ = fma(v, weight, VKQ) with v the dequantized row.

Keys and values are written as ggml's set_rows writes them: q8_0 with the CPU's
quantize_row_q8_0 (d = amax/127, codes rint(x * 127/amax)), q4_0 with quantize_row_q4_0_ref.

Before that, llama.cpp rotates (its "attention rotation", llama-kv-cache.cpp): with a quantized K
the queries and keys, with a quantized V the values, are multiplied by an orthonormal
Walsh-Hadamard matrix in pieces of n values (K: 64, doubled while the head size allows; V: 64),
which spreads outliers across a block before it is quantized; the attention output is rotated
back with V's matrix. ggml computes the product as a fast transform (ggml_compute_forward_fwht):
scale by 1/sqrt(n) first, then the butterflies u + v, u - v, each rounded once.

Shapes: kcache/vcache (S, Hkv, D/32 * block bytes) uint8, each head's row the blocks of its D
values; cells, slots and masks as kernels/cpu/attention.py.
"""
import math

import numba as nb
import numpy as np

from .attention import (SPLIT_PARTS, _NO_TABLE, _capped, _first_cell, _run_rows, head_jobs, walk_heads,
                        whole_rows)
from .f16 import f16_bits, f16_round
from .fma import fma
from .head_walk import heads_walk_q, walk_fits
from .quantize_scalar import _block_q4_0
from .simd import dot_q_lanes, f32_mad_16, f32_rescale_add_16, unpack_q4_0_codes, unpack_q8_0_codes
from .unpack import F16_TO_F32

KV_Q8_0, KV_Q4_0 = 1, 2

_PAR = dict(parallel=True, cache=True, nogil=True)
_SER = dict(cache=True, nogil=True)
_INLINE = dict(inline="always", cache=True, nogil=True)


@nb.njit(**_INLINE)
def rotation_size(head_dim, keys):
    """llama.cpp's Hadamard piece for K (the largest power-of-two multiple of 64 dividing the
    head) or V (64); 0 when the head is not a multiple of 64 (no rotation)."""
    if head_dim % 64:
        return 0
    n = 64
    while keys and head_dim % (2 * n) == 0:
        n *= 2
    return n


@nb.njit(**_SER)
def hadamard_rotated(x, n):
    """A copy of x (T, W) with every piece of n values (W a multiple of n) multiplied by the
    orthonormal Walsh-Hadamard matrix, as ggml's fast transform rounds it."""
    out = x.copy()
    if n == 0:
        return out
    scale = np.float32(1.0) / np.float32(math.sqrt(np.float32(n)))
    T, W = out.shape
    for t in range(T):
        for c in range(0, W, n):
            for j in range(n):
                out[t, c + j] = out[t, c + j] * scale
            span = 1
            while span < n:
                for i in range(c, c + n, 2 * span):
                    for j in range(i, i + span):
                        u, v = out[t, j], out[t, j + span]
                        out[t, j] = u + v
                        out[t, j + span] = u - v
                span *= 2
    return out


@nb.njit(**_INLINE)
def kv_type_of(row_bytes, D):
    """The block format of a cache whose rows of D values take row_bytes bytes."""
    return KV_Q8_0 if row_bytes == D // 32 * 34 else KV_Q4_0


@nb.njit(**_INLINE)
def _block_q8_0_x86(x, i0, y, o):
    """ggml's x86 quantize_row_q8_0 of 32 values: d = amax/127 (f16), q = rint(x * 127/amax)."""
    amax = np.float32(0.0)
    for j in range(32):
        amax = max(amax, abs(x[i0 + j]))
    h = f16_bits(amax / np.float32(127.0))
    y[o], y[o + 1] = np.uint8(h & 0xFF), np.uint8(h >> 8)
    inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
    for j in range(32):
        y[o + 2 + j] = np.uint8(np.int32(np.rint(x[i0 + j] * inv)) & 0xFF)


@nb.njit(**_SER)
def store_kv_quantized(k, v, slots, n_kv_heads, head_dim, kcache, vcache):
    """Write k, v (T, Hkv*D) into cache rows `slots`, each head's D values as blocks."""
    k_type = kv_type_of(kcache.shape[2], head_dim)
    v_type = kv_type_of(vcache.shape[2], head_dim)
    for t in range(k.shape[0]):
        s = slots[t]
        for h in range(n_kv_heads):
            for b in range(head_dim // 32):
                i0 = h * head_dim + 32 * b
                if k_type == KV_Q8_0:
                    _block_q8_0_x86(k[t], i0, kcache[s, h], 34 * b)
                else:
                    _block_q4_0(k[t], i0, kcache[s, h], 18 * b)
                if v_type == KV_Q8_0:
                    _block_q8_0_x86(v[t], i0, vcache[s, h], 34 * b)
                else:
                    _block_q4_0(v[t], i0, vcache[s, h], 18 * b)


_ONES = np.ones(2048, np.float32)    # block scales of 1: the codes as they are


@nb.njit(**_INLINE)
def _unpack_row(cache, row, h, D, q8, scale_values, codes, scales):
    """Row `row`, head h of a quantized cache (P, H, R) as float32: codes (D,) the codes
    (small integers, exact), scales (D/32,) the block scales; with scale_values, codes * scale
    (the values, dequantize_row_q8_0 / _q4_0), a vector step per block (simd.py)."""
    nbytes = 34 if q8 else 18
    for b in range(D // 32):
        o = nbytes * b
        scales[b] = F16_TO_F32[np.int64(cache[row, h, o]) | (np.int64(cache[row, h, o + 1]) << 8)]
    start = (row * cache.shape[1] + h) * cache.shape[2]
    factors = scales if scale_values else _ONES
    if q8:
        unpack_q8_0_codes(codes, 0, cache, start, 34, factors, D // 32)
    else:
        unpack_q4_0_codes(codes, 0, cache, start, 18, factors, D // 32)


@nb.njit(**_INLINE)
def _dot(kc, kd, qq, qd, g, D, dd):
    """ggml_vec_dot_{q8_0,q4_0}_q8_0 of a K row (codes kc, block scales kd) and query g (codes
    qq[g], scales qd[g]), as ggml's AVX2 code: per 32-block, 8 lanes each summing the products
    of 4 neighbouring codes (integers below 2^24: exact in float32, in any order), lane l's
    acc = fma(d_k * d_q, sum, acc); then hsum_float_8 (simd.dot_q_lanes). dd (D/32,) scratch."""
    for b in range(D // 32):
        dd[b] = kd[b] * qd[g, b]
    return dot_q_lanes(kc, qq, g * D, dd, D // 32)


@nb.njit(**_INLINE)
def _queries_q8_0(q, t, h0, G, D):
    """ggml's x86 quantize_row_q8_0 of the G query heads from h0 of token t: (codes (G, D)
    as float32, block scales (G, D/32) float32 as the f16 values)."""
    qq = np.empty((G, D), np.float32)
    qd = np.empty((G, D // 32), np.float32)
    for g in range(G):
        base = (h0 + g) * D
        for b in range(D // 32):
            amax = np.float32(0.0)
            for j in range(32):
                amax = max(amax, abs(q[t, base + 32 * b + j]))
            qd[g, b] = f16_round(amax / np.float32(127.0))
            inv = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
            for j in range(32):
                qq[g, 32 * b + j] = np.rint(q[t, base + 32 * b + j] * inv)
    return qq, qd


@nb.njit(**_SER)
def _one_chunk_q(qq, qd, kcache, vcache, kvh, scale, softcap, out, t, h0, unit_rows):
    """ggml's one_chunk for the G heads of (qq, qd) sharing KV head kvh, over every cell a query
    sees (unit_rows: their rows for KV head 0, attention._run_rows); writes the normalized
    result of head h0 + g to out[t]."""
    G, D = qq.shape
    k_q8 = kv_type_of(kcache.shape[2], D) == KV_Q8_0
    v_q8 = kv_type_of(vcache.shape[2], D) == KV_Q8_0
    if softcap == 0 and walk_fits(G, D):
        rows = unit_rows + kvh
        sums, m_w, s_w = np.empty(G * D, np.float32), np.empty(G, np.float32), np.empty(G, np.float32)
        heads_walk_q(kcache.reshape(kcache.size), vcache.reshape(vcache.size), rows, rows.shape[0], qq.reshape(G * D),
                     qd.reshape(qd.size), scale, sums, m_w, s_w, D, k_q8, v_q8)
        for g in range(G):
            inv = np.float32(1.0) / s_w[g] if s_w[g] != 0 else np.float32(0.0)
            for d in range(D):
                out[t, (h0 + g) * D + d] = sums[g * D + d] * inv
        return
    # soft-capping (Gemma 2), or a group larger than the walk takes: the same steps, a cell at a time
    kc, vrow = np.empty(D, np.float32), np.empty(D, np.float32)   # a cell's K codes, V values
    kd, vd = np.empty(D // 32, np.float32), np.empty(D // 32, np.float32)
    acc = np.zeros((G, D), np.float32)
    m = np.full(G, -np.inf, np.float32)
    s_sum = np.zeros(G, np.float32)
    dd = np.empty(D // 32, np.float32)
    for at in unit_rows:
        row = at // kcache.shape[1]  # the cell's row of the cache
        _unpack_row(kcache, row, kvh, D, k_q8, False, kc, kd)
        _unpack_row(vcache, row, kvh, D, v_q8, True, vrow, vd)
        for g in range(G):
            score = _capped(_dot(kc, kd, qq, qd, g, D, dd) * scale, softcap)
            if score > m[g]:
                ms = np.float32(math.exp(m[g] - score))
                m[g] = score
                for d in range(0, D, 16):
                    f32_rescale_add_16(acc, g * D + d, vrow, d, ms)      # acc * ms + v
                s_sum[g] = fma(s_sum[g], ms, np.float32(1.0))
            else:
                vs = np.float32(math.exp(score - m[g]))
                for d in range(0, D, 16):
                    f32_mad_16(acc, g * D + d, vrow, d, vs)              # fma(v, vs, acc)
                s_sum[g] = s_sum[g] + vs
    for g in range(G):
        inv = np.float32(1.0) / s_sum[g] if s_sum[g] != 0 else np.float32(0.0)
        for d in range(D):
            out[t, (h0 + g) * D + d] = acc[g, d] * inv


@nb.njit(**_PAR)
def attention_quantized(q, q_pos, row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos, window, scale,
                        softcap, n_heads, head_dim, out):
    """out (T, H*D): every row of q as a lone query over its sequence's cells: its own cache
    (row_seq empty, n_slots the cache's slots) or a shared pool through block tables
    (attention.attention_rows); the result of a row never depends on the others."""
    T, D = q.shape[0], head_dim
    group = n_heads // kcache.shape[1]
    if softcap != 0:
        scale = np.float32(scale / softcap)
    pieces, starts = head_jobs(whole_rows(T), q_pos, window, n_slots, n_heads, group, walk_heads(group, D),
                               SPLIT_PARTS)
    own = row_seq.shape[0] == 0
    for job in nb.prange(SPLIT_PARTS):
        unit_rows, rows_of = _NO_TABLE, -1  # the row's cell rows (KV head 0), found for row rows_of
        for p in range(starts[job], starts[job + 1]):
            t, h0, G = pieces[p, 0], pieces[p, 1], pieces[p, 2]
            qq, qd = _queries_q8_0(q, t, h0, G, D)
            if t != rows_of:  # a job's pieces are row-major: a row's KV heads share its cells
                table = _NO_TABLE if own else tables[row_seq[t]]
                newest = q_pos[-1] if own else q_pos[t]
                unit_rows = _run_rows(_first_cell(q_pos[t], window), q_pos[t] + 1, q_pos[t], newest, n_keep, n_slots,
                                      kv_pos, table, np.int64(-1) if own else shift, window, kcache.shape[1])
                rows_of = t
            _one_chunk_q(qq, qd, kcache, vcache, h0 // group, scale, softcap, out, t, h0, unit_rows)
