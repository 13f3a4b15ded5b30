"""RMS norm and the run-time quantization of activations (llama.cpp's Q8_0 / Q8_1 / Q8_K), alone
or in the launch that computes the row (rmsnorm_quantize, glu_quantize).

One thread block per row. The quantized activations of a (T, K) batch are held as
    words int32   (T, K/4)   the int8 codes, 4 per word (byte j of word i = code 4i + j)
    d16, s16      (T, K/16)  per 16-group: activation scale d and d * sum(codes)
    d32, s32      (T, K/32)  per 32-group: the same (Q8_1: s rounded to f16 as llama.cpp)
exactly the values of minillm.kernels.cpu.matmul.quantize_act (whose int8 (T, K) codes are
`words.view(np.int8)`); the integer sums n16/n32 of the CPU path are not needed here because
GPU weights stay signed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import cuda

from ..cpu.matmul import KIND_Q8_1, KIND_Q8_K  # plain constants: no CPU kernel is compiled
from .device import MAX_THREADS, f16_round, pack4, pow2_threads, row_inv_rms
from .launch import launch
from .ops import gelu_times, silu_times
from .registry import device, kernel

MAX_GROUPS32 = 1024  # rows up to K = 32768 values
MAX_K = MAX_GROUPS32 * 32

QUANT_OUT_SIG = "int32[:, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1]"


@device
def _group_extreme(src, t, g):
    """max |x| over the 32-group g of row t, and the first value reaching it (signed)."""
    amax = np.float32(0.0)
    vmax = np.float32(0.0)
    for j in range(32):
        v = src[t, g * 32 + j]
        if abs(v) > amax:
            amax = abs(v)
            vmax = v
    return amax, vmax


@device
def _quantize_group(src, t, g, mult, clamp, words):
    """Codes rint(x * mult) of 32-group g into 8 words of row t; returns the two 16-half sums."""
    sum_lo = 0
    sum_hi = 0
    for w in range(8):
        k = g * 32 + w * 4
        v0 = round(src[t, k] * mult)
        v1 = round(src[t, k + 1] * mult)
        v2 = round(src[t, k + 2] * mult)
        v3 = round(src[t, k + 3] * mult)
        if clamp:  # Q8_K: min(127, q) as quantize_row_q8_K_ref
            v0 = min(127, v0)
            v1 = min(127, v1)
            v2 = min(127, v2)
            v3 = min(127, v3)
        words[t, g * 8 + w] = pack4(v0, v1, v2, v3)
        if w < 4:
            sum_lo += v0 + v1 + v2 + v3
        else:
            sum_hi += v0 + v1 + v2 + v3
    return sum_lo, sum_hi


@device
def quantize_row(src, t, kind, words, d16, s16, d32, s32, amax_sh, vmax_sh):
    """Quantize row t of src (T, K) float32; every thread of the block must call it.

    amax_sh, vmax_sh: shared float32 (MAX_GROUPS32,) scratch. Threads own 32-groups; Q8_K's
    256-value blocks take their max over 8 groups through the shared arrays."""
    tid = cuda.threadIdx.x
    n_threads = cuda.blockDim.x
    n_groups = src.shape[1] // 32
    if kind != KIND_Q8_K:
        for g in range(tid, n_groups, n_threads):
            quantize_group32(src, t, g, kind, words, d16, s16, d32, s32)
        return
    for g in range(tid, n_groups, n_threads):
        amax, vmax = _group_extreme(src, t, g)
        amax_sh[g] = amax
        vmax_sh[g] = vmax
    cuda.syncthreads()
    for g in range(tid, n_groups, n_threads):
        amax = np.float32(0.0)
        vmax = np.float32(0.0)
        for j in range(g - g % 8, g - g % 8 + 8):  # first max over the 256-block, as the CPU
            if amax_sh[j] > amax:
                amax = amax_sh[j]
                vmax = vmax_sh[j]
        mult = np.float32(-127.0) / vmax if amax != 0 else np.float32(0.0)
        d = np.float32(1.0) / mult if amax != 0 else np.float32(0.0)
        sum_lo, sum_hi = _quantize_group(src, t, g, mult, True, words)
        _store_scales(t, g, kind, d, d, sum_lo, sum_hi, d16, s16, d32, s32)


@device
def quantize_group32(src, t, g, kind, words, d16, s16, d32, s32):
    """Quantize the 32-group g of row t of src for KIND_Q8_0 or KIND_Q8_1 (a group's scale is
    its own: any thread may take any group)."""
    amax, _ = _group_extreme(src, t, g)
    d = amax / np.float32(127.0)
    mult = np.float32(127.0) / amax if amax != 0 else np.float32(0.0)
    sum_lo, sum_hi = _quantize_group(src, t, g, mult, False, words)
    _store_scales(t, g, kind, d, f16_round(d), sum_lo, sum_hi, d16, s16, d32, s32)


@device
def _store_scales(t, g, kind, d, d_stored, sum_lo, sum_hi, d16, s16, d32, s32):
    """Group g's scales from its scale d (stored as d_stored) and its halves' code sums."""
    total = np.float32(sum_lo + sum_hi)
    d32[t, g] = d_stored
    if kind == KIND_Q8_1:
        s32[t, g] = f16_round(d * total)
    else:
        s32[t, g] = d_stored * total
    d16[t, 2 * g] = d_stored
    d16[t, 2 * g + 1] = d_stored
    s16[t, 2 * g] = d_stored * np.float32(sum_lo)
    s16[t, 2 * g + 1] = d_stored * np.float32(sum_hi)


@device
def _take_residual(x, t, res, has_res):
    """x[t] = res[t] + x[t] where has_res (the residual add a norm's launch takes over, as
    layers.add computes it); the row is the block's to read after."""
    if has_res:
        for j in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
            x[t, j] = res[t, j] + x[t, j]
        cuda.syncthreads()


