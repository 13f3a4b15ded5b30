"""Scalar pieces of ggml's reference quantizers, ported bit for bit, and the 32-value formats.

Ports of ggml-quants.c (quantize_row_{q4_0,q4_1,q5_0,q5_1,q8_0}_ref and the helpers the
K-quants share). Bit identity rules, followed here and in quantize_fit.py and quantize_k.py:
  * every float is float32 and every operation happens in C's order (no fastmath: no
    reassociation, no fused multiply-add); ints are converted with np.float32() before they
    meet a float, since Numba would otherwise widen the expression to float64;
  * C's float-to-int casts truncate (`_trunc_int`), roundf rounds half away from zero
    (`_roundf`), nearest_int is the 1.5*2^23 trick (round half to even, `nearest_int`);
  * float32 -> float16 is round-to-nearest-even on the bits (`f16_bits`), float16 -> float32
    a table lookup (`F16_TO_F32`), as GGML_FP32_TO_FP16 / GGML_FP16_TO_FP32 do.

Block functions take x (one row, float32), i0 (the block's first value), y (the output row,
uint8) and o (the block's byte offset in y).
"""
import math

import numba as nb
import numpy as np

from .unpack import F16_TO_F32

_F = np.float32
GROUP_MAX_EPS = _F(1e-15)
_MAGIC = _F(12582912.0)           # 1.5 * 2^23: adding it rounds to an integer in the mantissa
_FLT_MAX = _F(3.4028234663852886e38)
QK_K = 256

_JIT = dict(cache=True, nogil=True, error_model="numpy")
_JIT_INLINE = dict(cache=True, nogil=True, error_model="numpy", inline="always")
_PAR = dict(cache=True, nogil=True, error_model="numpy", parallel=True)


# ---------------------------------------------------------------------------------------------
# scalar helpers
# ---------------------------------------------------------------------------------------------
@nb.njit(**_JIT_INLINE)
def _trunc_int(v):
    """C's (int)v for a float in int range: truncation toward zero."""
    return np.int32(v)


@nb.njit(**_JIT_INLINE)
def _roundf(v):
    """C's roundf: nearest integer, halves away from zero (v is float32, result float32).
    Written with selects, not branches, so that loops over it vectorize."""
    t = _F(np.trunc(v))
    frac = v - t                                    # exact
    return t + (_F(1.0) if frac >= _F(0.5) else _F(0.0)) - (_F(1.0) if frac <= _F(-0.5) else _F(0.0))


@nb.njit(**_JIT)
def _mantissa_bits(v):
    """The 23 mantissa bits of the float32 v (what ggml's nearest_int reads out of memory)."""
    a = abs(np.float64(v))
    if a != a:
        return np.int64(0x400000)          # the default quiet NaN
    if a == np.inf or a == 0.0:
        return np.int64(0)
    if a < 2.0 ** -126:                    # float32 subnormal
        return np.int64(a * 2.0 ** 149)
    m, _ = math.frexp(a)                   # a = m * 2^e, m in [0.5, 1)
    return np.int64(m * 2.0 ** 24) - (1 << 23)


@nb.njit(**_JIT_INLINE)
def nearest_int(fval):
    """ggml's nearest_int: round to nearest, ties to even (valid for |fval| <= 2^22; outside
    that range it reproduces the same mantissa-bit garbage C would return)."""
    val = fval + _MAGIC
    if val >= _F(8388608.0) and val < _F(16777216.0):
        return np.int32(val) - np.int32(12582912)
    return np.int32((_mantissa_bits(val) & 0x7FFFFF) - 0x400000)


@nb.njit(**_JIT)
def f16_bits(x):
    """float32 -> IEEE half bits, round to nearest even (GGML_FP32_TO_FP16)."""
    sign = np.uint16(0x8000) if math.copysign(1.0, x) < 0 else np.uint16(0)
    a = abs(np.float64(x))
    if a != a:
        return np.uint16(sign | 0x7E00)
    if a >= 65520.0:                       # rounds up to (or is) infinity
        return np.uint16(sign | 0x7C00)
    if a < 2.0 ** -14:                     # half subnormal (or zero): units of 2^-24
        return np.uint16(sign | np.uint16(np.rint(a * 2.0 ** 24)))
    m, e = math.frexp(a)                   # a = m * 2^e, m in [0.5, 1)
    r = np.int64(np.rint(m * 2048.0))      # 11 significant bits, ties to even
    if r == 2048:
        r = 1024
        e += 1
    return np.uint16(sign | ((e + 14) << 10) | (r - 1024))


@nb.njit(**_JIT_INLINE)
def f16_bits_from_u32(u, x):
    """f16_bits for the float32 x whose bits are u: integer rounding for normal halves."""
    a = u & np.uint32(0x7FFFFFFF)
    if a >= np.uint32(0x38800000) and a < np.uint32(0x477FF000):   # 2^-14 <= |x| < 65520
        sign = (u >> np.uint32(16)) & np.uint32(0x8000)
        r = (a + np.uint32(0xFFF) + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
        return np.uint16(sign | (r - np.uint32(0x1C000)))
    return f16_bits(x)


@nb.njit(**_JIT_INLINE)
def bf16_bits_from_u32(u):
    """float32 bits -> bfloat16 bits, round to nearest even (ggml_compute_fp32_to_bf16)."""
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(64))
    return np.uint16((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))


@nb.njit(**_JIT_INLINE)
def _put_f16(y, o, x):
    """Store float32 x as an f16 at y[o:o+2]; return the stored value as float32."""
    h = f16_bits(x)
    y[o] = np.uint8(h & 0xFF)
    y[o + 1] = np.uint8(h >> 8)
    return F16_TO_F32[h]


