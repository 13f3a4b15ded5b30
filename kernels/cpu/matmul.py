"""Quantized matrix products with activations quantized at run time, as llama.cpp does.

The 32-block formats (Q4_0..Q8_0) have their own tiles and products (lanes.py). The K-quants
use the uniform layout of minillm.formats, repacked once at load into tiles of
R = 32 rows ("rows as lanes"), so that one instruction works on all 32 rows at once:

    data  uint8   (NT * K/4 * 4R,) flat: tile nt, column quad k4, row r, byte j holds the code
                  q[nt*R + r, 4*k4 + j] + offset at ((nt * K/4 + k4) * R + r) * 4 + j
                  or, for formats whose codes fit 4 bits (q + offset in 0..15), two columns a
                  byte (NT * K/8 * 4R,): columns 8p+j (low nibble) and 8p+4+j (high nibble) of
                  row r at ((nt * K/8 + p) * R + r) * 4 + j
    scale int8    (NT, K/G, R)   the format's integer sub-block scales (in float32 slots)
    bias  int8    (NT, K/G, R)   its integer mins, or (NT, 0, R) for formats without
    sb    float32 (NT, 2 K/256, R) each super-block's d and dmin

Activations x (T, K) are quantized per llama.cpp's pairing (Q8_0, Q8_1 or Q8_K) into
    xq int8 (T, K); per 16- and 32-group: d (the activation scale of the group's block),
    s = d * sum(q) and n = sum(q) (int32)
Integer sums sum_k (q_w + offset) * q_x - offset * sum_k q_x are computed in int32 (vnni.py), as
exact as ggml's; each format's kernel then takes ggml's float steps: Q4_K here and in q4_k.py,
Q6_K here and in q6_k.py, Q2_K/Q3_K/Q5_K in k_quants.py.
"""
import numba as nb
import numpy as np

from .f16 import f16_round
from .fma import fma
from .lanes import PREFETCH_MIN_TOKENS, aligned_zeros, next_tile_share, prefetch_next_tile
from .q4_k import gemm_row_q4_k, gemv_q4_k
from .q6_k import tiled_q6_k_1, tiled_q6_k_4, vec_dot_q6_k
from .simd import quantize_block_32
from .vnni import HAS_INT8_DOT, R, tile_dot4_nib, tile_dot_nib, tile_lanes

KIND_Q8_0, KIND_Q8_1, KIND_Q8_K = 0, 1, 2
KIND_IDS = {"q8_0": KIND_Q8_0, "q8_1": KIND_Q8_1, "q8_k": KIND_Q8_K}

# How llama.cpp's x86 backend sums a format's products (Format.product); each has a kernel here
PRODUCT_LANES, PRODUCT_Q4_K, PRODUCT_Q6_K, PRODUCT_K_LANES, PRODUCT_LANES_BLOCKS, PRODUCT_K_LANES_8X8 = range(6)
# from this many activation rows on, llama.cpp multiplies non-repacked K-quants (Q6_K here) with
# its "tiled" kernel instead of vec_dot
TILED_MIN_ROWS = 8
PRODUCT_IDS = {"lanes": PRODUCT_LANES, "q4_k": PRODUCT_Q4_K, "q6_k": PRODUCT_Q6_K, "k_lanes": PRODUCT_K_LANES,
               "lanes_blocks": PRODUCT_LANES_BLOCKS, "k_lanes_8x8": PRODUCT_K_LANES_8X8}
# The products whose arithmetic follows the batch size: for the batching scheduler their
# Weights say row_by_row (every batch row through the one-token kernel, so that a row's result
# never depends on the rows beside it).
BATCH_DEPENDENT = (PRODUCT_Q4_K, PRODUCT_Q6_K, PRODUCT_K_LANES, PRODUCT_K_LANES_8X8)


