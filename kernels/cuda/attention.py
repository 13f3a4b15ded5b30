"""Causal (optionally sliding-window) attention over the f16 KV cache, one launch per layer,
with the arithmetic of minillm.kernels.cpu.attention (ggml's CPU flash_attn_ext with F16 K/V),
whose path depends on the batch:

- fewer than TILE query rows (attention_kernel): ggml's one chunk. Q rounded to f16, f32 scores,
  online softmax in f32, the running V sum rounded to f16 after every update, keys visited in
  position order (the order matters to the f16 sums; position p sits in slot p below n_keep,
  else in the ring after it). One thread block per (head, token); the keys are taken in chunks
  of blockDim.x:
    1. each thread scores one key of the chunk (masked keys score -inf) into shared memory;
    2. each thread owns some of the D dimensions and replays the online softmax over the
       chunk's scores in order, so every thread keeps the same max and sum without further syncs.
- TILE query rows or more (attention_tiled_kernel): ggml's tiled path. Q in f32, each score one
  fma chain over the head's values, cells in tiles of TILE with one softmax maximum per tile,
  exp by ggml_v_expf (v_expf), the tile's sum of exps in double over SIMD-width hsums, the V
  sum an fma chain per value in f32. The CPU walks a tile of 64 query rows against each cell
  tile; a row's results do not depend on the other rows, so here one thread block takes one
  (head, token) and walks the cell tiles it sees.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from ..cpu.ops import (_EXP_C1, _EXP_C2, _EXP_C3, _EXP_C4, _EXP_C5, _EXP_ROUND, _LN2_HI, _LN2_LO, _LOG2E,
                       GGML_AVX512)
from .device import NEG_INF, f16_round, fma32, pow2_threads
from .launch import launch
from .registry import device, kernel

MAX_HEAD_DIM = 512
MAX_THREADS = 128
TILE = 64   # the CPU's Q_TILE and KV_TILE: from this many query rows, cells in tiles of this many
SIMD_WIDTH = 16 if GGML_AVX512 else 8  # the lanes of ggml's softmax sums (the host CPU's build)

_SIG = ("void(float32[:, ::1], int64[::1], float16[:, :, ::1], float16[:, :, ::1], int64[::1], int64, "
        "int64, float32, float32, float32[:, ::1])")


@device
def _slot(cell, n_keep, n_slots):
    """The slot that holds position `cell` (if the ring still has it)."""
    if cell < n_keep:
        return cell
    return n_keep + (cell - n_keep) % (n_slots - n_keep)


@kernel(_SIG)
def attention_kernel(q, q_pos, kcache, vcache, kv_pos, n_keep, window, scale, softcap, out):
    """q (T, H*D) float32, q_pos (T,); kcache/vcache (S, Hkv, D) float16; kv_pos (S,) the logical
    position in each slot (-1: empty); positions [0, q_pos[t]] are scanned in order, each read
