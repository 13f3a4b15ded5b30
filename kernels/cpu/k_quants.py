"""Q2_K, Q3_K and Q5_K products the way llama.cpp's x86 backend computes them (AVX2 build), and
Q4_K's where llama.cpp does not repack it (rows not in eights; repacked: q4_k.py).

Weights in matmul.py's uniform tiles (stored codes q + offset: Q2_K's 0..3, Q3_K's -4..3 + 4 and
Q4_K's 0..15 two a byte, Q5_K's 0..31 + 128 a byte each), with the format's own integer scales:
    sc   int8 (NT, K/G, R)     sub-block scales (Q3_K's less 32), G = 16 (Q2_K, Q3_K) or 32 (Q4_K, Q5_K)
    mins int8 (NT, K/G, R)     sub-block mins (Q2_K, Q4_K, Q5_K), else (NT, 0, R)
    sb   f32  (NT, 2 K/256, R) each super-block's d at 2b, dmin at 2b + 1
Activations are Q8_K: codes, d per super-block (xd, repeated per 32 columns), code sums per 4
(xn4) and per 16 columns (xn16). Every integer sum is exact; the float steps are ggml's:

- fewer than TILED_MIN_ROWS rows: ggml_vec_dot_q{2,3,5}_K_q8_K. Eight lanes, lane l summing
  sc * q * x over columns 4l..4l+3 of every 32-wide block of a super-block, then per super-block
  acc[l] = fma(d_x * d_w, lane, acc[l]), and the result hsum_float_8(acc). The mins:
  Q2_K, per lane first: acc[k] = fma(-(d_x * dmin_w), m[2k] bsum[2k] + m[2k+1] bsum[2k+1], acc[k]);
  Q5_K, one running sum: summs = fma(-(d_x * dmin_w), sum_j m[j] bsum32[j], summs), added last;
  Q4_K, four lanes: acc_m[k] = fma(-(d_x * dmin_w), m[2k] bsum32[2k] + m[2k+1] bsum32[2k+1], acc_m[k]),
  added last as (m0 + m2) + (m1 + m3).
- a batch of TILED_MIN_ROWS rows or more: ggml's tiled K-quant kernel, one integer sum a
  super-block, res = d_w * S (then fma(-dmin_w, sum of m * bsum, res)), acc = fma(res, d_x, acc).
- Q2_K where llama.cpp repacks it (q2_K_8x8: an AVX-512 host, rows in eights; `repacked`): two
  accumulators, acc = fma(S, d_w * d_x, acc) and acc_m = fma(M, dmin_w * d_x, acc_m) with S and M
  the exact sums of sc * q * x and of m * bsum, the result acc - acc_m. Its gemv (a batch's last
  T % 4 rows, or all of a batch under 4) takes S and M a super-block at a time; its gemm (the
  batch's rows in fours) a half super-block (128 values) at a time.
row_by_row: vec_dot (gemv where repacked) for every row (a batch of one), for the batching scheduler.
"""
import numba as nb
import numpy as np

from .fma import fma
from .matmul import TILED_MIN_ROWS
from .vnni import R, tile_lanes