@nb.njit(cache=True, nogil=True)
def _quantize_row_q8_32(x, q, d32, s32, n4, round_sum):
    # llama.cpp quantize_row_q8_0/_q8_1 (x86): d = amax/127 stored as f16, q = rint(x * 127/amax)
    for b in range(x.shape[0] // 32):
        d = quantize_block_32(x, 32 * b, q, 32 * b, n4, 8 * b) / np.float32(127.0)
        total = 0
        for g in range(8 * b, 8 * b + 8):
            total += n4[g]
        d32[b] = f16_round(d)
        s32[b] = f16_round(d * np.float32(total)) if round_sum else d32[b] * np.float32(total)


@nb.njit(cache=True, nogil=True)
def _quantize_row_q8_k(x, q, d32, s32):
    # llama.cpp quantize_row_q8_K_ref: iscale = -127/max (max signed), d = 1/iscale in f32
    for b in range(x.shape[0] // 256):
        amax = np.float32(0.0)
        vmax = np.float32(0.0)
        for j in range(256):
            ax = abs(x[b * 256 + j])
            if ax > amax:
                amax = ax
                vmax = x[b * 256 + j]
        iscale = np.float32(-127.0) / vmax if amax != 0 else np.float32(0.0)
        d = np.float32(1.0) / iscale if amax != 0 else np.float32(0.0)
        for g in range(8):
            total = 0
            for j in range(32):
                v = min(127, np.int32(np.rint(iscale * x[b * 256 + g * 32 + j])))
                q[b * 256 + g * 32 + j] = v
                total += v
            d32[b * 8 + g] = d
            s32[b * 8 + g] = d * np.float32(total)


@nb.njit(parallel=True, cache=True, nogil=True)
def _quantize_parallel(x, kind, xq, d16, s16, n16, d32, s32, n32, n4):
    for t in nb.prange(x.shape[0]):
        _quantize_row(x, t, kind, xq, d16, s16, n16, d32, s32, n32, n4)


# from this many rows on, activations are quantized in parallel: a 32-block row of 576 values
# takes ~0.1 us, a parallel region a few
PARALLEL_QUANTIZE_ROWS = 64


@nb.njit(cache=True, nogil=True)
def quantize_act(x, kind, xq, d16, s16, n16, d32, s32, n32, n4):
    """x (T, K) float32 -> xq (T, K) int8 and per-group scales/sums (see module doc), and n4
    (T, K/4) the sums of every 4 codes."""
    if x.shape[0] >= (PARALLEL_QUANTIZE_ROWS if kind != KIND_Q8_K else 8):
        _quantize_parallel(x, kind, xq, d16, s16, n16, d32, s32, n32, n4)
    else:  # a few rows (decode): starting threads would cost more than the work
        for t in range(x.shape[0]):
            _quantize_row(x, t, kind, xq, d16, s16, n16, d32, s32, n32, n4)


@nb.njit(inline="always", cache=True, nogil=True)
def _quantize_row(x, t, kind, xq, d16, s16, n16, d32, s32, n32, n4):
    K = x.shape[1]
    if kind == KIND_Q8_K:
        _quantize_row_q8_k(x[t], xq[t], d32[t], s32[t])
        for c in range(K // 4):
            n4[t, c] = (np.int32(xq[t, 4 * c]) + np.int32(xq[t, 4 * c + 1])
                        + np.int32(xq[t, 4 * c + 2]) + np.int32(xq[t, 4 * c + 3]))
    else:
        _quantize_row_q8_32(x[t], xq[t], d32[t], s32[t], n4[t], kind == KIND_Q8_1)
    for g in range(K // 16):
        total = n4[t, 4 * g] + n4[t, 4 * g + 1] + n4[t, 4 * g + 2] + n4[t, 4 * g + 3]
        n16[t, g] = total
        d16[t, g] = d32[t, g // 2]
        s16[t, g] = d16[t, g] * np.float32(total)
    for g in range(K // 32):
        n32[t, g] = n16[t, 2 * g] + n16[t, 2 * g + 1]


@nb.njit(parallel=True, cache=True, nogil=True)
def qmatmul_q4_k(data, sc, mins, sb, xq, xd, xn32, row_by_row, out):
    """out (T, N) = x @ W.T for Q4_K as llama.cpp's repacked q4_K_8x8 kernels compute it: rows
    of the batch in whole groups of 4 go through the gemm kernel (one fma per pair of 32-wide
    sub-blocks), the last T % 4 rows through the gemv kernel (one fma per super-block); the
    integer sums sc * sum(q_w q_x) and mins * sum(q_x) are exact, out = acc - acc_min.
    row_by_row: every row through the gemv kernel (as a batch of one).
    sc, mins (NT, K/32, R) int8; sb (NT, 2 K/256, R) each super-block's d, dmin."""
    NT, n_sub = sc.shape[0], sc.shape[1]
    T, N = out.shape
    K = n_sub * 32
    block_bytes = 16 * R
    n_gemm = 0 if row_by_row else T - T % 4
    for nt in nb.prange(NT):
        if HAS_INT8_DOT:
            _q4_k_tile_vnni(data, sc, mins, sb, xq, xd, xn32, nt, n_gemm, out)
            continue
        isum = np.empty(4 * R, np.int32)      # (token, row) integer sums of one sub-block
        ipart = np.zeros((4, R), np.int32)    # (token, row) sc-weighted sums not yet added
        mpart = np.zeros((4, R), np.int32)
        acc = np.empty((4, R), np.float32)
        acc_min = np.empty((4, R), np.float32)
        for t0 in range(0, T, 4):
            n_tok = min(4, T - t0)
            gemm = t0 < n_gemm
            acc[:] = 0
            acc_min[:] = 0
            for j in range(n_sub):
                start = (nt * n_sub + j) * block_bytes
                if n_tok == 4:
                    tile_dot4_nib(data, start, xq, t0 * K + j * 32, K, 8, isum)
                else:
                    for tok in range(n_tok):
                        tile_dot_nib(data, start, xq, (t0 + tok) * K + j * 32, 8, isum[tok * R:])
                last = (j % 2 == 1) if gemm else (j % 8 == 7)  # the kernel's fma comes after this sub-block
                b = j // 8
                for tok in range(n_tok):
                    t = t0 + tok
                    bx = xn32[t, j]
                    for r in range(R):
                        ipart[tok, r] += np.int32(sc[nt, j, r]) * isum[tok * R + r]
                        mpart[tok, r] += np.int32(mins[nt, j, r]) * bx
                    if last:
                        da = xd[t, j]
                        for r in range(R):
                            acc[tok, r] = fma(np.float32(ipart[tok, r]), sb[nt, 2 * b, r] * da, acc[tok, r])
                            acc_min[tok, r] = fma(np.float32(mpart[tok, r]), sb[nt, 2 * b + 1, r] * da,
                                                  acc_min[tok, r])
                            ipart[tok, r] = 0
                            mpart[tok, r] = 0
            n0 = nt * R
            for tok in range(n_tok):
                for r in range(min(R, N - n0)):
                    out[t0 + tok, n0 + r] = acc[tok, r] - acc_min[tok, r]


@nb.njit(inline="always", cache=True, nogil=True)
def _q4_k_tile_vnni(data, sc, mins, sb, xq, xd, xn32, nt, n_gemm, out):
    """qmatmul_q4_k's tile nt through q4_k.py's loop, one token at a time: the gemm's fmas for
    the first n_gemm rows, the gemv's for the rest."""
    T, N = out.shape
    n_sub = sc.shape[1]
    K = n_sub * 32
    w_off = nt * n_sub * 16 * R
    n0 = nt * R
    row_out = np.empty(R, np.float32)
    for t in range(T):
        ahead = _walk_ahead(data, nt, n_sub * 16 * R, t, t + 1, T)  # the codes
        if t < n_gemm:
            gemm_row_q4_k(data, w_off, sc, mins, sb, nt, xq, t * K, xd, xn32, t, n_sub // 8, data, *ahead, row_out)
        else:
            gemv_q4_k(data, w_off, sc, mins, sb, nt, xq, t * K, xd, xn32, t, n_sub // 8, data, *ahead, row_out)
        for r in range(min(R, N - n0)):
            out[t, n0 + r] = row_out[r]
        prefetch_next_tile(sc, nt, n_sub * R, t, t + 1, T)  # the sub-block scales and mins (int8)
        prefetch_next_tile(mins, nt, n_sub * R, t, t + 1, T)


# A lone token's Q4_K and Q6_K walks ask for the bytes this far ahead of where they are (a Q4_K
# super-block of a tile is 4096 bytes, a Q6_K one 8192). Gemma 3's 18 products, cold, against
# no prefetch: 4096 bytes Q4_K 0.87x, Q6_K 0.84x; 8192 bytes 0.81x and 0.83x.
K_QUANT_AHEAD_BYTES = 8192


@nb.njit(inline="always", cache=True, nogil=True)
def _walk_ahead(data, nt, tile_bytes, t0, t1, T):
    """The cache lines a K-quant walk of tokens t0..t1 - 1 over tile nt asks for on its way, as
    (first byte, number of lines): in a batch, its share of the next tile (lanes.next_tile_share);
    a lone token's walk (memory-bound), the tile's bytes from K_QUANT_AHEAD_BYTES on."""
    if T >= PREFETCH_MIN_TOKENS:
        return next_tile_share(data, nt, tile_bytes, t0, t1, T)
    first = min(nt * tile_bytes + K_QUANT_AHEAD_BYTES, data.size)
    return first, (min(first + tile_bytes, data.size) - first + 63) // 64


@nb.njit(parallel=True, cache=True, nogil=True)
def qmatmul_q6_k(data, sc, sb, xq, xd, xn4, xn16, row_by_row, out):
    """out (T, N) = x @ W.T for Q6_K the way llama.cpp's x86 backend computes it, all integer
    sums exact:
    - batches of fewer than TILED_MIN_ROWS rows: ggml_vec_dot_q6_K_q8_K (AVX2), 8 lanes, lane l
      summing sc * q * q_x over columns 4l..4l+3 of every 32-wide block (q the unsigned code
      0..63) less 32 * (the scale-weighted activation sums of columns 32l..32l+31); per
      super-block acc[l] = fma(d_x * d_w, lane sum, acc[l]); then hsum_float_8;
    - larger batches: ggml's "tiled" K-quant kernel, one integer sum S per super-block and
      acc = fma(float(S) * d_w, d_x, acc); row_by_row: vec_dot for every row (a batch of one).
    Codes stored as q + 96 (= q - 32 + 128); sc (NT, K/16, R) int8; sb (NT, 2 K/256, R)
    holds d; xn16 (T, K/16) the activation code sums of each 16 columns."""
    NT, n_half = sc.shape[0], sc.shape[1]
    T, N = out.shape
    K = n_half * 16
    n_blk = K // 32
    block_bytes = 32 * R
    tiled = T >= TILED_MIN_ROWS and not row_by_row
    for nt in nb.prange(NT):
        if HAS_INT8_DOT:
            _q6_k_tile_vnni(data, sc, sb, xq, xd, xn4, xn16, nt, tiled, out)
            continue
        lanes = np.empty(4 * 8 * R, np.int32)  # (token, lane, row) integer sums of one block
        isum = np.zeros((4, 8, R), np.int32)  # (token, lane, row) this super-block's sums
        acc = np.empty((4, 8, R), np.float32)
        for t0 in range(0, T, 4):
            n_tok = min(4, T - t0)
            acc[:] = 0
            for blk in range(n_blk):
                tile_lanes(data, (nt * n_blk + blk) * block_bytes, xq, t0 * K + blk * 32, K,
                           4 if n_tok == 4 else 1, False, lanes)
                if n_tok < 4:
                    for tok in range(1, n_tok):
                        tile_lanes(data, (nt * n_blk + blk) * block_bytes, xq, (t0 + tok) * K + blk * 32, K,
                                   1, False, lanes[tok * 8 * R:])
                for tok in range(n_tok):
                    t = t0 + tok
                    for l in range(8):
                        shift = np.int32(96) * xn4[t, 8 * blk + l]  # codes q + 96 -> q
                        scale = sc[nt, 2 * blk + l // 4]
                        for r in range(R):
                            isum[tok, l, r] += np.int32(scale[r]) * (lanes[(tok * 8 + l) * R + r] - shift)
                if blk % 8 == 7:
                    b = blk // 8
                    for tok in range(n_tok):
                        t = t0 + tok
                        da = xd[t, blk]
                        for l in range(8):
                            g = 16 * b + 2 * l  # lane l's offset term: 16-groups g, g + 1
                            s0, s1 = sc[nt, g], sc[nt, g + 1]
                            x0, x1 = xn16[t, g], xn16[t, g + 1]
                            for r in range(R):
                                isum[tok, l, r] -= 32 * (np.int32(s0[r]) * x0 + np.int32(s1[r]) * x1)
                        for r in range(R):
                            dw = sb[nt, 2 * b, r]
                            if tiled:
                                total = np.int32(0)
                                for l in range(8):
                                    total += isum[tok, l, r]
                                acc[tok, 0, r] = fma(np.float32(total) * dw, da, acc[tok, 0, r])
                            else:
                                for l in range(8):
                                    acc[tok, l, r] = fma(da * dw, np.float32(isum[tok, l, r]), acc[tok, l, r])
                            for l in range(8):
                                isum[tok, l, r] = 0
            n0 = nt * R
            for tok in range(n_tok):
                a = acc[tok]
                for r in range(min(R, N - n0)):
                    out[t0 + tok, n0 + r] = a[0, r] if tiled else (((a[0, r] + a[4, r]) + (a[2, r] + a[6, r]))
                                                                   + ((a[1, r] + a[5, r]) + (a[3, r] + a[7, r])))


@nb.njit(inline="always", cache=True, nogil=True)
def _q6_k_tile_vnni(data, sc, sb, xq, xd, xn4, xn16, nt, tiled, out):
    """qmatmul_q6_k's tile nt through the intrinsics of q6_k.py."""
    T, N = out.shape
    n_sb = sc.shape[1] // 16
    K = n_sb * 256
    w_off = nt * K * R
    n0 = nt * R
    n_rows = min(R, N - n0)
    acc = np.empty(8 * R, np.float32)
    t = 0
    while t < T:
        n_tok = 4 if tiled and T - t >= 4 else 1
        ahead = _walk_ahead(data, nt, K * R, t, t + n_tok, T)  # the codes
        if n_tok == 4:
            tiled_q6_k_4(data, w_off, sc, sb, nt, xq, t * K, xd, xn4, xn16, t, n_sb, data, *ahead, acc)
            for k in range(4):
                for r in range(n_rows):
                    out[t + k, n0 + r] = acc[k * R + r]
        elif tiled:
            tiled_q6_k_1(data, w_off, sc, sb, nt, xq, t * K, xd, xn4, xn16, t, n_sb, data, *ahead, acc)
            for r in range(n_rows):
                out[t, n0 + r] = acc[r]
        else:
            vec_dot_q6_k(data, w_off, sc, sb, nt, xq, t * K, xd, xn4, xn16, t, n_sb, data, *ahead, acc)
            for r in range(n_rows):
                out[t, n0 + r] = (((acc[r] + acc[4 * R + r]) + (acc[2 * R + r] + acc[6 * R + r]))
                                  + ((acc[R + r] + acc[5 * R + r]) + (acc[3 * R + r] + acc[7 * R + r])))
        prefetch_next_tile(sc, nt, K // 16 * R, t, t + n_tok, T)  # the 16-column scales
        t += n_tok


@nb.njit(parallel=True, cache=True, nogil=True)
def _tile_rows(q, scale, bias, offset, nibbles, nt0, data, scale_t, bias_t):
    """Write rows q (n, K) (and their scales) into tiles nt0.. of data/scale_t/bias_t.
    A tile's codes are (K/4, R, 4) bytes, or (K/8, R, 4) with columns k and k+4 of each group
    of 8 in the low and high nibble; written in order, each tile's rows read side by side."""
    N, K = q.shape
    for t in nb.prange((N + R - 1) // R):
        nt, n0 = nt0 + t, t * R
        rows = min(R, N - n0)  # the rest of a last tile stays padding: code 0, scale 0
        if nibbles:
            for k8 in range(K // 8):
                at = (nt * (K // 8) + k8) * R * 4
                for r in range(rows):
                    for j in range(4):
                        low = np.int32(q[n0 + r, 8 * k8 + j]) + offset
                        high = np.int32(q[n0 + r, 8 * k8 + 4 + j]) + offset
                        data[at + 4 * r + j] = np.uint8(low | (high << 4))
        else:
            for k4 in range(K // 4):
                at = (nt * (K // 4) + k4) * R * 4
                for r in range(rows):
                    for j in range(4):
                        data[at + 4 * r + j] = np.uint8(np.int32(q[n0 + r, 4 * k4 + j]) + offset)
        for r in range(rows):
            for g in range(scale.shape[1]):
                scale_t[nt, g, r] = scale[n0 + r, g]
            for g in range(bias.shape[1]):
                bias_t[nt, g, r] = bias[n0 + r, g]


CHUNK_ROWS = 64 * R  # rows unpacked at a time: the transient copy stays small


def empty_tiles(N: int, K: int, n_groups: int, n_bias_groups: int, nibble_offset: int | None):
    """Zeroed tiles for an (N, K) matrix: codes, int8 sub-block scales and mins."""
    NT = (N + R - 1) // R
    nibbles = nibble_offset is not None
    data = aligned_zeros(NT * K * R // (2 if nibbles else 1))
    scale_t = np.zeros((NT, n_groups, R), np.int8)
    bias_t = np.zeros((NT, n_bias_groups, R), np.int8)
    return data, scale_t, bias_t, nibble_offset if nibbles else 128, nibbles


def fill_tiles(tiles, row0: int, q: np.ndarray, scale: np.ndarray, bias: np.ndarray) -> None:
    """Write rows row0.. (row0 a multiple of R) into tiles made by empty_tiles."""
    data, scale_t, bias_t, offset, nibbles = tiles
    _tile_rows(q, scale, bias, offset, nibbles, row0 // R, data, scale_t, bias_t)


def tile_floats(a: np.ndarray, row0: int, out: np.ndarray) -> None:
    """Rows row0.. of a per-row table a (n, C) into out (NT, C, R): out[nt, c, r] = a[nt*R + r, c]."""
    n, C = a.shape
    padded = np.zeros(((n + R - 1) // R * R, C), np.float32)
    padded[:n] = a
    nt0 = row0 // R
    out[nt0:nt0 + padded.shape[0] // R] = padded.reshape(-1, R, C).transpose(0, 2, 1)
