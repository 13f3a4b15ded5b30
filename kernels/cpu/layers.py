"""Building blocks that architectures compose inside one compiled function per layer, so a
decode step costs one Python -> Numba call per layer instead of one per operation.

A weight matrix travels as one tuple of uniform type (see minillm/weights.py):
    (data uint8 (flat tiles), scale (NT, K/G, R), bias (NT, K/G or 0, R), code offset, code bits,
     fweight (N, K) float32, n_rows, group, kind, float_format, sb, product)
quantized formats use data (and, but for the 32-block "lanes" formats whose scales live in
data, scale/bias) with kind >= 0; float formats (F32/F16/BF16) use fweight, kind = -1 and
float_format 0/1/2.
"""
import math

import numba as nb
import numpy as np
from numba import types
from numba.extending import overload

from . import ops
from .attention import attention, attention_rows
from .attention_q import attention_quantized, hadamard_rotated, rotation_size, store_kv_quantized
from .f16 import f16_round
from .float_matmul import FLOAT_BF16, FLOAT_F16, FLOAT_F32, float_matmul
from .k_quants import qmatmul_k_lanes
from .lanes import qmatmul_lanes, qmatmul_lanes3
from .matmul import (KIND_Q8_1, PRODUCT_K_LANES, PRODUCT_K_LANES_8X8, PRODUCT_LANES, PRODUCT_LANES_BLOCKS, PRODUCT_Q4_K,
                     PRODUCT_Q6_K, ROW_BY_ROW, qmatmul_q4_k, qmatmul_q6_k, quantize_act)

_SPLIT_BF16 = np.float32(65537.0)  # 2^(24-8) + 1: keeps bfloat16's 8 significant bits

_SER = dict(cache=True, nogil=True)
# Numba compiles the code of every njit function a function calls again into that function,
# so each level of a call chain compiles all below it once more. The wrappers between a layer
# and the kernels (products, attention) are inlined instead: a layer compiles each kernel once.
_WRAPPER = dict(inline="always", cache=True, nogil=True)


