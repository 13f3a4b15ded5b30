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
With block_sums (Q4_0 matrices whose rows come in eights, which llama.cpp repacks for its
q4_0_8x8 gemv/gemm, one arithmetic for every batch size) a block's lanes are summed first:
    acc[r] = fma(dd[r], float(sum_l lane[l]), acc[r]),    out[r] = acc[r]
A token's whole walk over a tile is one LLVM loop (lanes_gemv.py); a batch's tokens walk it
GROUP_TOKENS at a time (each weight load serving them all: AVX2 fours, AVX-512 VNNI pairs of
4- and 5-bit codes), with the same float steps for each; without AVX2 the same steps run in
plain Numba (_tile_portable).
"""
import mmap
import sys

import numba as nb
import numpy as np

from .fma import fma
from .lanes_gemv import (CODE_BYTES, GROUP_TOKENS, gemv_4, gemv_4_blocks, gemv_4_min, gemv_5, gemv_5_min, gemv_8,
                         gemv_8_min, group_4, group_4_min, group_5, group_5_min, group_8, group_8_min, widen_5,
                         widen_5_min)
from .ops import THREADS
from .simd import load_u32, prefetch_l2
from .unpack import F16_TO_F32
from .vnni import HAS_INT8_DOT, HAS_VNNI, R

_LANE_BYTES = 4 * R  # one lane (4 columns) of a tile's R rows, a byte a code
_CODE_BYTES_4, _CODE_BYTES_5, _CODE_BYTES_8 = CODE_BYTES[4], CODE_BYTES[5], CODE_BYTES[8]


@nb.njit(inline="always", cache=True, nogil=True)
def code_bytes(bits):
    return _CODE_BYTES_8 if bits == 8 else (_CODE_BYTES_5 if bits == 5 else _CODE_BYTES_4)


@nb.njit(inline="always", cache=True, nogil=True)
def block_bytes(bits, has_min):
    return code_bytes(bits) + 2 * R * (2 if has_min else 1)


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault a whole range in at once


def aligned_zeros(n_bytes: int, populate: bool = True) -> np.ndarray:
    """n_bytes zeroed uint8: from 1 MiB, their own anonymous map, so page-aligned (NumPy only
    promises 16 bytes, and a 64-byte load across two cache lines costs two), in huge pages where
    the system allows it (fewer TLB misses while weights or KV cells stream through a kernel:
    attention over a batch's caches ran ~20% faster), with `populate` faulted in by one call
    rather than page by page (3x faster), else a page at a time as first written."""
    if n_bytes < 1 << 20:
        raw = np.zeros(n_bytes + 64, np.uint8)
        skip = -raw.ctypes.data % 64
        return raw[skip:skip + n_bytes]
    region = mmap.mmap(-1, n_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advices = (getattr(mmap, "MADV_HUGEPAGE", None),
               _MADV_POPULATE_WRITE if populate and sys.platform == "linux" else None)
    for advice in advices:
        if advice is not None:
            try:
                region.madvise(advice)
            except OSError:
                pass  # an older kernel: pages come on first touch
    return np.frombuffer(region, np.uint8)


def empty_lanes(n_rows: int, n_cols: int, bits: int, has_min: bool) -> np.ndarray:
    """The zeroed tiles of an (n_rows, n_cols) matrix; padding rows stay code 0, scale 0."""
    n_tiles = (n_rows + R - 1) // R
    return aligned_zeros(n_tiles * (n_cols // 32) * block_bytes(bits, has_min))


# where a file block keeps its codes: d (float16), [m (float16)], [qh (fifth bits, u32)], qs
_QS_AT = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8, "Q8_0": 2}
_QH_AT = {"Q5_0": 2, "Q5_1": 4}


def fill_lanes(data: np.ndarray, row0: int, raw: np.ndarray, fmt) -> None:
    """Write rows row0.. (a multiple of R) of a 32-block format's file rows raw (n, row_bytes)
    into tiles made by empty_lanes. The stored code (q + offset) is the file's own unsigned
    code (Q8_0: its int8 with the sign bit flipped), so the blocks are rearranged, not decoded."""
    _fill(data.view(np.uint32), row0 // R, raw, fmt.type_size, _QS_AT[fmt.name], _QH_AT.get(fmt.name, -1),
          fmt.code_bits, fmt.has_bias)


@nb.njit(inline="always", cache=True, nogil=True)
def _u32(raw, n, i):
    return load_u32(raw, n * raw.shape[1] + i)  # raw (rows, row_bytes) C-contiguous


@nb.njit(inline="always", cache=True, nogil=True)
def _lane_word(raw, n, at, qs_at, bits, l):
    """The stored codes of columns 4l..4l+3 of the file block at `at` of row n, a byte each (for
    5 bits: the low 4). qs byte j holds element j in its low nibble and element j + 16 in its high."""
    if bits == 8:
        return _u32(raw, n, at + qs_at + 4 * l) ^ np.uint32(0x80808080)
    return (_u32(raw, n, at + qs_at + 4 * (l % 4)) >> np.uint32(4 * (l // 4))) & np.uint32(0x0F0F0F0F)


@nb.njit(parallel=True, cache=True, nogil=True)
def _fill(words, nt0, raw, type_size, qs_at, qh_at, bits, has_min):
    """Each tile's bytes in the order they are stored, 4 a write (words: the tiles as uint32)."""
    N, n_blk = raw.shape[0], raw.shape[1] // type_size
    bb, cb, lw = block_bytes(bits, has_min) // 4, code_bytes(bits) // 4, _LANE_BYTES // 4
    for t in nb.prange((N + R - 1) // R):
        n0 = t * R
        rows = min(R, N - n0)
        for b in range(n_blk):
            at, src = ((nt0 + t) * n_blk + b) * bb, b * type_size
            for r in range(rows):
                n = n0 + r
                if bits == 8:
                    for l in range(8):
                        words[at + lw * l + r] = _lane_word(raw, n, src, qs_at, 8, l)
                else:
                    for p in range(4):  # lanes 2p (low nibble) and 2p + 1 (high nibble)
                        low = _lane_word(raw, n, src, qs_at, 4, 2 * p)
                        high = _lane_word(raw, n, src, qs_at, 4, 2 * p + 1)
                        words[at + lw * p + r] = low | (high << np.uint32(4))
                if bits == 5:  # element e's fifth bit is bit e of qh: lane l's four are bits 4l..4l+3
                    qh = _u32(raw, n, src + qh_at)
                    for l in range(8):
                        nibble = (qh >> np.uint32(4 * l)) & np.uint32(15)
                        mask_at = at + 4 * lw + 2 * (2 * l + r // 16) + (r % 16) // 8
                        words[mask_at] |= nibble << np.uint32(4 * (r % 8))
                for m in range(2 if has_min else 1):  # d, then m: the block's first float16s
                    half = np.uint32(raw[n, src + 2 * m]) | (np.uint32(raw[n, src + 2 * m + 1]) << 8)
                    words[at + cb + R // 2 * m + r // 2] |= half << np.uint32(16 * (r % 2))


# The products cut the tiles into one share a thread (ops.THREADS), and each share allocates its
# accumulators (ACC_FLOATS,) once: per token of a group, (lane, row), then the summs (row); one
# allocation a tile cost a lone token's products ~5%.
ACC_FLOATS = GROUP_TOKENS * 9 * R


@nb.njit(parallel=True, cache=True, nogil=True)
def qmatmul_lanes(data, bits, has_min, offset, block_sums, xq, xd, xs, xn4, out):
    """out (T, N) = x @ W.T for W in lanes tiles; x quantized: xq (T*K,) codes, xd/xs (T, K/32)
    the activation scales and scaled sums, xn4 (T, K/4) sums of the codes of every 4 columns."""
    n_tiles = (out.shape[1] + R - 1) // R
    share = (n_tiles + THREADS - 1) // THREADS
    x_starts = lane_starts(xn4, offset, has_min)
    for w in nb.prange(THREADS):
        acc = np.empty(ACC_FLOATS, np.float32)
        for nt in range(w * share, min((w + 1) * share, n_tiles)):
            _lanes_tile(data, bits, has_min, offset, block_sums, xq, xd, xs, x_starts, out, np.int64(nt), acc)


@nb.njit(parallel=True, cache=True, nogil=True)
def qmatmul_lanes3(data1, data2, data3, bits, has_min, offset, block_sums, xq, xd, xs, xn4, out1, out2, out3):
    """qmatmul_lanes for two or three matrices of one format taking the same activations (q/k/v,
    gate/up) in one parallel region; for two, out3 has no columns (data3 is not read)."""
    nt1, nt2 = (out1.shape[1] + R - 1) // R, (out2.shape[1] + R - 1) // R
    n_jobs = nt1 + nt2 + (out3.shape[1] + R - 1) // R
    share = (n_jobs + THREADS - 1) // THREADS
    x_starts = lane_starts(xn4, offset, has_min)
    for w in nb.prange(THREADS):
        acc = np.empty(ACC_FLOATS, np.float32)
        for job in range(w * share, min((w + 1) * share, n_jobs)):
            if job < nt1:
                _lanes_tile(data1, bits, has_min, offset, block_sums, xq, xd, xs, x_starts, out1, np.int64(job), acc)
            elif job < nt1 + nt2:
                _lanes_tile(data2, bits, has_min, offset, block_sums, xq, xd, xs, x_starts, out2, np.int64(job - nt1),
                            acc)
            else:
                _lanes_tile(data3, bits, has_min, offset, block_sums, xq, xd, xs, x_starts, out3,
                            np.int64(job - nt1 - nt2), acc)


@nb.njit(inline="always", cache=True, nogil=True)
def lane_starts(xn4, offset, has_min):
    """(T, K/4) int32: where each lane's integer dot product starts, -offset * the lane's code
    sum (xn4), so that the sum of (code - offset) * x comes out exactly; formats with a min take
    the codes as they are (xn4 itself, unread). Computed once a product, for every tile's walk
    to load: computed in the walk, the load, multiply and move into a vector register delayed
    each lane's vpdpbusd (Zen 5, old and new alternating: Gemma 3's Q8_0 output product at 8
    tokens 0.90-0.92x, its Q5_0 products at 4 tokens 0.65-0.68x)."""
    if has_min:
        return xn4
    starts = np.empty_like(xn4)
    for t in range(xn4.shape[0]):  # a loop, not an array expression: that would be a parallel region
        for i in range(xn4.shape[1]):
            starts[t, i] = -offset * xn4[t, i]
    return starts


# from this many tokens on, a 5-bit tile is widened to bytes once rather than at every token
WIDEN_MIN_TOKENS = 8
# from this many tokens on, a batch prefetches the next tile while it walks this one
PREFETCH_MIN_TOKENS = 4
# from this many tokens on, AVX2 walks a tile in passes of 8 rows (lanes_gemv's batch walk)
BATCH_WALK_MIN_TOKENS = 4


@nb.njit(cache=True, nogil=True)  # not inlined: the three calls of qmatmul_lanes3 share one copy
def _lanes_tile(data, bits, has_min, offset, block_sums, xq, xd, xs, x_starts, out, nt, acc):
    """The rows of tile nt, every token (the tile stays in L1): batches GROUP_TOKENS tokens a
    walk (but for Q4_0's block sums, and bytes on AVX-512 VNNI), then one token at a time."""
    T, n_blk = out.shape[0], xd.shape[1]
    tile_bytes = n_blk * block_bytes(bits, has_min)
    w_off = nt * tile_bytes
    stored = data  # the tiles as stored: the next one is prefetched from there
    if HAS_INT8_DOT and bits == 5 and T >= WIDEN_MIN_TOKENS:
        data, w_off, bits = _widen_5(data, w_off, n_blk, has_min), 0, 8
    t = 0
    if HAS_INT8_DOT and not block_sums and T >= GROUP_TOKENS and (bits < 8 or not HAS_VNNI):
        while T - t >= GROUP_TOKENS:
            ahead_at, ahead_lines = next_tile_share(stored, nt, tile_bytes, t, t + GROUP_TOKENS, T)
            _group_vnni(data, w_off, xq, t * n_blk * 32, xd, xs, x_starts, t * n_blk, n_blk, offset, bits, has_min,
                        stored, ahead_at, ahead_lines, acc)
            for k in range(GROUP_TOKENS):
                _store_row(acc[k * 9 * R:], out, t + k, nt, has_min, False)
            if not HAS_VNNI:
                prefetch_next_tile(stored, nt, tile_bytes, t, t + GROUP_TOKENS, T)
            t += GROUP_TOKENS
    for t in range(t, T):
        if HAS_INT8_DOT:
            ahead_at, ahead_lines = next_tile_share(stored, nt, tile_bytes, t, t + 1, T)
            _tile_vnni(data, w_off, xq, t * n_blk * 32, xd, xs, x_starts, t * n_blk, n_blk, offset, bits, has_min,
                       block_sums, T >= BATCH_WALK_MIN_TOKENS, stored, ahead_at, ahead_lines, acc)
            if not HAS_VNNI:
                prefetch_next_tile(stored, nt, tile_bytes, t, t + 1, T)
        else:
            _tile_portable(data, w_off, xq, t, xd, xs, x_starts, n_blk, offset, bits, has_min, block_sums, acc)
            prefetch_next_tile(stored, nt, tile_bytes, t, t + 1, T)
        _store_row(acc, out, t, nt, has_min, block_sums)


@nb.njit(inline="always", cache=True, nogil=True)
def next_tile_share(data, nt, tile_bytes, t0, t1, T):
    """The part of the next tile that tokens t0..t1 - 1 of a batch of T ask for while they walk
    tile nt (tiles of tile_bytes, one after another in data), 1 / T of it a token, as (first
    byte, number of cache lines). A batch walks a tile from memory once and from cache T - 1
    times, so the next tile's reads overlap that arithmetic rather than stall the first token's
    walk. Below PREFETCH_MIN_TOKENS the walk waits on memory anyway, and the hardware
    prefetcher streams the tiles best: no lines."""
    if T < PREFETCH_MIN_TOKENS:
        return 0, 0
    start = (nt + 1) * tile_bytes
    part = (tile_bytes + T - 1) // T
    stop = min(start + min(t1 * part, tile_bytes), data.size)
    first = min(start + t0 * part, stop)
    return first, (stop - first + 63) // 64


@nb.njit(inline="always", cache=True, nogil=True)
def prefetch_next_tile(data, nt, tile_bytes, t0, t1, T):
    """next_tile_share's lines asked for at once, after the walk (AVX2's walks, small arrays)."""
    first, n_lines = next_tile_share(data, nt, tile_bytes, t0, t1, T)
    prefetch_l2(data, first, first + 64 * n_lines)


@nb.njit(inline="always", cache=True, nogil=True)
def _store_row(acc, out, t, nt, has_min, block_sums):
    """Token t's outputs of tile nt from its accumulators acc (9 R,): ggml's hsum of the 8 lanes."""
    n_rows = min(R, out.shape[1] - nt * R)
    if block_sums:
        out[t, nt * R:nt * R + n_rows] = acc[:n_rows]
        return
    for r in range(n_rows):
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
def _tile_vnni(data, w_off, xq, x_off, xd, xs, starts, b_off, n_blk, offset, bits, has_min, block_sums, batch,
               ahead, ahead_at, ahead_lines, acc):
    x = (xq, x_off, xd, xs, starts, b_off)
    if block_sums:  # Q4_0 only
        gemv_4_blocks(data, w_off, *x, n_blk, offset, batch, ahead, ahead_at, ahead_lines, acc)
    elif bits == 4 and has_min:
        gemv_4_min(data, w_off, *x, n_blk, offset, batch, ahead, ahead_at, ahead_lines, acc)
    elif bits == 4:
        gemv_4(data, w_off, *x, n_blk, offset, batch, ahead, ahead_at, ahead_lines, acc)
    elif bits == 5 and has_min:
        gemv_5_min(data, w_off, *x, n_blk, offset, batch, ahead, ahead_at, ahead_lines, acc)
    elif bits == 5:
        gemv_5(data, w_off, *x, n_blk, offset, batch, ahead, ahead_at, ahead_lines, acc)
    elif has_min:
        gemv_8_min(data, w_off, *x, n_blk, offset, batch, ahead, ahead_at, ahead_lines, acc)
    else:
        gemv_8(data, w_off, *x, n_blk, offset, batch, ahead, ahead_at, ahead_lines, acc)


@nb.njit(inline="always", cache=True, nogil=True)
def _group_vnni(data, w_off, xq, x_off, xd, xs, starts, b_off, n_blk, offset, bits, has_min, ahead, ahead_at,
                ahead_lines, acc):
    """GROUP_TOKENS tokens from x_off (lanes_gemv._token_group_512, _token_group)."""
    x = (xq, x_off, xd, xs, starts, b_off)
    if bits == 4 and has_min:
        group_4_min(data, w_off, *x, n_blk, offset, ahead, ahead_at, ahead_lines, acc)
    elif bits == 4:
        group_4(data, w_off, *x, n_blk, offset, ahead, ahead_at, ahead_lines, acc)
    elif bits == 5 and has_min:
        group_5_min(data, w_off, *x, n_blk, offset, ahead, ahead_at, ahead_lines, acc)
    elif bits == 5:
        group_5(data, w_off, *x, n_blk, offset, ahead, ahead_at, ahead_lines, acc)
    elif has_min:
        group_8_min(data, w_off, *x, n_blk, offset, ahead, ahead_at, ahead_lines, acc)
    else:
        group_8(data, w_off, *x, n_blk, offset, ahead, ahead_at, ahead_lines, acc)


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
def _tile_portable(data, w_off, xq, t, xd, xs, starts, n_blk, offset, bits, has_min, block_sums, acc):
    """The steps of lanes_gemv in plain Numba: acc[:8R] the lane accumulators, acc[8R:] summs
    (block_sums: acc[:R] the rows' accumulators)."""
    acc[:] = 0
    bb, cb = block_bytes(bits, has_min), code_bytes(bits)
    for b in range(n_blk):
        at = w_off + b * bb
        x0 = (t * n_blk + b) * 32
        for r in range(R):
            d_w = F16_TO_F32[np.int32(data[at + cb + 2 * r]) | (np.int32(data[at + cb + 2 * r + 1]) << 8)]
            dd = d_w * xd[t, b]
            total = np.int32(0)
            for l in range(8):
                lane = np.int32(0) if has_min else starts[t, 8 * b + l]
                for j in range(4):
                    lane += _code(data, at, bits, l, r, j) * np.int32(xq[x0 + 4 * l + j])
                if block_sums:
                    total += lane
                else:
                    acc[l * R + r] = fma(dd, np.float32(lane), acc[l * R + r])
            if block_sums:
                acc[r] = fma(dd, np.float32(total), acc[r])
            if has_min:
                m_at = at + cb + 2 * R + 2 * r
                m_w = F16_TO_F32[np.int32(data[m_at]) | (np.int32(data[m_at + 1]) << 8)]
                acc[8 * R + r] = fma(m_w, xs[t, b], acc[8 * R + r])