@nb.njit(parallel=True, cache=True, nogil=True)
def qmatmul_k_lanes(data, sc, mins, sb, nibbles, offset, xq, xd, xn4, xn16, row_by_row, repacked, out):
    """out (T, N) = x @ W.T for Q2_K/Q3_K/Q4_K/Q5_K tiles (module doc); xq (T*K,) the activation codes."""
    NT, n_groups = sc.shape[0], sc.shape[1]
    T = out.shape[0]
    G = 16 if n_groups == xn16.shape[1] else 32
    K = n_groups * G
    n_blk = K // 32
    block_bytes = (16 if nibbles else 32) * R
    tiled = T >= TILED_MIN_ROWS and not row_by_row and not repacked
    for nt in nb.prange(NT):
        lanes = np.empty(4 * 8 * R, np.int32)  # (token, lane, row) integer sums of one block
        isum = np.zeros((4, 8, R), np.int32)   # (token, lane, row) scale-weighted, this super-block
        acc = np.empty((4, 8, R), np.float32)  # (token, lane, row); the tiled kernel uses lane 0
        summs = np.empty((4, R), np.float32)   # Q5_K's vec_dot: the mins' running sum
        acc_m = np.empty((4, 4, R), np.float32)  # Q4_K's vec_dot: (token, lane, row) the mins' sums
        for t0 in range(0, T, 4):
            n_tok = min(4, T - t0)
            acc[:] = 0
            summs[:] = 0
            acc_m[:] = 0
            for blk in range(n_blk):
                at = (nt * n_blk + blk) * block_bytes
                if n_tok == 4:
                    tile_lanes(data, at, xq, t0 * K + blk * 32, K, 4, nibbles, lanes)
                else:
                    for tok in range(n_tok):
                        tile_lanes(data, at, xq, (t0 + tok) * K + blk * 32, K, 1, nibbles, lanes[tok * 8 * R:])
                for tok in range(n_tok):
                    _add_block(lanes, isum, sc, nt, blk, tok, t0 + tok, G, np.int32(offset), xn4)
                if repacked:
                    gemm = n_tok == 4 and not row_by_row
                    if blk % 8 == 7 or (gemm and blk % 4 == 3):
                        first, n_sub = (8 * (blk % 8 // 4), 8) if gemm else (0, 16)
                        for tok in range(n_tok):
                            _part_8x8(isum[tok], acc[tok], mins, sb, nt, blk // 8, first, n_sub, t0 + tok, xd, xn16)
                elif blk % 8 == 7:
                    for tok in range(n_tok):
                        if tiled:
                            _superblock_tiled(isum[tok], acc[tok, 0], sc, mins, sb, nt, blk // 8, t0 + tok, G, xd, xn16)
                        else:
                            _superblock_vec_dot(isum[tok], acc[tok], summs[tok], acc_m[tok], mins, sb, nt, blk // 8,
                                                t0 + tok, G, nibbles, xd, xn16)
            _write(acc, summs, acc_m, n_tok, t0, nt, tiled, repacked, G, nibbles, mins.shape[1] > 0, out)


@nb.njit(inline="always", cache=True, nogil=True)
def _add_block(lanes, isum, sc, nt, blk, tok, t, G, offset, xn4):
    """isum[tok] += each lane's sub-block scale * its exact sum of q * x over block blk."""
    for l in range(8):
        shift = offset * xn4[t, 8 * blk + l]  # stored codes q + offset -> q
        scale = sc[nt, 2 * blk + l // 4] if G == 16 else sc[nt, blk]
        for r in range(R):
            isum[tok, l, r] += np.int32(scale[r]) * (lanes[(tok * 8 + l) * R + r] - shift)


@nb.njit(inline="always", cache=True, nogil=True)
def _superblock_vec_dot(isum, acc, summs, acc_m, mins, sb, nt, b, t, G, nibbles, xd, xn16):
    """vec_dot's float steps for super-block b of token t; isum (8, R) cleared after."""
    dx = xd[t, 8 * b]
    for r in range(R):
        d = dx * sb[nt, 2 * b, r]
        if mins.shape[1] > 0:
            dmin = -(dx * sb[nt, 2 * b + 1, r])
            if G == 16:  # Q2_K: lane k takes the mins of the 16-groups 2k and 2k + 1
                for k in range(8):
                    g = 16 * b + 2 * k
                    prod = np.int32(mins[nt, g, r]) * xn16[t, g] + np.int32(mins[nt, g + 1, r]) * xn16[t, g + 1]
                    acc[k, r] = fma(dmin, np.float32(prod), acc[k, r])
            elif nibbles:  # Q4_K: lane k takes the mins of the sub-blocks 2k and 2k + 1
                for k in range(4):
                    prod = np.int32(0)
                    for j in range(2 * k, 2 * k + 2):
                        prod += np.int32(mins[nt, 8 * b + j, r]) * (xn16[t, 16 * b + 2 * j] + xn16[t, 16 * b + 2 * j + 1])
                    acc_m[k, r] = fma(dmin, np.float32(prod), acc_m[k, r])
            else:        # Q5_K: one sum over the 8 sub-blocks
                total = np.int32(0)
                for j in range(8):
                    total += np.int32(mins[nt, 8 * b + j, r]) * (xn16[t, 16 * b + 2 * j] + xn16[t, 16 * b + 2 * j + 1])
                summs[r] = fma(dmin, np.float32(total), summs[r])
        for l in range(8):
            acc[l, r] = fma(d, np.float32(isum[l, r]), acc[l, r])
            isum[l, r] = 0


@nb.njit(inline="always", cache=True, nogil=True)
def _superblock_tiled(isum, acc, sc, mins, sb, nt, b, t, G, xd, xn16):
    """The tiled kernel's float steps for super-block b of token t; isum (8, R) cleared after."""
    dx = xd[t, 8 * b]
    n_sub = 256 // G
    for r in range(R):
        total = np.int32(0)
        for l in range(8):
            total += isum[l, r]
            isum[l, r] = 0
        res = sb[nt, 2 * b, r] * np.float32(total)
        if mins.shape[1] > 0:
            s2 = np.int32(0)
            for s in range(n_sub):
                g = n_sub * b + s
                bsum = xn16[t, g] if G == 16 else xn16[t, 2 * g] + xn16[t, 2 * g + 1]
                s2 += np.int32(mins[nt, g, r]) * bsum
            res = fma(-sb[nt, 2 * b + 1, r], np.float32(s2), res)
        acc[r] = fma(res, dx, acc[r])


@nb.njit(inline="always", cache=True, nogil=True)
def _part_8x8(isum, acc, mins, sb, nt, b, first, n_sub, t, xd, xn16):
    """q2_K_8x8's float steps for the 16-value sub-blocks [first, first + n_sub) of super-block
    b of token t: acc[0] += S * (d_w * d_x), acc[1] += M * (dmin_w * d_x), each one fma, with S
    (isum's lanes, cleared after) and M (the mins times the activations' sums) exact."""
    dx = xd[t, 8 * b]
    for r in range(R):
        total = np.int32(0)
        for l in range(8):
            total += isum[l, r]
            isum[l, r] = 0
        m = np.int32(0)
        for g in range(16 * b + first, 16 * b + first + n_sub):
            m += np.int32(mins[nt, g, r]) * xn16[t, g]
        acc[0, r] = fma(np.float32(total), sb[nt, 2 * b, r] * dx, acc[0, r])
        acc[1, r] = fma(np.float32(m), sb[nt, 2 * b + 1, r] * dx, acc[1, r])


@nb.njit(inline="always", cache=True, nogil=True)
def _write(acc, summs, acc_m, n_tok, t0, nt, tiled, repacked, G, nibbles, has_min, out):
    n0 = nt * R
    for tok in range(n_tok):
        a = acc[tok]
        for r in range(min(R, out.shape[1] - n0)):
            if tiled:
                out[t0 + tok, n0 + r] = a[0, r]
                continue
            if repacked:
                out[t0 + tok, n0 + r] = a[0, r] - a[1, r]
                continue
            h = ((a[0, r] + a[4, r]) + (a[2, r] + a[6, r])) + ((a[1, r] + a[5, r]) + (a[3, r] + a[7, r]))
            if has_min and G == 32 and nibbles:
                m = acc_m[tok]
                h += (m[0, r] + m[2, r]) + (m[1, r] + m[3, r])
            elif has_min and G == 32:
                h += summs[tok, r]
            out[t0 + tok, n0 + r] = h
