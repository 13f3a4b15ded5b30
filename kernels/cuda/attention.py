"""Causal (optionally sliding-window) attention over the f16 KV cache, one launch per layer,
with the arithmetic of minillm.kernels.cpu.attention (ggml's CPU flash_attn_ext with F16 K/V),
whose path depends on the batch:

- fewer than TILE query rows (attention_runs_kernel): ggml's one chunk.
  Q rounded to f16, f32 scores, online softmax in f32, the running V sum rounded to f16 after
  every update, keys visited in position order (the order matters to the f16 sums; position p
  sits in slot p below n_keep, else in the ring after it). A lone query over SPLIT_MIN_CELLS
  cells or more takes ggml's split path (flash-decoding): its cells cut into runs, each run one
  chunk in a thread block of its own, the runs merged in order. The CPU cuts one run per thread;
  a GPU takes enough runs to fill its multiprocessors (split_parts), so that a long context uses
  the whole GPU, and the last block of a head to finish merges its runs, in the same launch.
  The batching scheduler's rows (attention_rows) each take this path as a lone query, their
  cells read through block tables.
- TILE query rows or more (attention_tiled_kernel): ggml's tiled path. Q in f32, each score one
  fma chain over the head's values, cells in tiles of TILE with one softmax maximum per tile,
  exp by ggml_v_expf (v_expf), the tile's sum of exps in double over SIMD-width hsums, the V
  sum an fma chain per value in f32. The CPU walks a tile of 64 query rows against each cell
  tile; a row's results do not depend on the other rows, so here one thread block takes one
  (head, token) and walks the cell tiles it sees.
"""
from __future__ import annotations

import functools
import math

import numpy as np
from numba import cuda

from ..cpu.ops import (_EXP_C1, _EXP_C2, _EXP_C3, _EXP_C4, _EXP_C5, _EXP_ROUND, _LN2_HI, _LN2_LO, _LOG2E,
                       GGML_AVX512)
from ..cpu.matmul import KIND_Q8_0, KIND_Q8_1  # plain constants: no CPU kernel is compiled
from ..cpu.ops import THREADS as CPU_SPLIT_PARTS  # the CPU's split path: a run per thread
from .device import NEG_INF, SIMULATOR, f16_round, fma32, pow2_threads
from .launch import launch
from .norm_quant import QUANT_OUT_SIG, QActivations, quantize_group32
from .registry import device, kernel

MAX_HEAD_DIM = 512
MAX_THREADS = 128
MAX_SPLIT = 32  # the most runs a lone query's cells are cut into on a GPU
TILE = 64   # the CPU's Q_TILE and KV_TILE: from this many query rows, cells in tiles of this many
SIMD_WIDTH = 16 if GGML_AVX512 else 8  # the lanes of ggml's softmax sums (the host CPU's build)

# the split path (one query over this many padded cells or more, cut into runs), as the CPU's
SPLIT_MIN_CELLS = 512
KV_PAD = 256  # llama.cpp's cells handed to attention: a multiple of this

_RUNS_SIG = ("void(float32[:, ::1], int64[::1], int64[::1], int64[:, ::1], int64, int64, float16[:, :, ::1], "
             "float16[:, :, ::1], int64[::1], int64, int64, float32, float32, boolean, "
             "float32[:, :, :, ::1], float32[:, :, ::1], float32[:, :, ::1], int32[:, ::1], float32[:, ::1], "
             f"int64, {QUANT_OUT_SIG})")
NOT_QUANTIZED = -1  # attention_runs_kernel's kind when the product after it quantizes the output itself


@device
def _slot(cell, n_keep, n_slots):
    """The slot that holds position `cell` (if the ring still has it)."""
    if cell < n_slots:
        return cell
    return n_keep + (cell - n_keep) % (n_slots - n_keep)


@device
def _row(slot, row_seq, tables, shift, t):
    """The cache row of row t's slot: the slot itself in a sequence's own cache (row_seq empty,
    or shift < 0), else through t's sequence's block table of blocks of 2^shift rows (-1: no
    block)."""
    if row_seq.shape[0] == 0 or shift < 0:
        return slot
    block = tables[row_seq[t], slot >> shift]
    if block < 0:
        return -1
    return (block << shift) | (slot & ((1 << shift) - 1))


