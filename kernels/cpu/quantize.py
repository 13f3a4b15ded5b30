"""Quantize float rows to GGUF block formats, bit for bit as llama.cpp's llama-quantize does.

The block-level ports of ggml-quants.c live in quantize_scalar.py (32-value formats, shared
helpers), quantize_fit.py (K-quant group fits) and quantize_k.py (K-quant super-blocks); this
module runs them over whole tensors.

Each kernel has the signature `kernel(src, kind, out)`:
    src   (rows, n) float32, or uint16 raw F16/BF16 bits
    kind  what src holds: SRC_F32, SRC_F16 or SRC_BF16 (SOURCE_KINDS maps type names to it)
    out   (rows, row_bytes) uint8 (uint16 for F16/BF16 targets, float32 for F32)
Rows are independent, so the row loop runs in parallel (prange). The K-quant kernels take a
fourth argument, use_lanes (default True): False skips the vectorized group fits and runs the
scalar port only (the reference the tests compare the fast path with).
"""
import numba as nb
import numpy as np
from numba.core import types
from numba.extending import overload

from .quantize_k import (
    QK_K, _block_q2_k, _block_q3_k, _block_q4_k, _block_q5_k, _block_q6_k, _finish_q2_k, _finish_q4_k,
    _finish_q5_k, _finish_q6_k,
)
from .quantize_fit import abs_weights, k4_weights, qkx2_lanes, qx_lanes, transpose_groups
from .quantize_scalar import (
    _F, _JIT_INLINE, _PAR, _block_q4_0, _block_q4_1, _block_q5_0, _block_q5_1, _block_q8_0,
    bf16_bits_from_u32, f16_bits_from_u32,
)

# ---------------------------------------------------------------------------------------------
# reading one row as float32
# ---------------------------------------------------------------------------------------------
SRC_F32, SRC_F16, SRC_BF16 = 0, 1, 2
SOURCE_KINDS = {"F32": SRC_F32, "F16": SRC_F16, "BF16": SRC_BF16}


@nb.njit(**_JIT_INLINE)
def _decode_f16(h, buf):
    """F16 bits h (n,) -> float32 buf (n,), exactly (as GGML_FP16_TO_FP32). Normal numbers,
    infinities and NaNs by bit arithmetic (a loop that vectorizes), then the rare subnormals
    (and zeros) as exact products."""
    bits = buf.view(np.uint32)
    n_small = 0
    for j in range(buf.size):
        v = np.uint32(h[j])
        sign = (v & np.uint32(0x8000)) << np.uint32(16)
        em = v & np.uint32(0x7FFF)
        body = ((em << np.uint32(13)) | np.uint32(0x7F800000) if em >= np.uint32(0x7C00)
                else (em << np.uint32(13)) + np.uint32(0x38000000))
        bits[j] = sign | body
        n_small += np.int32(em < np.uint32(0x400))
    if n_small:
        for j in range(buf.size):
            em = np.int32(h[j]) & 0x7FFF
            if em < 0x400:
                value = _F(em) * _F(2.0 ** -24)
                buf[j] = -value if h[j] & 0x8000 else value


def _row(src, kind, r, buf):
    """Row r of src as float32: a view for float32 sources, else decoded into buf."""


@overload(_row, inline="always")
def _row_impl(src, kind, r, buf):
    if src.dtype == types.float32:
        return lambda src, kind, r, buf: src[r]

    def decode(src, kind, r, buf):
        if kind == SRC_F16:
            _decode_f16(src[r], buf)
        else:                                   # BF16: the high half of a float32
            bits = buf.view(np.uint32)
            for j in range(buf.size):
                bits[j] = np.uint32(src[r, j]) << np.uint32(16)
        return buf
    return decode


