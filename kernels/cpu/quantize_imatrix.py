"""Quantizing with an importance matrix: ggml's quantize_row_*_impl, ported bit for bit.

With quant_weights (llama-quantize --imatrix), ggml_quantize_chunk takes these paths instead
of the `_ref` rows: every value's weight is its column's importance times
sqrt(sigma2 + x^2) (sigma2 from the row or super-block's mean square), groups are fitted with
make_qkx3_quants / make_qx_quants under those weights, and the K-quants' group scales are
themselves fitted with make_qp_quants / make_qx_quants weighted by the groups' total weight.
Q6_K weights by the importance alone; Q8_0 ignores it. The float rules of quantize_scalar.py
apply.

One row kernel does every format: `quantize_weighted(src, kind, out, qw, code)` (src, kind and
out as in quantize.py), qw (n,) float32 the importance of each column (the same for every row).
"""
import numba as nb
import numpy as np

from .quantize_fit import _make_qkx3_quants, _make_qp_quants, _make_qx_quants
from .quantize_k import (
    QK_K, _codes_q2_k, _codes_q3_k, _codes_q4_k, _codes_q5_k, _finish_q6_k, _pack_q3_scale, _pack_scale_min_k4,
)
from .quantize import _row
from .quantize_scalar import _F, _JIT, _JIT_INLINE, _PAR, _pack_q5, _put_f16, _put_u32

Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = range(9)      # quantize_weighted's codes


@nb.njit(**_JIT_INLINE)
def _sum_squares(x, i0, n):
    """sum(x^2) over x[i0:i0+n], in order."""
    s = _F(0.0)
    for j in range(n):
        s += x[i0 + j] * x[i0 + j]
    return s


@nb.njit(**_JIT_INLINE)
def _weights(x, i0, qw, sigma2, n, weights):
    """weights[l] = qw[i0+l] * sqrt(sigma2 + x^2); returns their sum."""
    total = _F(0.0)
    for l in range(n):
        xi = x[i0 + l]
        weights[l] = qw[i0 + l] * np.sqrt(sigma2 + xi * xi)
        total += weights[l]
    return total


# ---------------------------------------------------------------------------------------------
# the 32-value formats: sigma2 is the whole row's mean square
# ---------------------------------------------------------------------------------------------
@nb.njit(**_JIT_INLINE)
def _pack_codes(L, y, o, five):
    """A 32-value block's codes from byte o: qs[16] (value j low nibble of byte j, value j+16
    high), or for 5 bits qh (u32, the fifth bits) then qs."""
    if five:
        qh = np.uint32(0)
        for j in range(16):
            qh |= _pack_q5(L[j], L[j + 16], j, y, o + 4)
        _put_u32(y, o, qh)
    else:
        for j in range(16):
            y[o + j] = np.uint8(L[j] | (L[j + 16] << 4))


@nb.njit(**_JIT_INLINE)
def _block_x_0_w(x, i0, y, o, qw, sigma2, weights, L, five):
    """Q4_0 / Q5_0 (five): d f16, then the codes; a symmetric fit (make_qx_quants)."""
    _weights(x, i0, qw, sigma2, 32, weights)
    _put_f16(y, o, _make_qx_quants(32, 16 if five else 8, x, i0, L, 0, 1, weights, 0))
    _pack_codes(L, y, o + 2, five)


@nb.njit(**_JIT_INLINE)
def _block_x_1_w(x, i0, y, o, qw, sigma2, weights, L, Laux, five):
    """Q4_1 / Q5_1 (five): d f16, m f16, then the codes; a fit with a min (make_qkx3_quants)."""
    _weights(x, i0, qw, sigma2, 32, weights)
    d, the_min = _make_qkx3_quants(32, 31 if five else 15, x, i0, weights, L, 0, Laux, _F(-0.9), _F(0.05), 36,
                                   False)
    _put_f16(y, o, d)
    _put_f16(y, o + 2, -the_min)
    _pack_codes(L, y, o + 4, five)