@device
def _run_cells(pos, part, parts):
    """Cells [first, last) of run `part` of the `parts` equal runs that a query at pos's padded
    cells are cut into (as the CPU's)."""
    n_cells = (pos + KV_PAD) // KV_PAD * KV_PAD
    run = (n_cells + parts - 1) // parts
    return part * run, min((part + 1) * run, n_cells)


@kernel(_RUNS_SIG)
def attention_runs_kernel(q, q_pos, row_seq, tables, shift, n_slots, kcache, vcache, kv_pos, n_keep, window, scale,
                          softcap, split, acc, m_out, s_out, done, out, kind, words, d16, s16, d32, s32):
    """ggml's one chunk over one run of row t's cells, for head h, then (by the last of the P
    blocks of (t, h) to finish) the runs merged into out (_merge_runs): grid (T, H, P), block (n,)
    with n <= MAX_THREADS; (t, h, part) = blockIdx (rows on x, which has room for any batch).
    Row t at position q_pos[t] sees the cells of its own cache (row_seq empty: the cache's
    n_slots slots are its rows) or of its sequence row_seq[t] in a shared pool (each slot's row
    through tables[seq], blocks of 2^shift rows).
    With `split`, a row over SPLIT_MIN_CELLS padded cells or more is cut into P runs (one per
    blockIdx.z), else (and without split) run 0 takes every cell and the others are empty.
    q (T, H*D) float32; kcache/vcache (rows, Hkv, D) float16; kv_pos (rows,) the position each
    row holds (-1: none); window 0: unlimited, else a key at p is visible from i when
    0 <= i - p < window; softcap (0: none): scores capped at softcap * tanh(score / softcap),
    scale already divided. Each run's results: acc (T, H, >= P, D) its unnormalized V sum (f16
    values), m_out and s_out (T, H, >= P) its running max and sum (s 0: an empty run), padded so
    that no cache line holds two (t, h)'s results (_run_results). done (T, H)
    int32: zeros, counting (t, h)'s finished blocks during the launch and zero again after it.
    out (T, H*D): the merged rows; unless kind is NOT_QUANTIZED, also quantized for kind (Q8_0
    or Q8_1, a head being whole 32-groups: norm_quant's layout) into words, d16, s16, d32, s32.

    The run's keys are taken in chunks of blockDim.x, in position order (the order matters to
    the f16 sums): each thread scores one key of the chunk into shared memory, then each thread,
    owning some of the D dimensions, replays the online softmax over the chunk's scores in order,
    so that every thread keeps the same max and sum without further syncs."""
    q_sh = cuda.shared.array(MAX_HEAD_DIM, np.float32)     # (D,) the query, f16-rounded
    acc_sh = cuda.shared.array(MAX_HEAD_DIM, np.float32)   # (D,) running V sum (f16 values)
    score_sh = cuda.shared.array(MAX_THREADS, np.float32)  # (chunk,) scores of the chunk's keys
    row_sh = cuda.shared.array(MAX_THREADS, np.int64)      # (chunk,) their cache rows
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    part = cuda.blockIdx.z
    tid = cuda.threadIdx.x
    chunk = cuda.blockDim.x
    n_kv_heads = kcache.shape[1]
    D = kcache.shape[2]
    kvh = h // (cuda.gridDim.y // n_kv_heads)
    pos = q_pos[t]
    parts = cuda.gridDim.z if split and _run_cells(pos, 0, 1)[1] >= SPLIT_MIN_CELLS else 1
    first, last = _run_cells(pos, part, parts) if part < parts else (0, 0)
    first = max(first, max(0, pos - window + 1) if window > 0 else 0)
    last = min(last, pos + 1)
    # a cache that wrapped its ring has forgotten cells [n_keep, ring_start): nothing to visit
    newest = pos if row_seq.shape[0] else q_pos[q_pos.shape[0] - 1]
    ring_start = max(n_keep, newest + 1 - (n_slots - n_keep))
    for d in range(tid, D, chunk):
        q_sh[d] = f16_round(q[t, h * D + d])
        acc_sh[d] = np.float32(0.0)
    cuda.syncthreads()
    m = NEG_INF
    s_sum = np.float32(0.0)
    c0 = first
    while c0 < last:
        if n_keep <= c0 < ring_start:  # (uniform across the block: every thread skips alike)
            c0 = min(ring_start, last)
            continue
        score = NEG_INF
        row = -1
        cell = c0 + tid
        if cell < last and not (n_keep <= cell < ring_start):
            row = _row(_slot(cell, n_keep, n_slots), row_seq, tables, shift, t)
            if row >= 0 and kv_pos[row] == cell:
                dot = np.float32(0.0)
                for d in range(D):
                    dot += q_sh[d] * np.float32(kcache[row, kvh, d])
                score = dot * scale
                if softcap != 0:
                    score = softcap * np.float32(math.tanh(score))
        score_sh[tid] = score
        row_sh[tid] = row
        cuda.syncthreads()
        for i in range(min(chunk, last - c0)):
            sc = score_sh[i]
            if sc == NEG_INF:
                continue
            row = row_sh[i]
            if sc > m:
                ms = np.float32(math.exp(m - sc)) if m > NEG_INF else np.float32(0.0)
                m = sc
                for d in range(tid, D, chunk):
                    rescaled = f16_round(acc_sh[d] * ms)
                    acc_sh[d] = f16_round(rescaled + np.float32(vcache[row, kvh, d]))
                s_sum = fma32(s_sum, ms, np.float32(1.0))
            else:
                vs = np.float32(math.exp(sc - m))
                for d in range(tid, D, chunk):
                    acc_sh[d] = f16_round(fma32(np.float32(vcache[row, kvh, d]), vs, acc_sh[d]))
                s_sum = s_sum + vs
        cuda.syncthreads()  # score_sh is refilled by the next chunk
        c0 += chunk
    for d in range(tid, D, chunk):
        acc[t, h, part, d] = acc_sh[d]
    if tid == 0:
        m_out[t, h, part] = m
        s_out[t, h, part] = s_sum
    _merge_if_last(acc, m_out, s_out, done, out, kind, words, d16, s16, d32, s32, h, t)