from its slot when the ring still holds it. window
    0: unlimited, else a key at position p is visible from position i when 0 <= i - p < window.
    softcap (0: none): scores capped at softcap * tanh(score / softcap), scale already divided.
    out (T, H*D).
    Grid (H, T), block (n,) with n <= MAX_THREADS."""
    q_sh = cuda.shared.array(MAX_HEAD_DIM, np.float32)     # (D,) the query, f16-rounded
    acc_sh = cuda.shared.array(MAX_HEAD_DIM, np.float32)   # (D,) running V sum (f16 values)
    score_sh = cuda.shared.array(MAX_THREADS, np.float32)  # (chunk,) scores of the chunk's keys
    slot_sh = cuda.shared.array(MAX_THREADS, np.int64)     # (chunk,) their slots
    h = cuda.blockIdx.x
    t = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    chunk = cuda.blockDim.x
    n_kv_heads = kcache.shape[1]
    D = kcache.shape[2]
    kvh = h // (cuda.gridDim.x // n_kv_heads)
    for d in range(tid, D, chunk):
        q_sh[d] = f16_round(q[t, h * D + d])
        acc_sh[d] = np.float32(0.0)
    cuda.syncthreads()
    pos = q_pos[t]
    m = NEG_INF
    s_sum = np.float32(0.0)
    first = max(0, pos - window + 1) if window > 0 else 0
    n_slots = kcache.shape[0]
    for c0 in range(first, pos + 1, chunk):
        score = NEG_INF
        slot = 0
        cell = c0 + tid
        if cell <= pos:
            slot = _slot(cell, n_keep, n_slots)
            if kv_pos[slot] == cell:
                dot = np.float32(0.0)
                for d in range(D):
                    dot += q_sh[d] * np.float32(kcache[slot, kvh, d])
                score = dot * scale
                if softcap != 0:
                    score = softcap * np.float32(math.tanh(score))
        score_sh[tid] = score
        slot_sh[tid] = slot
        cuda.syncthreads()
        for i in range(min(chunk, pos + 1 - c0)):
            sc = score_sh[i]
            if sc == NEG_INF:
                continue
            slot = slot_sh[i]
            if sc > m:
                ms = np.float32(math.exp(m - sc)) if m > NEG_INF else np.float32(0.0)
                m = sc
                for d in range(tid, D, chunk):
                    rescaled = f16_round(acc_sh[d] * ms)
                    acc_sh[d] = f16_round(rescaled + np.float32(vcache[slot, kvh, d]))
                s_sum = s_sum * ms + np.float32(1.0)
            else:
                vs = np.float32(math.exp(sc - m))
                for d in range(tid, D, chunk):
                    acc_sh[d] = f16_round(acc_sh[d] + np.float32(vcache[slot, kvh, d]) * vs)
                s_sum = s_sum + vs
        cuda.syncthreads()  # score_sh is refilled by the next chunk
    inv = np.float32(1.0) / s_sum if s_sum > 0 else np.float32(0.0)
    for d in range(tid, D, chunk):
        out[t, h * D + d] = acc_sh[d] * inv


_TILED_SIG = ("void(float32[:, ::1], int64[::1], float16[:, :, ::1], float16[:, :, ::1], int64[::1], int64, "
              "int64, float32, float32, float32, float32[:, ::1])")


@device
def v_expf(x):
    """ggml_v_expf, one lane, as the host CPU's ggml build computes it (kernels/cpu/ops.v_expf:
    AVX-512's scalef, or AVX2's fma(j, 2^n, 2^n) with two factors past |n| > 126); the powers of
    two by ldexp (exact)."""
    z = fma32(x, _LOG2E, _EXP_ROUND)
    n = z - _EXP_ROUND
    b = fma32(-n, _LN2_LO, fma32(-n, _LN2_HI, x))
    u = b * b
    poly = fma32(fma32(_EXP_C5, b, _EXP_C4), u, fma32(_EXP_C3, b, _EXP_C2))
    big = abs(n) > np.float32(192.0)
    if GGML_AVX512:
        if big:
            return np.float32(0.0) if n <= 0 else np.float32(np.inf)
        j = fma32(poly, u, fma32(_EXP_C1, b, np.float32(1.0)))
        return np.float32(math.ldexp(j, int(n)))  # one rounding of j * 2^n, as scalef
    j = fma32(poly, u, _EXP_C1 * b)
    if abs(n) <= np.float32(126.0):
        k = np.float32(math.ldexp(np.float32(1.0), int(n)))
        return fma32(j, k, k)
    s1 = np.float32(2.0 ** -125) if n <= 0 else np.float32(2.0 ** 127)
    if big:
        return s1 * s1
    s2 = np.float32(math.ldexp(np.float32(1.0), int(n) + 125 if n <= 0 else int(n) - 127))
    return fma32(s2, j, s2) * s1


@kernel(_TILED_SIG)
def attention_tiled_kernel(q, q_pos, kcache, vcache, kv_pos, n_keep, window, q_scale, scale, softcap, out):
    """The tiled path (module doc) for row t = blockIdx.y of q (T, H*D) (times q_scale, as the CPU
    layer scales q) and head h = blockIdx.x; other arguments as attention_kernel's. Block (TILE,):
    thread i scores cell c0 + i of each tile, then sums values i, i + TILE, ... of the head."""
    q_sh = cuda.shared.array(MAX_HEAD_DIM, np.float32)   # (D,) the query
    acc_sh = cuda.shared.array(MAX_HEAD_DIM, np.float32)  # (D,) the unnormalized V sum
    p_sh = cuda.shared.array(TILE, np.float32)           # (TILE,) the tile's scores, then exps
    slot_sh = cuda.shared.array(TILE, np.int64)          # (TILE,) each cell's slot, -1 if not held
    h = cuda.blockIdx.x
    t = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    n_kv_heads = kcache.shape[1]
    D = kcache.shape[2]
    kvh = h // (cuda.gridDim.x // n_kv_heads)
    for d in range(tid, D, TILE):
        q_sh[d] = q[t, h * D + d] * q_scale  # times 1: exact
        acc_sh[d] = np.float32(0.0)
    cuda.syncthreads()
    pos = q_pos[t]
    lo = max(0, pos - window + 1) if window > 0 else 0
    m = NEG_INF
    s_sum = np.float32(0.0)
    for c0 in range(lo // TILE * TILE, pos + 1, TILE):
        cell = c0 + tid
        slot = _slot(cell, n_keep, kcache.shape[0])
        held = kv_pos[slot] == cell
        score = np.float32(0.0)
        if held:
            for d in range(D):
                score = fma32(np.float32(kcache[slot, kvh, d]), q_sh[d], score)
        score = score * scale
        if softcap != 0:
            score = softcap * np.float32(math.tanh(score))
        masked = score if held and cell >= lo and cell <= pos else NEG_INF
        p_sh[tid] = masked
        slot_sh[tid] = slot if held else -1
        cuda.syncthreads()
        tile_max = NEG_INF  # every thread reads the tile: all keep the same max, sum and m
        for i in range(TILE):
            tile_max = max(tile_max, p_sh[i])
        cuda.syncthreads()  # every thread has read the scores
        if tile_max != NEG_INF:  # (a row that sees none of the tile: its sums stay as they are)
            m_new = max(m, tile_max)
            ms = np.float32(math.exp(m - m_new)) if m_new > m else np.float32(1.0)
            p_sh[tid] = v_expf(masked - m_new) if masked != NEG_INF else np.float32(0.0)  # v_expf(-inf): 0
            cuda.syncthreads()
            total = 0.0  # ggml_vec_soft_max_f32: SIMD-width hsums added in double
            for at in range(0, TILE, SIMD_WIDTH):
                total += np.float64(_hsum(p_sh, at))
            s_sum = np.float32(np.float64(s_sum * ms) + total)  # ms 1 (exact) when the max held
            for d in range(tid, D, TILE):
                a = acc_sh[d] * ms
                for i in range(TILE):
                    value = np.float32(vcache[slot_sh[i], kvh, d]) if slot_sh[i] >= 0 else np.float32(0.0)
                    a = fma32(value, p_sh[i], a)
                acc_sh[d] = a
            m = m_new
            cuda.syncthreads()  # p_sh is refilled by the next tile
    inv = np.float32(1.0) / s_sum if s_sum != 0 else np.float32(0.0)
    for d in range(tid, D, TILE):
        out[t, h * D + d] = acc_sh[d] * inv


@device
def _hsum(p, at):
    """ggml's hsum of SIMD_WIDTH values from p[at] (kernels/cpu/attention._reduce16, _reduce8)."""
    if SIMD_WIDTH == 16:
        a0 = (p[at] + p[at + 8]) + (p[at + 4] + p[at + 12])
        a1 = (p[at + 1] + p[at + 9]) + (p[at + 5] + p[at + 13])
        a2 = (p[at + 2] + p[at + 10]) + (p[at + 6] + p[at + 14])
        a3 = (p[at + 3] + p[at + 11]) + (p[at + 7] + p[at + 15])
        return (a0 + a2) + (a1 + a3)
    return ((p[at] + p[at + 4]) + (p[at + 2] + p[at + 6])) + ((p[at + 1] + p[at + 5]) + (p[at + 3] + p[at + 7]))