@nb.njit(**_JIT)
def _row_32_w(x, y, qw, code):
    """One row of 32-value blocks; sigma2 is the whole row's mean square."""
    n = x.size
    sigma2 = _sum_squares(x, 0, n) / _F(n)
    weights, L, Laux = np.empty(32, np.float32), np.empty(32, np.int32), np.empty(32, np.int32)
    for b in range(n // 32):
        if code == Q4_0:
            _block_x_0_w(x, 32 * b, y, 18 * b, qw, sigma2, weights, L, False)
        elif code == Q4_1:
            _block_x_1_w(x, 32 * b, y, 20 * b, qw, sigma2, weights, L, Laux, False)
        elif code == Q5_0:
            _block_x_0_w(x, 32 * b, y, 22 * b, qw, sigma2, weights, L, True)
        else:
            _block_x_1_w(x, 32 * b, y, 24 * b, qw, sigma2, weights, L, Laux, True)


# ---------------------------------------------------------------------------------------------
# K-quant super-blocks of 256. Scratch per row: L int32 (256), Laux int32 (32), weights
# float32 (32), scales/mins/sw float32 (16), Ls/Lm int32 (16)
# ---------------------------------------------------------------------------------------------
@nb.njit(**_JIT)
def _block_q2_k_w(x, i0, y, o, qw, L, Laux, weights, scales, mins, sw, Ls, Lm):
    """84 bytes (see quantize_k._block_q2_k): 16 groups of 16; sigma2 = mean square."""
    sigma2 = _sum_squares(x, i0, QK_K) / _F(QK_K)
    for j in range(16):
        sw[j] = _weights(x, i0 + 16 * j, qw, sigma2, 16, weights)
        scales[j], mins[j] = _make_qkx3_quants(16, 3, x, i0 + 16 * j, weights, L, 16 * j, Laux,
                                               _F(-0.9), _F(0.05), 36, False)
    dm = _make_qp_quants(16, 15, scales, Ls, sw)
    mm = _make_qp_quants(16, 15, mins, Lm, sw)
    d, dmin = _put_f16(y, o + 80, dm), _put_f16(y, o + 82, mm)
    for j in range(16):
        y[o + j] = np.uint8((Ls[j] | (Lm[j] << 4)) & 0xFF)
    _codes_q2_k(x, i0, y, o, L, d, dmin)


@nb.njit(**_JIT)
def _block_q3_k_w(x, i0, y, o, qw, L, Laux, weights, scales, mins, sw, Ls, Lm):
    """110 bytes (see quantize_k._block_q3_k): scales fitted by make_qx_quants too."""
    sigma2 = _F(2.0) * _sum_squares(x, i0, QK_K) / _F(QK_K)
    for j in range(16):
        sw[j] = _weights(x, i0 + 16 * j, qw, sigma2, 16, weights)
        scales[j] = _make_qx_quants(16, 4, x, i0 + 16 * j, L, 16 * j, 1, weights, 0)
    o_sc = o + 96
    for k in range(12):
        y[o_sc + k] = 0
    d_block = _make_qx_quants(16, 32, scales, 0, Ls, 0, 1, sw, 0)
    for j in range(16):
        _pack_q3_scale(j, Ls[j], y, o_sc)
    _codes_q3_k(x, i0, y, o, L, _put_f16(y, o + 108, d_block))


@nb.njit(**_JIT_INLINE)
def _fit_k4_groups_w(x, i0, qw, nmax, L, Laux, weights, scales, mins, sw, Ls, Lm, y, o):
    """Q4_K/Q5_K: 8 groups of 32 with make_qkx3_quants, their scales and mins with
    make_qp_quants, packed into scales[12] (Q5_K caps the codes at 63, Q4_K does not: they
    differ only if a fitted scale were negative). Returns (d, dmin) as stored (f16)."""
    sigma2 = _F(2.0) * _sum_squares(x, i0, QK_K) / _F(QK_K)
    for j in range(8):
        sw[j] = _weights(x, i0 + 32 * j, qw, sigma2, 32, weights)
        scales[j], mins[j] = _make_qkx3_quants(32, nmax, x, i0 + 32 * j, weights, L, 32 * j, Laux,
                                               _F(-0.9), _F(0.05), 36, False)
    d_block = _make_qp_quants(8, 63, scales, Ls, sw)
    m_block = _make_qp_quants(8, 63, mins, Lm, sw)
    cap = 63 if nmax == 31 else 255
    for j in range(8):
        _pack_scale_min_k4(j, min(cap, Ls[j]), min(cap, Lm[j]), y, o + 4)
    return _put_f16(y, o, d_block), _put_f16(y, o + 2, m_block)


@nb.njit(**_JIT)
def _block_q4_k_w(x, i0, y, o, qw, L, Laux, weights, scales, mins, sw, Ls, Lm):
    d, dmin = _fit_k4_groups_w(x, i0, qw, 15, L, Laux, weights, scales, mins, sw, Ls, Lm, y, o)
    _codes_q4_k(x, i0, y, o, L, d, dmin)


@nb.njit(**_JIT)
def _block_q5_k_w(x, i0, y, o, qw, L, Laux, weights, scales, mins, sw, Ls, Lm):
    d, dmin = _fit_k4_groups_w(x, i0, qw, 31, L, Laux, weights, scales, mins, sw, Ls, Lm, y, o)
    _codes_q5_k(x, i0, y, o, L, d, dmin)


@nb.njit(**_JIT)
def _block_q6_k_w(x, i0, y, o, qw, L, Laux, weights, scales, mins, sw, Ls, Lm):
    """210 bytes: each group of 16 fitted by make_qx_quants weighted by the importance alone."""
    for ib in range(16):
        scales[ib] = _make_qx_quants(16, 32, x, i0 + 16 * ib, L, 16 * ib, 1, qw, i0 + 16 * ib)
    _finish_q6_k(x, i0, y, o, L, scales)


@nb.njit(**_JIT)
def _row_k_w(x, y, qw, code):
    """One row of super-blocks. Scratch: L int32 (256), Laux int32 (32), weights float32 (32),
    scales/mins/sw float32 (16), Ls/Lm int32 (16)."""
    L, Laux, weights = np.empty(QK_K, np.int32), np.empty(32, np.int32), np.empty(32, np.float32)
    scales, mins, sw = np.empty(16, np.float32), np.empty(16, np.float32), np.empty(16, np.float32)
    Ls, Lm = np.empty(16, np.int32), np.empty(16, np.int32)
    for b in range(x.size // QK_K):
        i0 = QK_K * b
        if code == Q2_K:
            _block_q2_k_w(x, i0, y, 84 * b, qw, L, Laux, weights, scales, mins, sw, Ls, Lm)
        elif code == Q3_K:
            _block_q3_k_w(x, i0, y, 110 * b, qw, L, Laux, weights, scales, mins, sw, Ls, Lm)
        elif code == Q4_K:
            _block_q4_k_w(x, i0, y, 144 * b, qw, L, Laux, weights, scales, mins, sw, Ls, Lm)
        elif code == Q5_K:
            _block_q5_k_w(x, i0, y, 176 * b, qw, L, Laux, weights, scales, mins, sw, Ls, Lm)
        else:
            _block_q6_k_w(x, i0, y, 210 * b, qw, L, Laux, weights, scales, mins, sw, Ls, Lm)


@nb.njit(**_PAR)
def quantize_weighted(src, kind, out, qw, code):
    """out (rows, row_bytes) uint8: src's rows in format `code` (WEIGHTED), rows in parallel."""
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        if code <= Q5_1:
            _row_32_w(x, out[r], qw, code)
        else:
            _row_k_w(x, out[r], qw, code)


# the formats ggml quantizes with an importance matrix -> their code for quantize_weighted
WEIGHTED = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q2_K": Q2_K, "Q3_K": Q3_K, "Q4_K": Q4_K,
            "Q5_K": Q5_K, "Q6_K": Q6_K}
