"""Causal (optionally sliding-window) attention over the f16 KV cache, one launch per layer.

Same arithmetic as minillm.kernels.cpu.ops.attention (ggml's CPU flash_attn_ext with F16 K/V):
Q rounded to f16, f32 scores, online softmax in f32, the running V sum rounded to f16 after
every update, keys visited in position order (as the CPU path: the order matters to the f16
sums; position p sits in slot p below n_keep, else in the ring after it). One thread block per (head, token); the keys are taken in chunks of blockDim.x:
  1. each thread scores one key of the chunk (masked keys score -inf) into shared memory;
  2. each thread owns some of the D dimensions and replays the online softmax over the chunk's
     scores in order, so every thread keeps the same max and sum without further syncs.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda

from .device import NEG_INF, f16_round, pow2_threads
from .launch import launch
from .registry import device, kernel

MAX_HEAD_DIM = 512
MAX_THREADS = 128

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


def attention(q, q_pos, kcache, vcache, kv_pos, n_keep: int, window: int, scale: float, softcap: float,
              n_heads: int, out):
    """Launch attention_kernel (device arrays, shapes as in its doc)."""
    if softcap:  # as ggml: the scale divided by the cap, the capped score multiplied by it
        scale = np.float32(np.float32(scale) / np.float32(softcap))
    T = q.shape[0]
    D = kcache.shape[2]
    if D > MAX_HEAD_DIM or n_heads % kcache.shape[1]:
        raise ValueError(f"unsupported heads: {n_heads} query heads, {kcache.shape[1]} KV heads of {D}")
    threads = pow2_threads(max(D, min(kcache.shape[0], MAX_THREADS)), hi=MAX_THREADS)
    launch(attention_kernel, (n_heads, T), threads, q, q_pos, kcache, vcache, kv_pos, int(n_keep), int(window),
           np.float32(scale), np.float32(softcap), out)
    return out
