"""ggml's K-quant reference quantizers (quantize_row_q{2..6}_K_ref), ported bit for bit.

Without an importance matrix, ggml_quantize_chunk calls these `_ref` row functions for every
K-quant type (quantize_q4_K etc. with quant_weights == NULL), so they are what llama-quantize
produces. The float rules of quantize_scalar.py apply. Each super-block of 256 values is done
in two halves: a fit of its groups (quantize_fit.py; the row drivers may instead use the
vectorized lane fits, which give the same numbers) and a finish that rounds the group scales
to the stored precision, recomputes the codes from them and packs the bytes.
"""
import math

import numba as nb
import numpy as np

from .quantize_fit import _make_q3_quants, _make_qkx2_quants, _make_qx_quants
from .quantize_scalar import GROUP_MAX_EPS, QK_K, _F, _JIT, _JIT_INLINE, _put_f16, nearest_int
# ---------------------------------------------------------------------------------------------
# packing helpers
# ---------------------------------------------------------------------------------------------
@nb.njit(**_JIT_INLINE)
def _pack_2bit(L, y, o):
    """qs[64] of Q2_K/Q3_K: byte j/4+l of each 128-half holds values l, l+32, l+64, l+96."""
    for j in range(0, QK_K, 128):
        for l in range(32):
            y[o + j // 4 + l] = np.uint8(L[j + l] | (L[j + l + 32] << 2)
                                         | (L[j + l + 64] << 4) | (L[j + l + 96] << 6))


@nb.njit(**_JIT_INLINE)
def _scale_min_k4(j, y, o):
    """get_scale_min_k4: the 6-bit scale and min of sub-block j from scales[12] at y[o]."""
    if j < 4:
        return y[o + j] & 63, y[o + j + 4] & 63
    sc = (y[o + j + 4] & 0xF) | ((y[o + j - 4] >> 6) << 4)
    m = (y[o + j + 4] >> 4) | ((y[o + j] >> 6) << 4)
    return sc, m


@nb.njit(**_JIT_INLINE)
def _pack_scale_min_k4(j, ls, lm, y, o):
    """The inverse of _scale_min_k4 (scales[12] must start zeroed for j >= 4 to OR into)."""
    if j < 4:
        y[o + j] = np.uint8(ls)
        y[o + j + 4] = np.uint8(lm)
    else:
        y[o + j + 4] = np.uint8((ls & 0xF) | ((lm & 0xF) << 4))
        y[o + j - 4] |= np.uint8((ls >> 4) << 6)
        y[o + j] |= np.uint8((lm >> 4) << 6)


# ---------------------------------------------------------------------------------------------
# K-quant super-blocks of 256 values. Scratch arrays (per row, reused for every block):
#   L int32 (256) codes, Laux int32 (32), weights float32 (32), scales/mins float32 (16)
# ---------------------------------------------------------------------------------------------
@nb.njit(**_JIT)
def _fit_q2_k(x, i0, L, Laux, weights, scales, mins):
    """Q2_K's first half: 16 groups of 16 fitted with make_qkx2_quants (weights |x|)."""
    for j in range(16):
        for l in range(16):
            weights[l] = abs(x[i0 + 16 * j + l])
        scales[j], mins[j] = _make_qkx2_quants(16, 3, x, i0 + 16 * j, weights, L, 16 * j, Laux,
                                               _F(-0.5), _F(0.1), 15, True)


@nb.njit(**_JIT)
def _block_q2_k(x, i0, y, o, L, Laux, weights, scales, mins):
    """84 bytes: scales[16] (low nibble scale, high nibble min), qs[64], d f16, dmin f16."""
    _fit_q2_k(x, i0, L, Laux, weights, scales, mins)
    _finish_q2_k(x, i0, y, o, L, scales, mins)