@nb.njit(**_JIT_INLINE)
def _put_u32(y, o, v):
    for k in range(4):
        y[o + k] = np.uint8((v >> (8 * k)) & 0xFF)


# ---------------------------------------------------------------------------------------------
# the 32-value formats (x is one row, i0 the block's first value, y the output row, o its offset)
# ---------------------------------------------------------------------------------------------
@nb.njit(**_JIT_INLINE)
def _signed_absmax(x, i0, n):
    """The value of largest magnitude (the first one on ties), as ggml's q4_0/q5_0 find it."""
    amax = _F(0.0)
    vmax = _F(0.0)
    for j in range(n):
        v = x[i0 + j]
        if amax < abs(v):
            amax = abs(v)
            vmax = v
    return vmax


@nb.njit(**_JIT_INLINE)
def _min_max(x, i0, n):
    vmin = _FLT_MAX
    vmax = -_FLT_MAX
    for j in range(n):
        v = x[i0 + j]
        if v < vmin:
            vmin = v
        if v > vmax:
            vmax = v
    return vmin, vmax


@nb.njit(**_JIT_INLINE)
def _block_q8_0(x, xu, i0, y, o, one):
    """34 bytes: d f16, qs int8[32]. xu is x's bits (a uint32 view), one a (1,) uint32 scratch.

    The largest |x| is found as the largest magnitude bit pattern, which orders like the
    floats and vectorizes (a float max reduction would not without fastmath); a NaN, where
    ggml's MAX() chain behaves differently, takes the chain itself."""
    amax_bits = np.uint32(0)
    for j in range(32):
        amax_bits = max(amax_bits, xu[i0 + j] & np.uint32(0x7FFFFFFF))
    if amax_bits > np.uint32(0x7F800000):
        amax = _F(0.0)
        for j in range(32):
            a = abs(x[i0 + j])
            amax = amax if amax > a else a
    else:
        one[0] = amax_bits
        amax = one.view(np.float32)[0]
    d = amax / _F(127.0)
    inv = _F(1.0) / d if d != 0 else _F(0.0)
    _put_f16(y, o, d)
    for j in range(32):
        y[o + 2 + j] = np.uint8(np.int32(_roundf(x[i0 + j] * inv)) & 0xFF)


@nb.njit(**_JIT_INLINE)
def _block_q4_0(x, i0, y, o):
    """18 bytes: d f16, qs[16] (value j in the low nibble of byte j, value j+16 in the high)."""
    d = _signed_absmax(x, i0, 32) / _F(-8.0)
    inv = _F(1.0) / d if d != 0 else _F(0.0)
    _put_f16(y, o, d)
    for j in range(16):
        q0 = min(15, _trunc_int(x[i0 + j] * inv + _F(8.5)))
        q1 = min(15, _trunc_int(x[i0 + 16 + j] * inv + _F(8.5)))
        y[o + 2 + j] = np.uint8(q0 | (q1 << 4))


@nb.njit(**_JIT_INLINE)
def _block_q4_1(x, i0, y, o):
    """20 bytes: d f16, m f16, qs[16]."""
    vmin, vmax = _min_max(x, i0, 32)
    d = (vmax - vmin) / _F(15.0)
    inv = _F(1.0) / d if d != 0 else _F(0.0)
    _put_f16(y, o, d)
    _put_f16(y, o + 2, vmin)
    for j in range(16):
        q0 = min(15, _trunc_int((x[i0 + j] - vmin) * inv + _F(0.5)))
        q1 = min(15, _trunc_int((x[i0 + 16 + j] - vmin) * inv + _F(0.5)))
        y[o + 4 + j] = np.uint8(q0 | (q1 << 4))


@nb.njit(**_JIT_INLINE)
def _pack_q5(q0, q1, j, y, o_qs):
    """Low nibbles into qs[j]; returns the two fifth bits placed in the 32-bit qh word."""
    y[o_qs + j] = np.uint8((q0 & 0x0F) | ((q1 & 0x0F) << 4))
    return (np.uint32((q0 & 0x10) >> 4) << j) | (np.uint32((q1 & 0x10) >> 4) << (j + 16))


@nb.njit(**_JIT_INLINE)
def _block_q5_0(x, i0, y, o):
    """22 bytes: d f16, qh u32 (bit j = bit 4 of value j), qs[16]."""
    d = _signed_absmax(x, i0, 32) / _F(-16.0)
    inv = _F(1.0) / d if d != 0 else _F(0.0)
    _put_f16(y, o, d)
    qh = np.uint32(0)
    for j in range(16):
        q0 = min(31, _trunc_int(x[i0 + j] * inv + _F(16.5)))
        q1 = min(31, _trunc_int(x[i0 + 16 + j] * inv + _F(16.5)))
        qh |= _pack_q5(q0, q1, j, y, o + 6)
    _put_u32(y, o + 2, qh)


@nb.njit(**_JIT_INLINE)
def _block_q5_1(x, i0, y, o):
    """24 bytes: d f16, m f16, qh u32, qs[16]."""
    vmin, vmax = _min_max(x, i0, 32)
    d = (vmax - vmin) / _F(31.0)
    inv = _F(1.0) / d if d != 0 else _F(0.0)
    _put_f16(y, o, d)
    _put_f16(y, o + 2, vmin)
    qh = np.uint32(0)
    for j in range(16):
        q0 = _trunc_int((x[i0 + j] - vmin) * inv + _F(0.5)) & 0xFF     # (uint8_t) cast, no clamp
        q1 = _trunc_int((x[i0 + 16 + j] - vmin) * inv + _F(0.5)) & 0xFF
        qh |= _pack_q5(q0, q1, j, y, o + 8)
    _put_u32(y, o + 4, qh)