@nb.njit(**_SER)
def quantize(x, kind):
    """x (T, K) -> (q (T*K,) int8, d16, s16, n16, d32, s32, n32, n4) for activation kind."""
    T, K = x.shape
    q = np.empty((T, K), np.int8)
    d16 = np.empty((T, K // 16), np.float32)
    s16 = np.empty((T, K // 16), np.float32)
    n16 = np.empty((T, K // 16), np.int32)
    d32 = np.empty((T, K // 32), np.float32)
    s32 = np.empty((T, K // 32), np.float32)
    n32 = np.empty((T, K // 32), np.int32)
    n4 = np.empty((T, K // 4), np.int32)  # sums of the codes of every 4 columns (one SIMD lane of ggml's)
    quantize_act(x, kind, q, d16, s16, n16, d32, s32, n32, n4)
    return q.reshape(T * K), d16, s16, n16, d32, s32, n32, n4


@nb.njit(**_SER)
def _round_to_format(x, fmt):
    out = np.empty_like(x)
    T, K = x.shape
    for t in range(T):
        for k in range(K):
            v = x[t, k]
            if fmt == FLOAT_F16:
                v = f16_round(v)
            elif fmt == FLOAT_BF16:
                c = _SPLIT_BF16 * v
                v = c - (c - v)
            out[t, k] = v
    return out


@nb.njit(**_WRAPPER)
def _apply(w, x, act):
    """out (T, N) = x @ W.T with act = quantize(x, W's kind) (unused for float weights)."""
    data, scale, bias, offset, bits, fweight, n_rows, group, kind, float_format, sb, product = w
    T = x.shape[0]
    out = np.empty((T, n_rows), np.float32)
    if kind < 0:
        float_matmul(fweight, _round_to_format(x, float_format), float_format, out)
        return out
    q, d16, s16, n16, d32, s32, n32, n4 = act
    row_by_row = product >= ROW_BY_ROW
    product = product % ROW_BY_ROW
    if product == PRODUCT_LANES or product == PRODUCT_LANES_BLOCKS:
        qmatmul_lanes(data, bits, kind == KIND_Q8_1, offset, product == PRODUCT_LANES_BLOCKS, q, d32, s32, n4, out)
    elif product == PRODUCT_Q4_K:  # integer scales: int8 bytes in the float32 slots
        qmatmul_q4_k(data, scale.view(np.int8), bias.view(np.int8), sb, q, d32, n32, row_by_row, out)
    elif product == PRODUCT_Q6_K:
        qmatmul_q6_k(data, scale.view(np.int8), sb, q, d32, n4, n16, row_by_row, out)
    elif product == PRODUCT_K_LANES or product == PRODUCT_K_LANES_8X8:
        qmatmul_k_lanes(data, scale.view(np.int8), bias.view(np.int8), sb, bits == 4, offset, q, d32, n4, n16,
                        row_by_row, product == PRODUCT_K_LANES_8X8, out)
    return out


@nb.njit(**_WRAPPER)
def linear(w, x):
    """out (T, N) = x (T, K) @ W.T, activations quantized as llama.cpp pairs them with W."""
    return _apply(w, x, quantize(x, max(w[8], 0)))


@nb.njit(inline="always", cache=True, nogil=True)
def _lanes_together(w1, w2, w3):
    """Whether the products can run as one qmatmul_lanes3: one 32-block format (so one code
    offset and layout, and the same activations) for all (w3 may repeat w1 when there are two)."""
    return ((w1[11] == PRODUCT_LANES or w1[11] == PRODUCT_LANES_BLOCKS) and w2[11] == w1[11] and w3[11] == w1[11]
            and w1[8] == w2[8] and w1[8] == w3[8] and w1[8] >= 0 and w1[3] == w2[3] and w1[3] == w3[3]
            and w1[4] == w2[4] and w1[4] == w3[4])


@nb.njit(**_WRAPPER)
def _lanes3(w1, w2, w3, n_mats, x):
    """(x @ W1.T, x @ W2.T, x @ W3.T or None-like) in one parallel region (see _lanes_together)."""
    q, d16, s16, n16, d32, s32, n32, n4 = quantize(x, w1[8])
    T = x.shape[0]
    o1, o2 = np.empty((T, w1[6]), np.float32), np.empty((T, w2[6]), np.float32)
    o3 = np.empty((T, w3[6] if n_mats == 3 else 0), np.float32)
    qmatmul_lanes3(w1[0], w2[0], w3[0], w1[4], w1[8] == KIND_Q8_1, w1[3], w1[11] == PRODUCT_LANES_BLOCKS,
                   q, d32, s32, n4, o1, o2, o3)
    return o1, o2, o3


@nb.njit(**_WRAPPER)
def linear2(w1, w2, x):
    """(x @ W1.T, x @ W2.T), quantizing x once when both take the same activation kind."""
    if _lanes_together(w1, w2, w1):
        o1, o2, _ = _lanes3(w1, w2, w1, 2, x)
        return o1, o2
    a1 = quantize(x, max(w1[8], 0))
    a2 = a1 if w2[8] == w1[8] else quantize(x, max(w2[8], 0))
    return _apply(w1, x, a1), _apply(w2, x, a2)


@nb.njit(**_WRAPPER)
def linear3(w1, w2, w3, x):
    """(x @ W1.T, x @ W2.T, x @ W3.T), quantizing x once per distinct activation kind."""
    if _lanes_together(w1, w2, w3):
        return _lanes3(w1, w2, w3, 3, x)
    a1 = quantize(x, max(w1[8], 0))
    a2 = a1 if w2[8] == w1[8] else quantize(x, max(w2[8], 0))
    a3 = a1 if w3[8] == w1[8] else (a2 if w3[8] == w2[8] else quantize(x, max(w3[8], 0)))
    return _apply(w1, x, a1), _apply(w2, x, a2), _apply(w3, x, a3)


@nb.njit(**_SER)
def norm(x, weight, eps):
    out = np.empty_like(x)
    ops.rmsnorm(x, weight, eps, out)
    return out


# The kv tuple a layer gets: (kcache, vcache (S, Hkv, D) uint16, kv_pos (S,) int64, slots (T,)
# int64 the cache rows this batch's k/v go to, n_keep, paging). paging is NO_PAGING for one
# sequence's own cache; for the batching scheduler's shared pool (minillm/serving/kv_pool.py) it is
# (row_seq (T,) each row's sequence, tables (n_seq, blocks) int64 its block table, shift (blocks
# of 2^shift rows), n_slots (each sequence's slots)), and every row is computed as if alone.
NO_PAGING = (np.zeros(0, np.int64), np.zeros((0, 0), np.int64), -1, 0)


@nb.njit(**_WRAPPER)
def attend(q, k, v, positions, kv, window, scale, softcap, n_heads, n_kv_heads, head_dim):
    """Store this batch's k/v at their slots, then attention of q over the cache."""
    kcache, vcache, kv_pos, slots, n_keep, paging = kv
    for i in range(slots.shape[0]):
        kv_pos[slots[i]] = positions[i]
    out = np.empty((q.shape[0], n_heads * head_dim), np.float32)
    _store_and_attend(q, k, v, positions, kcache, vcache, kv_pos, slots, n_keep, paging, window, scale, softcap,
                      n_heads, n_kv_heads, head_dim, out)
    return out


def _store_and_attend(q, k, v, positions, kcache, vcache, kv_pos, slots, n_keep, paging, window, scale, softcap,
                      n_heads, n_kv_heads, head_dim, out):
    """The cache's own kernels: F16 (uint16 caches) or q8_0/q4_0 blocks (uint8 caches)."""


@overload(_store_and_attend, inline="always")
def _store_and_attend_impl(q, k, v, positions, kcache, vcache, kv_pos, slots, n_keep, paging, window, scale, softcap,
                           n_heads, n_kv_heads, head_dim, out):
    if kcache.dtype == types.uint8:
        def quantized(q, k, v, positions, kcache, vcache, kv_pos, slots, n_keep, paging, window, scale, softcap,
                      n_heads, n_kv_heads, head_dim, out):
            row_seq, tables, shift, n_slots = paging
            n_rot_k, n_rot_v = rotation_size(head_dim, True), rotation_size(head_dim, False)
            store_kv_quantized(hadamard_rotated(k, n_rot_k), hadamard_rotated(v, n_rot_v), slots, n_kv_heads, head_dim,
                               kcache, vcache)
            rotated = np.empty_like(out)
            own_slots = n_slots if row_seq.shape[0] else kcache.shape[0]
            attention_quantized(hadamard_rotated(q, n_rot_k), positions, row_seq, tables, shift, own_slots, n_keep,
                                kcache, vcache, kv_pos, window, scale, softcap, n_heads, head_dim, rotated)
            out[:] = hadamard_rotated(rotated, n_rot_v)
        return quantized

    def f16(q, k, v, positions, kcache, vcache, kv_pos, slots, n_keep, paging, window, scale, softcap,
            n_heads, n_kv_heads, head_dim, out):
        row_seq, tables, shift, n_slots = paging
        ops.store_kv(k, v, slots, n_kv_heads, head_dim, kcache, vcache)
        if row_seq.shape[0] == 0:
            attention(q, positions, kcache, vcache, kv_pos, n_keep, window, scale, softcap, n_heads, out)
        else:
            attention_rows(q, positions, row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos, window, scale,
                           softcap, n_heads, out)
    return f16


# ---- the operations an architecture's layer is written in (kernels/cuda/layers.py has the
# same names for the GPU; an architecture builds its layer from either module) --------------

@nb.njit(**_SER)
def head_norm(x, weight, eps, n_heads, head_dim):
    """RMS norm of each head: x (T, n_heads*head_dim) -> new array."""
    T = x.shape[0]
    return norm(x.reshape(T * n_heads, head_dim), weight, eps).reshape(T, n_heads * head_dim)


@nb.njit(**_WRAPPER)
def rope_attend(q, k, v, positions, rope_table, kv, q_scale, window, kq_scale, softcap, n_heads, n_kv_heads,
                head_dim, rope_dims, neox):
    """RoPE on q and k (cos/sin rope_table), q *= q_scale, store k/v in the cache, attention
    with scores scaled by kq_scale and soft-capped at softcap (0: not capped)."""
    cos, sin = rope_table
    ops.rope(q, n_heads, head_dim, rope_dims, cos, sin, neox)
    ops.rope(k, n_kv_heads, head_dim, rope_dims, cos, sin, neox)
    if q_scale != 1:
        q *= q_scale
    return attend(q, k, v, positions, kv, window, kq_scale, softcap, n_heads, n_kv_heads, head_dim)


@nb.njit(**_SER)
def add_bias(x, bias):
    """x (T, N) + bias (N,) (ggml_add's broadcast); an empty bias: x as it is."""
    if bias.size == 0:
        return x
    return x + bias


@nb.njit(**_SER)
def scaled(x, s):
    """x * s (ggml_scale); s == 1: x as it is."""
    if s == 1:
        return x
    return x * np.float32(s)


@nb.njit(**_SER)
def add(x, y):
    return x + y


@nb.njit(**_SER)
def swiglu(gate, up):
    out = np.empty_like(gate)
    ops.swiglu(gate, up, out)
    return out


@nb.njit(**_SER)
def geglu(gate, up):
    out = np.empty_like(gate)
    ops.geglu(gate, up, out)
    return out


@nb.njit(**_SER)
def tanh_capped(x, inv_cap, cap):
    """Soft-capping as ggml computes it: ggml_scale by 1/cap, ggml_tanh (tanhf), ggml_scale by cap."""
    out = np.empty_like(x)
    flat, res = x.reshape(-1), out.reshape(-1)
    for i in range(flat.size):
        res[i] = np.float32(math.tanh(flat[i] * inv_cap)) * cap
    return out