@nb.njit(**_JIT)
def _finish_q2_k(x, i0, y, o, L, scales, mins):
    """Q2_K's second half: 4-bit scales and mins, then the codes again from the rounded ones."""
    o_d, o_dmin = o + 80, o + 82
    max_scale = _F(0.0)
    max_min = _F(0.0)
    for j in range(16):
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    q4scale = _F(15.0)
    if max_scale > 0:
        iscale = q4scale / max_scale
        for j in range(16):
            y[o + j] = np.uint8(nearest_int(iscale * scales[j]) & 0xFF)
        d = _put_f16(y, o_d, max_scale / q4scale)
    else:
        for j in range(16):
            y[o + j] = 0
        d = _put_f16(y, o_d, _F(0.0))
    if max_min > 0:
        iscale = q4scale / max_min
        for j in range(16):
            y[o + j] |= np.uint8((nearest_int(iscale * mins[j]) << 4) & 0xFF)
        dmin = _put_f16(y, o_dmin, max_min / q4scale)
    else:
        dmin = _put_f16(y, o_dmin, _F(0.0))
    _codes_q2_k(x, i0, y, o, L, d, dmin)


@nb.njit(**_JIT)
def _codes_q2_k(x, i0, y, o, L, d, dmin):
    """The codes again from the stored scales (scales[16] at y[o], d and dmin), packed."""
    for j in range(16):
        dj = d * _F(y[o + j] & 0xF)
        if dj == 0:
            continue
        mj = dmin * _F(y[o + j] >> 4)
        for ii in range(16):
            L[16 * j + ii] = max(0, min(3, nearest_int((x[i0 + 16 * j + ii] + mj) / dj)))
    _pack_2bit(L, y, o + 16)


@nb.njit(**_JIT)
def _block_q3_k(x, i0, y, o, L, Laux, weights, scales, mins):
    """110 bytes: hmask[32], qs[64], scales[12] (16 packed 6-bit scales), d f16."""
    o_sc, o_d = o + 96, o + 108
    max_scale = _F(0.0)
    amax = _F(0.0)
    for j in range(16):
        scales[j] = _make_q3_quants(16, 4, x, i0 + 16 * j, L, 16 * j)
        if abs(scales[j]) > amax:
            amax = abs(scales[j])
            max_scale = scales[j]
    for k in range(12):
        y[o_sc + k] = 0
    if max_scale != 0:
        iscale = _F(-32.0) / max_scale
        for j in range(16):
            l = ((nearest_int(iscale * scales[j]) + 128) & 0xFF) - 128     # (int8_t) cast
            _pack_q3_scale(j, max(-32, min(31, l)) + 32, y, o_sc)
        d_all = _put_f16(y, o_d, _F(1.0) / iscale)
    else:
        d_all = _put_f16(y, o_d, _F(0.0))
    _codes_q3_k(x, i0, y, o, L, d_all)