@device
def _normalize_row(x, t, weight, eps, out, red_sh):
    inv = row_inv_rms(x, t, eps, red_sh)
    for j in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        out[t, j] = (x[t, j] * inv) * weight[j]


_RESIDUAL = "float32[:, ::1], boolean"  # res, has_res: x += res first where has_res (else res unread)


@kernel(f"void(float32[:, ::1], {_RESIDUAL}, float32[::1], float32, float32[:, ::1])")
def rmsnorm_kernel(x, res, has_res, weight, eps, out):
    """out (R, W) = x / rms(x) * weight per row, x = res + x first where has_res; grid R blocks
    (R = T, or T * heads for head norms)."""
    red_sh = cuda.shared.array(MAX_THREADS, np.float64)
    _take_residual(x, cuda.blockIdx.x, res, has_res)
    _normalize_row(x, cuda.blockIdx.x, weight, eps, out, red_sh)


@kernel(f"void(float32[:, ::1], int64, {QUANT_OUT_SIG})")
def quantize_kernel(x, kind, words, d16, s16, d32, s32):
    """Quantize x (T, K); grid T blocks."""
    amax_sh = cuda.shared.array(MAX_GROUPS32, np.float32)
    vmax_sh = cuda.shared.array(MAX_GROUPS32, np.float32)
    quantize_row(x, cuda.blockIdx.x, kind, words, d16, s16, d32, s32, amax_sh, vmax_sh)


@kernel(f"void(float32[:, ::1], {_RESIDUAL}, float32[::1], float32, int64, float32[:, ::1], {QUANT_OUT_SIG})")
def rmsnorm_quantize_kernel(x, res, has_res, weight, eps, kind, out, words, d16, s16, d32, s32):
    """out = rmsnorm(x) * weight, then out quantized (one launch), x = res + x first where
    has_res; grid T blocks."""
    red_sh = cuda.shared.array(MAX_THREADS, np.float64)
    amax_sh = cuda.shared.array(MAX_GROUPS32, np.float32)
    vmax_sh = cuda.shared.array(MAX_GROUPS32, np.float32)
    t = cuda.blockIdx.x
    _take_residual(x, t, res, has_res)
    _normalize_row(x, t, weight, eps, out, red_sh)
    cuda.syncthreads()  # the row's normalized values, written by all threads, are read by group owners
    quantize_row(out, t, kind, words, d16, s16, d32, s32, amax_sh, vmax_sh)


GLU_SILU, GLU_GELU = 0, 1  # glu_quantize's gate functions (SwiGLU, GeGLU)