def attention(q, q_pos, kcache, vcache, kv_pos, n_keep: int, window: int, scale: float, softcap: float,
              n_heads: int, out, q_scale: float = 1.0):
    """Launch the path ggml takes for T = q.shape[0] rows (module doc; device arrays, shapes as
    in attention_kernel's doc) of q times q_scale: the tiled path scales q as the CPU's layer
    does; the one-chunk path, which rounds q to f16, takes q_scale into the scores' scale (exact
    for a power of two, see layers.rope_attend)."""
    T = q.shape[0]
    D = kcache.shape[2]
    if D > MAX_HEAD_DIM or n_heads % kcache.shape[1]:
        raise ValueError(f"unsupported heads: {n_heads} query heads, {kcache.shape[1]} KV heads of {D}")
    if T < TILE:
        scale = np.float32(np.float32(scale) * np.float32(q_scale))
    if softcap:  # as ggml: the scale divided by the cap, the capped score multiplied by it
        scale = np.float32(np.float32(scale) / np.float32(softcap))
    if T >= TILE:
        launch(attention_tiled_kernel, (n_heads, T), TILE, q, q_pos, kcache, vcache, kv_pos, int(n_keep),
               int(window), np.float32(q_scale), np.float32(scale), np.float32(softcap), out)
        return out
    threads = pow2_threads(max(D, min(kcache.shape[0], MAX_THREADS)), hi=MAX_THREADS)
    launch(attention_kernel, (n_heads, T), threads, q, q_pos, kcache, vcache, kv_pos, int(n_keep), int(window),
           np.float32(scale), np.float32(softcap), out)
    return out