@device
def _merge_if_last(acc, m, s_sum, done, out, kind, words, d16, s16, d32, s32, h, t):
    """The block that finishes (t, h)'s runs last merges them into out (and quantizes it): each
    block makes its results visible device-wide (a fence before its count), then counts itself
    in done[t, h]; the one that counts last fences again before it reads every run's (the
    acquire side of the count, as the PTX memory model asks), and sets the count back to zero
    for the next launch. (t, h)'s results share no 128-byte line with other heads' or rows', so
    no block reads them before they are all written."""
    last_sh = cuda.shared.array(1, np.int32)
    cuda.threadfence()
    cuda.syncthreads()
    if cuda.threadIdx.x == 0:
        last_sh[0] = cuda.atomic.add(done, (t, h), 1) == cuda.gridDim.z - 1
    cuda.syncthreads()
    if last_sh[0] == 0:
        return
    cuda.threadfence()
    if cuda.threadIdx.x == 0:
        done[t, h] = 0
    _merge_runs(acc, m, s_sum, out, h, t)
    if kind != NOT_QUANTIZED:
        cuda.syncthreads()  # the head's values, written by all threads, are read by group owners
        groups = acc.shape[3] // 32  # (D // 32)
        for g in range(cuda.threadIdx.x, groups, cuda.blockDim.x):
            quantize_group32(out, t, h * groups + g, kind, words, d16, s16, d32, s32)