@kernel(f"void(float32[:, ::1], float32[:, ::1], int64, int64, float32[:, ::1], {QUANT_OUT_SIG})")
def glu_quantize_kernel(gate, up, glu, kind, out, words, d16, s16, d32, s32):
    """out = silu(gate) * up (glu GLU_SILU) or gelu(gate) * up (GLU_GELU), then out quantized
    (one launch); grid T blocks."""
    amax_sh = cuda.shared.array(MAX_GROUPS32, np.float32)
    vmax_sh = cuda.shared.array(MAX_GROUPS32, np.float32)
    t = cuda.blockIdx.x
    for j in range(cuda.threadIdx.x, gate.shape[1], cuda.blockDim.x):
        if glu == GLU_SILU:
            out[t, j] = silu_times(gate[t, j], up[t, j])
        else:
            out[t, j] = gelu_times(gate[t, j], up[t, j])
    cuda.syncthreads()
    quantize_row(out, t, kind, words, d16, s16, d32, s32, amax_sh, vmax_sh)


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------
@dataclass
class QActivations:
    """Device buffers of a quantized (T, K) activation batch (see the module doc)."""

    kind: int
    words: object  # int32 (T, K/4)
    d16: object    # float32 (T, K/16)
    s16: object
    d32: object    # float32 (T, K/32)
    s32: object

    @classmethod
    def empty(cls, n_tokens: int, n_cols: int, kind: int) -> "QActivations":
        if n_cols % 32 or n_cols > MAX_K:
            raise ValueError(f"cannot quantize rows of {n_cols} values (a multiple of 32 up to {MAX_K})")
        if kind == KIND_Q8_K and n_cols % 256:
            raise ValueError(f"Q8_K needs rows of a multiple of 256 values, not {n_cols}")
        f32 = np.float32
        return cls(kind, cuda.device_array((n_tokens, n_cols // 4), np.int32),
                   cuda.device_array((n_tokens, n_cols // 16), f32), cuda.device_array((n_tokens, n_cols // 16), f32),
                   cuda.device_array((n_tokens, n_cols // 32), f32), cuda.device_array((n_tokens, n_cols // 32), f32))

    @property
    def shape(self) -> tuple[int, int]:
        return self.words.shape[0], self.words.shape[1] * 4

    def scales(self, group: int):
        """(d, s) for weights of group size 16 or 32."""
        return (self.d16, self.s16) if group == 16 else (self.d32, self.s32)


def _fits(act, n_tokens, n_cols, kind):
    return act is not None and act.shape == (n_tokens, n_cols) and act.kind == kind


def rmsnorm(x, weight, eps: float, out, res=None):
    """out (R, W) = rmsnorm(x) * weight on device arrays; with res (R, W), x = res + x first
    (x is written)."""
    rows, width = x.shape
    launch(rmsnorm_kernel, rows, pow2_threads(width, hi=MAX_THREADS), x, *_residual(x, res), weight,
           np.float32(eps), out)
    return out


def quantize(x, kind: int, act: QActivations | None = None) -> QActivations:
    """Quantize device x (T, K) float32 for activation kind `kind` (into act when it fits)."""
    T, K = x.shape
    if not _fits(act, T, K, kind):
        act = QActivations.empty(T, K, kind)
    launch(quantize_kernel, T, pow2_threads(K // 32), x, kind, act.words, act.d16, act.s16, act.d32, act.s32)
    return act


def rmsnorm_quantize(x, weight, eps: float, kind: int, out, act: QActivations | None = None,
                     res=None) -> QActivations:
    """out = rmsnorm(x) * weight and its quantization, in one launch (x = res + x first, as
    rmsnorm)."""
    T, K = x.shape
    if not _fits(act, T, K, kind):
        act = QActivations.empty(T, K, kind)
    launch(rmsnorm_quantize_kernel, T, pow2_threads(K, hi=MAX_THREADS), x, *_residual(x, res),
           weight, np.float32(eps), kind, out, act.words, act.d16, act.s16, act.d32, act.s32)
    return act


def _residual(x, res) -> tuple:
    """A norm kernel's (res, has_res) arguments: x itself stands in, unread, for no residual."""
    if res is None:
        return x, False
    if res.shape != x.shape:
        raise ValueError(f"a residual of shape {res.shape} for rows of shape {x.shape}")
    return res, True


def glu_quantize(gate, up, glu: int, kind: int, out, act: QActivations | None = None) -> QActivations:
    """out = silu(gate) * up or gelu(gate) * up (glu) and its quantization, in one launch."""
    T, K = gate.shape
    if not _fits(act, T, K, kind):
        act = QActivations.empty(T, K, kind)
    launch(glu_quantize_kernel, T, pow2_threads(K, hi=MAX_THREADS),
           gate, up, glu, kind, out, act.words, act.d16, act.s16, act.d32, act.s32)
    return act