# ---------------------------------------------------------------------------------------------
# row drivers: kernel(src, kind, out), parallel over rows
# ---------------------------------------------------------------------------------------------
@nb.njit(**_PAR)
def quantize_q4_0(src, kind, out):
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        for b in range(n // 32):
            _block_q4_0(x, 32 * b, out[r], 18 * b)


@nb.njit(**_PAR)
def quantize_q4_1(src, kind, out):
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        for b in range(n // 32):
            _block_q4_1(x, 32 * b, out[r], 20 * b)


@nb.njit(**_PAR)
def quantize_q5_0(src, kind, out):
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        for b in range(n // 32):
            _block_q5_0(x, 32 * b, out[r], 22 * b)


@nb.njit(**_PAR)
def quantize_q5_1(src, kind, out):
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        for b in range(n // 32):
            _block_q5_1(x, 32 * b, out[r], 24 * b)


@nb.njit(**_PAR)
def quantize_q8_0(src, kind, out):
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        xu, one = x.view(np.uint32), np.empty(1, np.uint32)
        for b in range(n // 32):
            _block_q8_0(x, xu, 32 * b, out[r], 34 * b, one)


@nb.njit(**_JIT_INLINE)
def _k_scratch():
    """(L, Laux, weights, scales, mins) for one row of K-quant blocks."""
    return (np.empty(QK_K, np.int32), np.empty(32, np.int32), np.empty(32, np.float32),
            np.empty(16, np.float32), np.empty(16, np.float32))


@nb.njit(**_JIT_INLINE)
def _fit_row_qkx2(x, gs, use_lanes, abs_weights_, nmax, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants for every group of gs values of row x, as lanes.
    Returns (ok, Lt (gs, G) codes, scales (G,), mins (G,)); ok False: use the scalar code."""
    G = x.size // gs
    xt, wt = np.empty((gs, G), np.float32), np.empty((gs, G), np.float32)
    Lt, Lauxt = np.empty((gs, G), np.int32), np.empty((gs, G), np.int32)
    st, active = np.empty((11, G), np.float32), np.empty(G, np.int32)
    scales, mins = np.empty(G, np.float32), np.empty(G, np.float32)
    if not use_lanes:
        return False, Lt, scales, mins
    transpose_groups(x, xt)
    if abs_weights_:
        abs_weights(xt, wt)
    else:
        k4_weights(xt, wt, st[0])
    n_bad = qkx2_lanes(xt, wt, nmax, rmin, rdelta, nstep, use_mad, Lt, Lauxt, st, active, scales, mins)
    return n_bad == 0, Lt, scales, mins


@nb.njit(**_JIT_INLINE)
def _fit_row_qx(x, gs, use_lanes, nmax):
    """make_qx_quants (rmse_type 1) for every group of gs values of row x, as lanes.
    Returns (ok, Lt (gs, G) codes, scales (G,)); ok False: use the scalar code."""
    G = x.size // gs
    xt, Lt = np.empty((gs, G), np.float32), np.empty((gs, G), np.int32)
    st, scales = np.empty((6, G), np.float32), np.empty(G, np.float32)
    if not use_lanes:
        return False, Lt, scales
    transpose_groups(x, xt)
    return qx_lanes(xt, nmax, Lt, st, scales) == 0, Lt, scales


@nb.njit(**_JIT_INLINE)
def _gather_block(Lt, b, groups, L):
    """The codes of super-block b from the lane layout: L[gs*j + i] = Lt[i, groups*b + j]."""
    gs = Lt.shape[0]
    for j in range(groups):
        for i in range(gs):
            L[gs * j + i] = Lt[i, groups * b + j]


@nb.njit(**_PAR)
def quantize_q2_k(src, kind, out, use_lanes=True):
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        L, Laux, weights, scales, mins = _k_scratch()
        ok, Lt, sc, mn = _fit_row_qkx2(x, 16, use_lanes, True, 3, _F(-0.5), _F(0.1), 15, True)
        for b in range(n // QK_K):
            if ok:
                _gather_block(Lt, b, 16, L)
                _finish_q2_k(x, QK_K * b, out[r], 84 * b, L, sc[16 * b:16 * b + 16], mn[16 * b:16 * b + 16])
            else:
                _block_q2_k(x, QK_K * b, out[r], 84 * b, L, Laux, weights, scales, mins)


@nb.njit(**_PAR)
def quantize_q3_k(src, kind, out, use_lanes=True):
    """(make_q3_quants' coordinate descent has no lane version: use_lanes is ignored)"""
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        L, Laux, weights, scales, mins = _k_scratch()
        for b in range(n // QK_K):
            _block_q3_k(x, QK_K * b, out[r], 110 * b, L, Laux, weights, scales, mins)


@nb.njit(**_PAR)
def quantize_q4_k(src, kind, out, use_lanes=True):
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        L, Laux, weights, scales, mins = _k_scratch()
        ok, Lt, sc, mn = _fit_row_qkx2(x, 32, use_lanes, False, 15, _F(-1.0), _F(0.1), 20, False)
        for b in range(n // QK_K):
            if ok:
                _gather_block(Lt, b, 8, L)
                _finish_q4_k(x, QK_K * b, out[r], 144 * b, L, sc[8 * b:8 * b + 8], mn[8 * b:8 * b + 8])
            else:
                _block_q4_k(x, QK_K * b, out[r], 144 * b, L, Laux, weights, scales, mins)


@nb.njit(**_PAR)
def quantize_q5_k(src, kind, out, use_lanes=True):
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        L, Laux, weights, scales, mins = _k_scratch()
        ok, Lt, sc, mn = _fit_row_qkx2(x, 32, use_lanes, False, 31, _F(-0.5), _F(0.1), 15, False)
        for b in range(n // QK_K):
            if ok:
                _gather_block(Lt, b, 8, L)
                _finish_q5_k(x, QK_K * b, out[r], 176 * b, L, sc[8 * b:8 * b + 8], mn[8 * b:8 * b + 8])
            else:
                _block_q5_k(x, QK_K * b, out[r], 176 * b, L, Laux, weights, scales, mins)


@nb.njit(**_PAR)
def quantize_q6_k(src, kind, out, use_lanes=True):
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        L, Laux, weights, scales, mins = _k_scratch()
        ok, Lt, sc = _fit_row_qx(x, 16, use_lanes, 32)
        for b in range(n // QK_K):
            if ok:
                _gather_block(Lt, b, 16, L)
                _finish_q6_k(x, QK_K * b, out[r], 210 * b, L, sc[16 * b:16 * b + 16])
            else:
                _block_q6_k(x, QK_K * b, out[r], 210 * b, L, Laux, weights, scales, mins)


@nb.njit(**_PAR)
def convert_f16(src, kind, out):
    """out (rows, n) uint16: F16 bits, round to nearest even."""
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        u = x.view(np.uint32)
        for j in range(n):
            out[r, j] = f16_bits_from_u32(u[j], x[j])


@nb.njit(**_PAR)
def convert_bf16(src, kind, out):
    """out (rows, n) uint16: BF16 bits, round to nearest even."""
    rows, n = src.shape
    for r in nb.prange(rows):
        u = _row(src, kind, r, np.empty(n, np.float32)).view(np.uint32)
        for j in range(n):
            out[r, j] = bf16_bits_from_u32(u[j])


@nb.njit(**_PAR)
def convert_f32(src, kind, out):
    """out (rows, n) float32."""
    rows, n = src.shape
    for r in nb.prange(rows):
        x = _row(src, kind, r, np.empty(n, np.float32))
        for j in range(n):
            out[r, j] = x[j]


# target type name -> (kernel, dtype of `out`)
KERNELS = {
    "Q4_0": (quantize_q4_0, np.uint8), "Q4_1": (quantize_q4_1, np.uint8),
    "Q5_0": (quantize_q5_0, np.uint8), "Q5_1": (quantize_q5_1, np.uint8),
    "Q8_0": (quantize_q8_0, np.uint8), "Q2_K": (quantize_q2_k, np.uint8),
    "Q3_K": (quantize_q3_k, np.uint8), "Q4_K": (quantize_q4_k, np.uint8),
    "Q5_K": (quantize_q5_k, np.uint8), "Q6_K": (quantize_q6_k, np.uint8),
    "F16": (convert_f16, np.uint16), "BF16": (convert_bf16, np.uint16),
    "F32": (convert_f32, np.float32),
}



def quantize_rows(fmt, src: np.ndarray, kind: int = SRC_F32, out: np.ndarray | None = None,
                  imatrix: np.ndarray | None = None):
    """Quantize src (rows, n) -> raw (rows, row_bytes) uint8 in format `fmt` (a minillm Format).

    src is float32 (kind SRC_F32), or uint16 F16/BF16 bits (kind SRC_F16/SRC_BF16). `out`, if
    given, is a C-contiguous (rows, row_bytes) uint8 array to write into (and is returned).
    imatrix: (n,) float32 column importances (llama-quantize --imatrix), used by the formats
    ggml weights with it (quantize_imatrix.py), ignored by the others."""
    kernel, dtype = KERNELS[fmt.name]
    rows, n = src.shape
    if n % fmt.block_size:
        raise ValueError(f"row length {n} is not a multiple of {fmt.name}'s block size {fmt.block_size}")
    row_bytes = n // fmt.block_size * fmt.type_size
    if out is None:
        out = np.empty((rows, row_bytes), dtype=np.uint8)
    elif out.shape != (rows, row_bytes) or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a contiguous ({rows}, {row_bytes}) uint8 array")
    if (kind == SRC_F32) != (src.dtype == np.float32):
        raise ValueError(f"source kind {kind} does not match a {src.dtype} array")
    if imatrix is not None:
        from .quantize_imatrix import WEIGHTED, quantize_weighted

        if fmt.name in WEIGHTED:
            if imatrix.shape != (n,):
                raise ValueError(f"the importance matrix has {imatrix.size} values for rows of {n}")
            quantize_weighted(np.ascontiguousarray(src), kind, out, np.ascontiguousarray(imatrix, np.float32),
                              WEIGHTED[fmt.name])
            return out
    kernel(np.ascontiguousarray(src), kind, out.view(dtype))
    return out