@device
def _merge_runs(acc, m, s_sum, out, h, t):
    """out[t, h*D:(h+1)*D] from the P = gridDim.z runs (acc (T, H, >= P, D), m and s_sum
    (T, H, >= P)), merged in order as ggml_flash_attn_ext_reduce_partials (empty runs left
    out). A row of one run comes out as ggml's one chunk normalizes it: fma(0, 0, acc * 1) is
    acc. Threads over D."""
    for d in range(cuda.threadIdx.x, acc.shape[3], cuda.blockDim.x):
        total = np.float32(0.0)
        m_all = NEG_INF
        s_all = np.float32(0.0)
        for part in range(cuda.gridDim.z):
            if s_sum[t, h, part] == 0:
                continue
            m_new = max(m_all, m[t, h, part])
            scale_old = np.float32(math.exp(m_all - m_new))
            scale_new = np.float32(math.exp(m[t, h, part] - m_new))
            total = fma32(total, scale_old, acc[t, h, part, d] * scale_new)
            s_all = fma32(s_all, scale_old, s_sum[t, h, part] * scale_new)
            m_all = m_new
        out[t, h * acc.shape[3] + d] = total * (np.float32(1.0) / s_all) if s_all != 0 else np.float32(0.0)


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
    """The tiled path (module doc) for row t = blockIdx.x of q (T, H*D) (times q_scale, as the CPU
    layer scales q) and head h = blockIdx.y; other arguments as attention_runs_kernel's. Block (TILE,):
    thread i scores cell c0 + i of each tile, then sums values i, i + TILE, ... of the head."""
    q_sh = cuda.shared.array(MAX_HEAD_DIM, np.float32)   # (D,) the query
    acc_sh = cuda.shared.array(MAX_HEAD_DIM, np.float32)  # (D,) the unnormalized V sum
    p_sh = cuda.shared.array(TILE, np.float32)           # (TILE,) the tile's scores, then exps
    slot_sh = cuda.shared.array(TILE, np.int64)          # (TILE,) each cell's slot, -1 if not held
    t = cuda.blockIdx.x
    h = cuda.blockIdx.y
    tid = cuda.threadIdx.x
    n_kv_heads = kcache.shape[1]
    D = kcache.shape[2]
    kvh = h // (cuda.gridDim.y // n_kv_heads)
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


