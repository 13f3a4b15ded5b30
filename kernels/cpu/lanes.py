"""The 32-block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) summed as ggml's x86 vec_dot sums them,
over a tile layout of their own: each block's codes at their width (4, 5 or 8 bits) followed
by its float16 scales, so a tile streams through memory once and the weights take the room
they take in the file.

Tile nt (R = 32 rows) holds its n_blk 32-column blocks one after another, block_bytes(bits,
has_min) bytes each:
    codes, code + offset unsigned and `bits` wide, by lane l (columns 4l..4l+3):
        bits 8: 1024 bytes; lane l's 128 at 128 l: rows 0..31, 4 bytes a row (columns in order)
        bits 4: 512 bytes; lanes 2p (low nibbles) and 2p + 1 (high) share the 128 at 128 p
        bits 5: the low 4 bits as bits 4, then 128 bytes of fifth bits: lane l, rows
                16h..16h+15 as one 64-bit mask at 512 + 8 (2l + h), bit 4 (r - 16h) + j
    scales: R float16 (64 bytes); then, for formats with a min, R float16 mins (64 bytes)

Per block b, for the 8 lanes l and rows r (one token; dd = d_w * d_x):
    acc[l, r] = fma(dd[r], float(sum_j code * x - offset * sum_j x), acc[l, r])
    summs[r]  = fma(m_w[r], s_x, summs[r])                              (formats with a min)
    out[r]    = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)) (+ summs)
On CPUs with AVX-512 VNNI a whole tile is one LLVM loop (lanes_gemv.py); elsewhere the same
steps in plain Numba (_tile_portable).
"""
import numba as nb
import numpy as np

from .fma import fma
from .lanes_gemv import CODE_BYTES, gemv_4, gemv_4_min, gemv_5, gemv_5_min, gemv_8, gemv_8_min, widen_5, widen_5_min
from .unpack import F16_TO_F32
from .vnni import HAS_VNNI, R

_LANE_BYTES = 4 * R  # one lane (4 columns) of a tile's R rows, a byte a code
_CODE_BYTES_4, _CODE_BYTES_5, _CODE_BYTES_8 = CODE_BYTES[4], CODE_BYTES[5], CODE_BYTES[8]


@nb.njit(inline="always", cache=True, nogil=True)
def code_bytes(bits):
    return _CODE_BYTES_8 if bits == 8 else (_CODE_BYTES_5 if bits == 5 else _CODE_BYTES_4)


@nb.njit(inline="always", cache=True, nogil=True)
def block_bytes(bits, has_min):
    return code_bytes(bits) + 2 * R * (2 if has_min else 1)


def aligned_zeros(n_bytes: int, align: int = 64) -> np.ndarray:
    """n_bytes zeroed uint8 starting on a cache line (NumPy only promises 16 bytes): no vector
    load of a block then straddles two lines."""
    raw = np.zeros(n_bytes + align, np.uint8)
    skip = -raw.ctypes.data % align
    return raw[skip:skip + n_bytes]