@nb.njit(**_JIT_INLINE)
def _pack_q3_scale(j, l, y, o_sc):
    """Scale j's 6-bit code l into scales[12] at y[o_sc] (which starts zeroed)."""
    if j < 8:
        y[o_sc + j] = np.uint8(l & 0xF)
    else:
        y[o_sc + j - 8] |= np.uint8((l & 0xF) << 4)
    y[o_sc + j % 4 + 8] |= np.uint8((l >> 4) << (2 * (j // 4)))


@nb.njit(**_JIT)
def _codes_q3_k(x, i0, y, o, L, d_all):
    """The codes again from the stored 6-bit scales and d_all; hmask and qs packed."""
    o_qs, o_sc = o + 32, o + 96
    for j in range(16):
        lo = np.int32(y[o_sc + j] & 0xF) if j < 8 else np.int32(y[o_sc + j - 8] >> 4)
        hi = (np.int32(y[o_sc + 8 + j % 4]) >> np.int32(2 * (j // 4))) & 3
        sc = (lo | (hi << 4)) - 32
        d = d_all * _F(sc)
        if d == 0:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-4, min(3, nearest_int(x[i0 + 16 * j + ii] / d))) + 4
    for k in range(32):
        y[o + k] = 0
    m = 0
    hm = 1
    for j in range(QK_K):
        if L[j] > 3:
            y[o + m] |= np.uint8(hm)
            L[j] -= 4
        m += 1
        if m == QK_K // 8:
            m = 0
            hm <<= 1
    _pack_2bit(L, y, o_qs)


@nb.njit(**_JIT)
def _fit_k4_groups(x, i0, L, Laux, weights, scales, mins, nmax, rmin, rdelta, nstep):
    """Q4_K/Q5_K's first half: 8 groups of 32 fitted with make_qkx2_quants, weighted by
    sqrt(mean(x^2)) + |x|."""
    for j in range(8):
        g = i0 + 32 * j
        sum_x2 = _F(0.0)
        for l in range(32):
            sum_x2 += x[g + l] * x[g + l]
        av_x = _F(math.sqrt(sum_x2 / _F(32.0)))
        for l in range(32):
            weights[l] = av_x + abs(x[g + l])
        scales[j], mins[j] = _make_qkx2_quants(32, nmax, x, g, weights, L, 32 * j, Laux,
                                               rmin, rdelta, nstep, False)


@nb.njit(**_JIT)
def _pack_k4_scales(scales, mins, y, o_sc):
    """6-bit scales and mins relative to their maxima into scales[12] at y[o_sc];
    returns (max_scale, max_min)."""
    max_scale = _F(0.0)
    max_min = _F(0.0)
    for j in range(8):
        if scales[j] > max_scale:
            max_scale = scales[j]
        if mins[j] > max_min:
            max_min = mins[j]
    inv_scale = _F(63.0) / max_scale if max_scale > 0 else _F(0.0)
    inv_min = _F(63.0) / max_min if max_min > 0 else _F(0.0)
    for j in range(8):
        ls = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)   # (uint8_t) cast, then MIN
        lm = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        _pack_scale_min_k4(j, ls, lm, y, o_sc)
    return max_scale, max_min


@nb.njit(**_JIT)
def _requantize_k4_groups(x, i0, y, o_sc, d_all, dmin_all, L, nmax):
    """Recompute each group's codes from the stored (rounded) scales and mins."""
    for j in range(8):
        sc, m = _scale_min_k4(j, y, o_sc)
        d = d_all * _F(sc)
        if d == 0:
            continue
        dm = dmin_all * _F(m)
        for ii in range(32):
            L[32 * j + ii] = max(0, min(nmax, nearest_int((x[i0 + 32 * j + ii] + dm) / d)))


@nb.njit(**_JIT)
def _block_q4_k(x, i0, y, o, L, Laux, weights, scales, mins):
    """144 bytes: d f16, dmin f16, scales[12], qs[128] (two groups of 32 per 32 bytes)."""
    _fit_k4_groups(x, i0, L, Laux, weights, scales, mins, 15, _F(-1.0), _F(0.1), 20)
    _finish_q4_k(x, i0, y, o, L, scales, mins)


@nb.njit(**_JIT)
def _finish_q4_k(x, i0, y, o, L, scales, mins):
    max_scale, max_min = _pack_k4_scales(scales, mins, y, o + 4)
    _codes_q4_k(x, i0, y, o, L, _put_f16(y, o, max_scale / _F(63.0)), _put_f16(y, o + 2, max_min / _F(63.0)))


@nb.njit(**_JIT)
def _codes_q4_k(x, i0, y, o, L, d_all, dmin_all):
    """The codes again from the stored scales and mins, packed into qs."""
    _requantize_k4_groups(x, i0, y, o + 4, d_all, dmin_all, L, 15)
    for j in range(0, QK_K, 64):
        for l in range(32):
            y[o + 16 + j // 2 + l] = np.uint8(L[j + l] | (L[j + l + 32] << 4))


@nb.njit(**_JIT)
def _block_q5_k(x, i0, y, o, L, Laux, weights, scales, mins):
    """176 bytes: d f16, dmin f16, scales[12], qh[32], qs[128]."""
    _fit_k4_groups(x, i0, L, Laux, weights, scales, mins, 31, _F(-0.5), _F(0.1), 15)
    _finish_q5_k(x, i0, y, o, L, scales, mins)


@nb.njit(**_JIT)
def _finish_q5_k(x, i0, y, o, L, scales, mins):
    max_scale, max_min = _pack_k4_scales(scales, mins, y, o + 4)
    _codes_q5_k(x, i0, y, o, L, _put_f16(y, o, max_scale / _F(63.0)), _put_f16(y, o + 2, max_min / _F(63.0)))


@nb.njit(**_JIT)
def _codes_q5_k(x, i0, y, o, L, d_all, dmin_all):
    """The codes again from the stored scales and mins, packed into qh and qs."""
    _requantize_k4_groups(x, i0, y, o + 4, d_all, dmin_all, L, 31)
    o_qh, o_ql = o + 16, o + 48
    for k in range(32):
        y[o_qh + k] = 0
    m1, m2 = 1, 2
    for n in range(0, QK_K, 64):
        for j in range(32):
            l1 = L[n + j]
            if l1 > 15:
                l1 -= 16
                y[o_qh + j] |= np.uint8(m1)
            l2 = L[n + j + 32]
            if l2 > 15:
                l2 -= 16
                y[o_qh + j] |= np.uint8(m2)
            y[o_ql + n // 2 + j] = np.uint8(l1 | (l2 << 4))
        m1 <<= 2
        m2 <<= 2


@nb.njit(**_JIT)
def _block_q6_k(x, i0, y, o, L, Laux, weights, scales, mins):
    """210 bytes: ql[128], qh[64], scales int8[16], d f16."""
    for ib in range(16):
        scales[ib] = _make_qx_quants(16, 32, x, i0 + 16 * ib, L, 16 * ib, 1, weights[:0], 0)
    _finish_q6_k(x, i0, y, o, L, scales)


@nb.njit(**_JIT)
def _finish_q6_k(x, i0, y, o, L, scales):
    """Q6_K's second half: int8 scales relative to the largest, then the codes again."""
    o_qh, o_sc, o_d = o + 128, o + 192, o + 208
    max_scale = _F(0.0)
    max_abs_scale = _F(0.0)
    for ib in range(16):
        if abs(scales[ib]) > max_abs_scale:
            max_abs_scale = abs(scales[ib])
            max_scale = scales[ib]
    if max_abs_scale < GROUP_MAX_EPS:
        for k in range(210):
            y[o + k] = 0
        return
    iscale = _F(-128.0) / max_scale
    d_all = _put_f16(y, o_d, _F(1.0) / iscale)
    for ib in range(16):
        y[o_sc + ib] = np.uint8(min(127, nearest_int(iscale * scales[ib])) & 0xFF)
    for j in range(16):
        sc = np.int32(y[o_sc + j]) - (np.int32(y[o_sc + j] >> 7) << 8)    # int8 scale
        d = d_all * _F(sc)
        if d == 0:
            continue
        for ii in range(16):
            L[16 * j + ii] = max(-32, min(31, nearest_int(x[i0 + 16 * j + ii] / d))) + 32
    for j in range(0, QK_K, 128):
        ql, qh = o + j // 2, o_qh + j // 4
        for l in range(32):
            a, b, c, e = L[j + l], L[j + l + 32], L[j + l + 64], L[j + l + 96]
            y[ql + l] = np.uint8((a & 0xF) | ((c & 0xF) << 4))
            y[ql + l + 32] = np.uint8((b & 0xF) | ((e & 0xF) << 4))
            y[qh + l] = np.uint8((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6))