@functools.cache
def split_parts(n_heads: int) -> int:
    """The runs a lone query's cells are cut into from SPLIT_MIN_CELLS on (flash-decoding): on a
    GPU enough (head, run) blocks to fill its multiprocessors twice, at most MAX_SPLIT; under
    the simulator the CPU's count, so that the tests compare the two paths' arithmetic."""
    if SIMULATOR:
        return CPU_SPLIT_PARTS
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    return max(1, min(MAX_SPLIT, -(-2 * sms // n_heads)))


@functools.cache
def _own_cache():
    """row_seq and tables of a sequence's own cache (no paging): empty device arrays."""
    return cuda.to_device(np.zeros(0, np.int64)), cuda.to_device(np.zeros((1, 1), np.int64))


def _check_heads(kcache, n_heads: int) -> None:
    if kcache.shape[2] > MAX_HEAD_DIM or n_heads % kcache.shape[1]:
        raise ValueError(f"unsupported heads: {n_heads} query heads, {kcache.shape[1]} KV heads of {kcache.shape[2]}")


def _capped_scale(scale: float, softcap: float) -> np.float32:
    """As ggml: with soft-capping, the scale divided by the cap (the capped score is multiplied by it)."""
    return np.float32(np.float32(scale) / np.float32(softcap)) if softcap else np.float32(scale)


def quantizes_output(T: int, head_dim: int, kind: int, rows: bool = False) -> bool:
    """Whether attention (attention_rows where rows) of T query rows can quantize its output for
    activation kind in its own launch (`act`): on the one-chunk path, for the 32-group kinds,
    when a head's values are whole groups."""
    return (rows or T < TILE) and kind in (KIND_Q8_0, KIND_Q8_1) and head_dim % 32 == 0


def attention(q, q_pos, kcache, vcache, kv_pos, n_keep: int, window: int, scale: float, softcap: float,
              n_heads: int, out, q_scale: float = 1.0, take=None, act: QActivations | None = None):
    """Launch the path ggml takes for T = q.shape[0] rows of q times q_scale over a sequence's own
    cache (module doc; device arrays, shapes as in attention_runs_kernel's doc): the tiled path
    scales q as the CPU's layer does; the one-chunk path, which rounds q to f16, takes q_scale
    into the scores' scale (exact for a power of two, see layers.rope_attend). A lone query takes
    the split path. take(shape): device float32 scratch (default: new arrays). act: out's
    quantization, made in the same launch (where quantizes_output)."""
    T = q.shape[0]
    _check_heads(kcache, n_heads)
    if act is not None and not quantizes_output(T, kcache.shape[2], act.kind):
        raise ValueError(f"attention of {T} rows cannot quantize its output for kind {act.kind}")
    if T >= TILE:
        launch(attention_tiled_kernel, (T, n_heads), TILE, q, q_pos, kcache, vcache, kv_pos, int(n_keep),
               int(window), np.float32(q_scale), _capped_scale(scale, softcap), np.float32(softcap), out)
        return out
    row_seq, tables = _own_cache()
    return _runs(q, q_pos, row_seq, tables, 0, kcache.shape[0], kcache, vcache, kv_pos, n_keep, window,
                 np.float32(scale) * np.float32(q_scale), softcap, n_heads, out, T == 1, take, act)


def attention_rows(q, q_pos, row_seq, tables, shift: int, n_slots: int, kcache, vcache, kv_pos, window: int,
                   scale: float, softcap: float, n_heads: int, out, q_scale: float = 1.0, take=None, n_keep: int = 0,
                   act: QActivations | None = None):
    """Each row t of q over the cells of its sequence row_seq[t] in a shared pool (block tables
    (n_seq, blocks) of 2^shift rows, n_slots slots a sequence sees), exactly as `attention`
    computes a lone query at its position q_pos[t], whatever the other rows (the batching
    scheduler's rows). shift < 0: one sequence's own cache, each row alone (speculative
    verification). act: as attention's."""
    _check_heads(kcache, n_heads)
    if act is not None and not quantizes_output(q.shape[0], kcache.shape[2], act.kind, rows=True):
        raise ValueError(f"attention rows cannot quantize their output for kind {act.kind}")
    return _runs(q, q_pos, row_seq, tables, shift, n_slots, kcache, vcache, kv_pos, n_keep, window,
                 np.float32(scale) * np.float32(q_scale), softcap, n_heads, out, True, take, act)


@functools.cache
def _unread_activations() -> QActivations:
    """attention_runs_kernel's quantization arguments when it quantizes nothing."""
    return QActivations.empty(1, 32, KIND_Q8_0)


LINE_FLOATS = 32  # a 128-byte cache line


def _run_results(T: int, n_heads: int, parts: int, D: int, take):
    """acc (T, H, P', D), m and s_sum (T, H, P'') for attention_runs_kernel's P runs: P' and P''
    the least counts from P on that make each (t, h)'s results whole cache lines (buffers start
    on a line)."""
    acc_parts = next(p for p in range(parts, parts + LINE_FLOATS) if p * D % LINE_FLOATS == 0)
    scalar_parts = -(-parts // LINE_FLOATS) * LINE_FLOATS
    return take((T, n_heads, acc_parts, D)), take((T, n_heads, scalar_parts)), take((T, n_heads, scalar_parts))


def _finished_runs(T: int, n_heads: int):
    """attention_runs_kernel's `done` counts for T rows: zeros that every launch leaves zero,
    the first T rows of an array kept for the process (one per power of two of rows: the
    recorded steps replay launches that read it)."""
    return _zero_counts(1 << max(0, T - 1).bit_length(), n_heads)[:T]


@functools.cache
def _zero_counts(rows: int, n_heads: int):
    return cuda.to_device(np.zeros((rows, n_heads), np.int32))


def _runs(q, q_pos, row_seq, tables, shift, n_slots, kcache, vcache, kv_pos, n_keep, window, scale, softcap, n_heads,
          out, split: bool, take, act):
    """attention_runs_kernel over split_parts runs (one without split), merged into out
    (quantized into act, where given) in the same launch."""
    T, D = q.shape[0], kcache.shape[2]
    parts = split_parts(n_heads) if split else 1
    take = take or (lambda shape: cuda.device_array(shape, np.float32))
    acc, m, s_sum = _run_results(T, n_heads, parts, D, take)
    threads = pow2_threads(max(D, min(n_slots, MAX_THREADS)), hi=MAX_THREADS)  # chunks of keys
    kind, quantized = (act.kind, act) if act is not None else (NOT_QUANTIZED, _unread_activations())
    launch(attention_runs_kernel, (T, n_heads, parts), threads, q, q_pos, row_seq, tables, int(shift), int(n_slots),
           kcache, vcache, kv_pos, int(n_keep), int(window), _capped_scale(scale, softcap), np.float32(softcap),
           bool(split), acc, m, s_sum, _finished_runs(T, n_heads), out, kind,
           quantized.words, quantized.d16, quantized.s16, quantized.d32, quantized.s32)
    return out
