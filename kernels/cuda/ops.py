"""Element-wise kernels and RoPE + KV-cache store, matching minillm.kernels.cpu.ops.

Shapes: T tokens, H query heads, Hkv key/value heads, D head dimension, S cache slots, F the
feed-forward width. The device KV cache is float16 (S, Hkv, D): the CPU keeps the same
f16-rounded values in float32.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ..cpu.ops import GELU_COEF_A, SQRT_2_OVER_PI
from .device import f16_round, pow2_threads
from .launch import launch
from .registry import device, kernel

THREADS = 256

_ROPE_SIG = ("void(float32[:, ::1], float32[:, ::1], float32[:, ::1], int64[::1], int64, int64, int64, "
             "float32[:, ::1], float32[:, ::1], boolean, int64[::1], float16[:, :, ::1], float16[:, :, ::1], int64[::1])")


@kernel(_ROPE_SIG)
def rope_store_kv_kernel(q, k, v, positions, n_heads, n_kv_heads, n_dims, cos_t, sin_t, neox,
                         slots, kcache, vcache, kv_pos):
    """Rotate q (T, H*D) and k (T, Hkv*D) in place, then store k and v rounded to f16 into
    kcache/vcache (S, Hkv, D) at rows slots[t], and kv_pos[slots[t]] = positions[t].

    cos_t/sin_t (T, n_dims/2): the CPU's rope tables (kernels/cpu/ops.rope_angles), so that the
    angles, frequency factors and scaling are computed once, as llama.cpp computes them.
    One thread per (t, head of q then of k, j < D/2): j < n_dims/2 rotates the pair j (neox:
    (j, j + n_dims/2), else (2j, 2j+1)); the other threads carry dims n_dims.. D-1 to the cache.
    Grid over T * (H + Hkv) * D/2 threads."""
    D = kcache.shape[2]
    half_d = D // 2
    half = n_dims // 2
    i = cuda.grid(1)
    if i >= q.shape[0] * (n_heads + n_kv_heads) * half_d:
        return
    j = i % half_d
    head = (i // half_d) % (n_heads + n_kv_heads)
    t = i // (half_d * (n_heads + n_kv_heads))
    is_q = head < n_heads
    h = head if is_q else head - n_heads
    if j < half:
        a = j if neox else 2 * j
        b = j + half if neox else 2 * j + 1
    else:
        a = n_dims + 2 * (j - half)
        b = a + 1
    a += h * D
    b += h * D
    x0 = q[t, a] if is_q else k[t, a]
    x1 = q[t, b] if is_q else k[t, b]
    if j < half:
        c = cos_t[t, j]
        s = sin_t[t, j]
        r0 = x0 * c - x1 * s
        r1 = x0 * s + x1 * c
        x0 = r0
        x1 = r1
        if is_q:
            q[t, a] = x0
            q[t, b] = x1
        else:
            k[t, a] = x0
            k[t, b] = x1
    if not is_q:
        slot = slots[t]
        kcache[slot, h, a - h * D] = x0
        kcache[slot, h, b - h * D] = x1
        vcache[slot, h, a - h * D] = v[t, a]
        vcache[slot, h, b - h * D] = v[t, b]
        if h == 0 and j == 0:
            kv_pos[slot] = positions[t]


@device
def silu_times(g, u):
    """silu(g) * u."""
    return (g / (np.float32(1.0) + np.float32(math.exp(-g)))) * u


@device
def _gelu(x):
    inner = SQRT_2_OVER_PI * x * (np.float32(1.0) + GELU_COEF_A * x * x)
    return np.float32(0.5) * x * (np.float32(1.0) + np.float32(math.tanh(inner)))


@device
def gelu_times(g, u):
    """gelu(g) * u as ggml with GGML_GELU_FP16 (the gelu of an f16 input, rounded to f16)."""
    if g <= np.float32(-10.0):
        return np.float32(0.0)
    if g >= np.float32(10.0):
        return g * u
    return f16_round(_gelu(f16_round(g))) * u


@kernel("void(float32[:, ::1], float32[:, ::1], float32[:, ::1])")
def swiglu_kernel(gate, up, out):
    """out = silu(gate) * up (T, F); grid over T * F threads."""
    i = cuda.grid(1)
    if i < gate.size:
        t = i // gate.shape[1]
        j = i % gate.shape[1]
        out[t, j] = silu_times(gate[t, j], up[t, j])


@kernel("void(float32[:, ::1], float32[:, ::1], float32[:, ::1])")
def geglu_kernel(gate, up, out):
    """out = gelu(gate) * up (see gelu_times)."""
    i = cuda.grid(1)
    if i < gate.size:
        t = i // gate.shape[1]
        j = i % gate.shape[1]
        out[t, j] = gelu_times(gate[t, j], up[t, j])


@kernel("void(float32[:, ::1], float32[:, ::1])")
def add_kernel(x, y):
    """x += y (T, E); grid over T * E threads."""
    i = cuda.grid(1)
    if i < x.size:
        t = i // x.shape[1]
        j = i % x.shape[1]
        x[t, j] += y[t, j]


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------
def _launch(n: int) -> tuple[int, int]:
    """(blocks, threads) for one thread per item: THREADS a block, fewer for tiny batches."""
    threads = pow2_threads(n, hi=THREADS)
    return max(1, (n + threads - 1) // threads), threads


_NO_TABLE = None  # (1, 1) zeros on the device, made on first use: the tables of a store without RoPE


def rope_store_kv(q, k, v, positions, slots, n_heads: int, n_dims: int, cos_t, sin_t, neox: bool,
                  kcache, vcache, kv_pos):
    """RoPE on q and k (in place) and the store of k, v into the f16 cache, in one launch.

    q (T, H*D), k/v (T, Hkv*D) float32; positions, slots (T,) int64; cos_t/sin_t (T, n_dims/2)
    float32 device tables; kcache/vcache (S, Hkv, D) float16; kv_pos (S,) int64. n_dims = 0
    stores without rotating (pass k as q with n_heads 0 to skip q)."""
    T = k.shape[0]
    n_kv_heads, D = kcache.shape[1], kcache.shape[2]
    n = T * (n_heads + n_kv_heads) * (D // 2)
    launch(rope_store_kv_kernel, *_launch(n), q, k, v, positions, n_heads, n_kv_heads, n_dims, cos_t, sin_t,
           bool(neox), slots, kcache, vcache, kv_pos)


def store_kv(k, v, positions, slots, kcache, vcache, kv_pos):
    """Store k, v (T, Hkv*D) into the f16 cache at `slots` without rotating (rope_store_kv with
    no rotary dims and no query heads)."""
    global _NO_TABLE
    if _NO_TABLE is None:
        _NO_TABLE = cuda.to_device(np.zeros((1, 1), np.float32))
    rope_store_kv(k, k, v, positions, slots, 0, 0, _NO_TABLE, _NO_TABLE, False, kcache, vcache, kv_pos)


@kernel("void(float32[:, ::1], float32[::1])")
def add_rows_kernel(x, bias):
    """x[t, j] += bias[j] (T, N); grid over T * N threads."""
    i = cuda.grid(1)
    if i < x.size:
        x[i // x.shape[1], i % x.shape[1]] += bias[i % x.shape[1]]


@kernel("void(float32[:, ::1], float32)")
def scale_kernel(x, s):
    """x *= s (T, N); grid over T * N threads."""
    i = cuda.grid(1)
    if i < x.size:
        x[i // x.shape[1], i % x.shape[1]] *= s


def swiglu(gate, up, out):
    launch(swiglu_kernel, *_launch(gate.size), gate, up, out)
    return out


def geglu(gate, up, out):
    launch(geglu_kernel, *_launch(gate.size), gate, up, out)
    return out


def add_inplace(x, y):
    launch(add_kernel, *_launch(x.size), x, y)
    return x