def empty_lanes(n_rows: int, n_cols: int, bits: int, has_min: bool) -> np.ndarray:
    """The zeroed tiles of an (n_rows, n_cols) matrix; padding rows stay code 0, scale 0."""
    n_tiles = (n_rows + R - 1) // R
    return aligned_zeros(n_tiles * (n_cols // 32) * block_bytes(bits, has_min))


def fill_lanes(data: np.ndarray, row0: int, q: np.ndarray, scale: np.ndarray, bias: np.ndarray, offset: int,
               bits: int) -> None:
    """Write rows row0.. (a multiple of R) of the unpacked layout (q (n, K) int8, scale and bias
    (n, K/32) float32, bias (n, 0) without a min) into tiles made by empty_lanes."""
    both = np.concatenate([scale, bias], axis=1)  # (n, K/32 [+ K/32])
    half = both.astype(np.float16)
    if not np.array_equal(half.astype(np.float32), both, equal_nan=True):
        raise ValueError("32-block scales must be float16 values")  # they are ggml_half in the file
    _fill(data, row0 // R, q, half.view(np.uint16), np.int32(offset), bits, bias.shape[1] > 0)


@nb.njit(parallel=True, cache=True, nogil=True)
def _fill(data, nt0, q, half, offset, bits, has_min):
    N, K = q.shape
    n_blk = K // 32
    bb, cb = block_bytes(bits, has_min), code_bytes(bits)
    for t in nb.prange((N + R - 1) // R):
        n0 = t * R
        for b in range(n_blk):
            at = ((nt0 + t) * n_blk + b) * bb
            for r in range(min(R, N - n0)):
                for l in range(8):
                    for j in range(4):
                        code = np.int32(q[n0 + r, 32 * b + 4 * l + j]) + offset
                        if bits == 8:
                            data[at + _LANE_BYTES * l + 4 * r + j] = np.uint8(code)
                            continue
                        data[at + _LANE_BYTES * (l // 2) + 4 * r + j] |= np.uint8((code & 15) << (4 * (l % 2)))
                        if bits == 5 and code >= 16:
                            bit = 4 * (r % 16) + j
                            data[at + 4 * _LANE_BYTES + 8 * (2 * l + r // 16) + bit // 8] |= np.uint8(1 << (bit % 8))
                for m in range(2 if has_min else 1):
                    h = half[n0 + r, m * n_blk + b]
                    data[at + cb + 2 * R * m + 2 * r] = np.uint8(h & 255)
                    data[at + cb + 2 * R * m + 2 * r + 1] = np.uint8(h >> 8)


@nb.njit(parallel=True, cache=True, nogil=True)
def qmatmul_lanes(data, bits, has_min, offset, xq, xd, xs, xn4, out):
    """out (T, N) = x @ W.T for W in lanes tiles; x quantized: xq (T*K,) codes, xd/xs (T, K/32)
    the activation scales and scaled sums, xn4 (T, K/4) sums of the codes of every 4 columns."""
    for nt in nb.prange((out.shape[1] + R - 1) // R):
        _lanes_tile(data, bits, has_min, offset, xq, xd, xs, xn4, out, nt)


@nb.njit(parallel=True, cache=True, nogil=True)
def qmatmul_lanes3(data1, data2, data3, n_mats, bits, has_min, offset, xq, xd, xs, xn4, out1, out2, out3):
    """qmatmul_lanes for two or three matrices of one format taking the same activations (q/k/v,
    gate/up) in one parallel region; with n_mats 2 the third is not used."""
    nt1, nt2 = (out1.shape[1] + R - 1) // R, (out2.shape[1] + R - 1) // R
    n_jobs = nt1 + nt2 + ((out3.shape[1] + R - 1) // R if n_mats == 3 else 0)
    for job in nb.prange(n_jobs):
        if job < nt1:
            _lanes_tile(data1, bits, has_min, offset, xq, xd, xs, xn4, out1, job)
        elif job < nt1 + nt2:
            _lanes_tile(data2, bits, has_min, offset, xq, xd, xs, xn4, out2, job - nt1)
        else:
            _lanes_tile(data3, bits, has_min, offset, xq, xd, xs, xn4, out3, job - nt1 - nt2)


# from this many tokens on, a 5-bit tile is widened to bytes once rather than at every token
WIDEN_MIN_TOKENS = 8


@nb.njit(inline="always", cache=True, nogil=True)
def _lanes_tile(data, bits, has_min, offset, xq, xd, xs, xn4, out, nt):
    """The rows of tile nt, every token, one token at a time (the tile stays in L1)."""
    T, n_blk = out.shape[0], xd.shape[1]
    w_off = nt * n_blk * block_bytes(bits, has_min)
    if HAS_VNNI and bits == 5 and T >= WIDEN_MIN_TOKENS:
        data, w_off, bits = _widen_5(data, w_off, n_blk, has_min), 0, 8
    acc = np.empty(9 * R, np.float32)  # (lane, row) accumulators, then summs (row)
    for t in range(T):
        if HAS_VNNI:
            _tile_vnni(data, w_off, xq, t * n_blk * 32, xd, xs, xn4, t * n_blk, n_blk, offset, bits, has_min, acc)
        else:
            _tile_portable(data, w_off, xq, t, xd, xs, xn4, n_blk, offset, bits, has_min, acc)
        for r in range(min(R, out.shape[1] - nt * R)):
            h = (((acc[r] + acc[4 * R + r]) + (acc[2 * R + r] + acc[6 * R + r]))
                 + ((acc[R + r] + acc[5 * R + r]) + (acc[3 * R + r] + acc[7 * R + r])))
            out[t, nt * R + r] = h + acc[8 * R + r] if has_min else h


@nb.njit(inline="always", cache=True, nogil=True)
def _widen_5(data, w_off, n_blk, has_min):
    """A copy of the 5-bit tile at w_off laid out as an 8-bit one (same codes, same scales)."""
    n_bytes = n_blk * block_bytes(8, has_min)
    raw = np.empty(n_bytes + 64, np.uint8)
    skip = -raw.ctypes.data % 64  # start on a cache line: every 64-byte load then stays in one
    wide = raw[skip:skip + n_bytes]
    if has_min:
        widen_5_min(data, w_off, n_blk, wide)
    else:
        widen_5(data, w_off, n_blk, wide)
    return wide


@nb.njit(inline="always", cache=True, nogil=True)
def _tile_vnni(data, w_off, xq, x_off, xd, xs, xn4, b_off, n_blk, offset, bits, has_min, acc):
    if bits == 4 and has_min:
        gemv_4_min(data, w_off, xq, x_off, xd, xs, xn4, b_off, n_blk, offset, acc)
    elif bits == 4:
        gemv_4(data, w_off, xq, x_off, xd, xs, xn4, b_off, n_blk, offset, acc)
    elif bits == 5 and has_min:
        gemv_5_min(data, w_off, xq, x_off, xd, xs, xn4, b_off, n_blk, offset, acc)
    elif bits == 5:
        gemv_5(data, w_off, xq, x_off, xd, xs, xn4, b_off, n_blk, offset, acc)
    elif has_min:
        gemv_8_min(data, w_off, xq, x_off, xd, xs, xn4, b_off, n_blk, offset, acc)
    else:
        gemv_8(data, w_off, xq, x_off, xd, xs, xn4, b_off, n_blk, offset, acc)


@nb.njit(inline="always", cache=True, nogil=True)
def _code(data, at, bits, l, r, j):
    """The stored (unsigned) code of row r, lane l, column j of the block at `at`."""
    if bits == 8:
        return np.int32(data[at + _LANE_BYTES * l + 4 * r + j])
    code = (np.int32(data[at + _LANE_BYTES * (l // 2) + 4 * r + j]) >> (4 * (l % 2))) & 15
    if bits == 5:
        bit = 4 * (r % 16) + j
        code |= ((np.int32(data[at + 4 * _LANE_BYTES + 8 * (2 * l + r // 16) + bit // 8]) >> (bit % 8)) & 1) << 4
    return code


@nb.njit(cache=True, nogil=True)
def _tile_portable(data, w_off, xq, t, xd, xs, xn4, n_blk, offset, bits, has_min, acc):
    """The steps of lanes_gemv in plain Numba: acc[:8R] the lane accumulators, acc[8R:] summs."""
    acc[:] = 0
    bb, cb = block_bytes(bits, has_min), code_bytes(bits)
    for b in range(n_blk):
        at = w_off + b * bb
        x0 = (t * n_blk + b) * 32
        for r in range(R):
            d_w = F16_TO_F32[np.int32(data[at + cb + 2 * r]) | (np.int32(data[at + cb + 2 * r + 1]) << 8)]
            dd = d_w * xd[t, b]
            for l in range(8):
                lane = -offset * xn4[t, 8 * b + l]
                for j in range(4):
                    lane += _code(data, at, bits, l, r, j) * np.int32(xq[x0 + 4 * l + j])
                acc[l * R + r] = fma(dd, np.float32(lane), acc[l * R + r])
            if has_min:
                m_at = at + cb + 2 * R + 2 * r
                m_w = F16_TO_F32[np.int32(data[m_at]) | (np.int32(data[m_at + 1]) << 8)]
                acc[8 * R + r] = fma(m_w, xs[t, b], acc[8 * R + r])
