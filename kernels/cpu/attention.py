"""Attention over the KV cache, computed the way ggml's CPU flash_attn_ext computes it with an
F16 K/V cache. ggml takes one of three paths, and each rounds differently:

    tiled      a batch of >= 64 query tokens: Q stays f32, scores and the V sum are f32, cells
               are visited in tiles of 64 with one softmax maximum per tile, exp by ggml_v_expf
    split      one query token over >= 512 cells: the cells are cut into n_threads equal runs,
               each done as "one chunk", then the runs are merged
    one chunk  everything else: Q rounded to f16, online softmax cell by cell, V summed in f16

Cells are positions: llama.cpp (its sliding-window cache as large as the context, its default)
keeps position p in cell p and hands attention cells [0, n_cells), n_cells the positions so far
padded to a multiple of KV_PAD, the empty ones masked; tiles and thread runs are cut by cell.
Our rings keep fewer slots, so cell c is read from its slot (`_slot`) when the ring still holds
it, and is masked otherwise (a forgotten position is outside any window that could see it).

Shapes: q (T, H*D) float32; kcache/vcache (S, Hkv, D) uint16, float16 bit patterns; kv_pos (S,)
the logical position of each slot (-1: empty); slots [0, n_keep) hold the first positions for
good, the others a ring (minillm/kv_cache.py).
A key at position p is visible from a query at position i when p <= i and, with a window w > 0,
i - p < w.
"""
import math

import numba as nb
import numpy as np

from .f16 import f16_round, f16_round_finite, f16_value
from .fma import fma
from .head_walk import expf_exact, heads_walk_f16, walk_fits
from .ops import GGML_AVX512, THREADS
from .simd import (dot_f16_32, dot_f16_64, exp_sum_rows, exp_sum_rows8, f16_mad_rows, f16_rescale_add_rows,
                   fma_chain_32, fma_chain_64, fma_chains_32x2, fma_chains_32x3, fma_chains_64x2, fma_chains_64x6,
                   scaled_masked_max, widen_f32)

Q_TILE = 64           # query rows per tile, and the batch size from which ggml tiles
KV_TILE = 64          # cells per tile
SPLIT_MIN_CELLS = 512  # one query over at least this many cells: split across threads
KV_PAD = 256          # llama.cpp's cells handed to attention: a multiple of this
# the split path cuts the cells in one run per thread, as llama.cpp with as many threads as cores
SPLIT_PARTS = THREADS

# ggml's f16 dot product (the one-chunk scores) sums in 16-lane registers where it is built with
# AVX-512 and in 8-lane ones with AVX2, as its softmax does (target.GGML_AVX512).
F16_DOT_STEP = 64 if GGML_AVX512 else 32
# query rows the tiles' fma chains take at once: 24 accumulators of AVX-512's 32 registers, 12 of AVX2's 16
CHAIN_ROWS = 6 if GGML_AVX512 else 3
_EXP_SUM_ROWS = exp_sum_rows if GGML_AVX512 else exp_sum_rows8  # ggml_v_expf and its sums as ggml is built

_NO_TABLE = np.zeros(0, np.int64)  # the block table of a sequence's own (unpaged) cache
# _run_rows's callers pass its first cell and shift as np.int64 and an empty table of their own:
# a constant argument (a Literal type) or this read-only global would compile another copy of it

_PAR = dict(parallel=True, cache=True, nogil=True)
_SER = dict(cache=True, nogil=True)


@nb.njit(inline="always", cache=True, nogil=True)
def _slot(cell, n_keep, n_slots):
    """The slot that holds position `cell` (if the ring still has it)."""
    if cell < n_slots:  # the ring has not wrapped this far: no division
        return cell
    return n_keep + (cell - n_keep) % (n_slots - n_keep)


@nb.njit(inline="always", cache=True, nogil=True)
def _row(slot, table, shift):
    """The cache row that holds a slot: the slot itself in a sequence's own cache (shift < 0),
    else in block table[slot >> shift] of a shared pool of blocks of 2^shift rows."""
    if shift < 0:
        return slot
    return (table[slot >> shift] << shift) | (slot & ((1 << shift) - 1))


@nb.njit(inline="always", cache=True, nogil=True)
def _visible(cell, slot, kv_pos, pos, window):
    """Whether a query at position pos sees the key of position `cell`, held in `slot`."""
    return kv_pos[slot] == cell and cell <= pos and (window == 0 or pos - cell < window)


@nb.njit(inline="always", cache=True, nogil=True)
def _first_cell(pos, window):
    """No cell before this one is visible from positions >= pos."""
    return max(0, pos - window + 1) if window > 0 else 0


@nb.njit(inline="always", cache=True, nogil=True)
def _ring_start(newest, n_keep, n_slots):
    """The oldest position the ring still holds once `newest` is written: cells from n_keep up
    to it are forgotten (nothing to visit there; only a cache decoding past its size has any)."""
    return max(n_keep, newest + 1 - (n_slots - n_keep))


@nb.njit(inline="always", cache=True, nogil=True)
def _next_visible(cell, end, pos, window, n_keep, ring_start, n_slots, kv_pos, table, shift):
    """(the first cell from `cell` up to `end` that a query at pos sees, its cache row), or
    (end, -1) if none: the one-chunk walk, which skips what the ring has forgotten."""
    while cell < end:
        if n_keep <= cell < ring_start:  # forgotten: skip to the ring's oldest position
            cell = ring_start
            continue
        row = _row(_slot(cell, n_keep, n_slots), table, shift)
        if _visible(cell, row, kv_pos, pos, window):
            return cell, row
        cell += 1
    return end, -1


@nb.njit(inline="always", cache=True, nogil=True)
def _dot_f16(k, k_at, q, q_at, D):
    """ggml_vec_dot_f16 of D values of k from k_at and of q from q_at (flat arrays), as ggml is
    built for this CPU (F16_DOT_STEP): the SIMD steps in float32, the rest in double."""
    n_simd = D - D % F16_DOT_STEP
    if F16_DOT_STEP == 64:
        total = np.float64(dot_f16_64(k, k_at, q, q_at, n_simd))
    else:
        total = np.float64(dot_f16_32(k, k_at, q, q_at, n_simd))
    for i in range(n_simd, D):
        total += np.float64(f16_value(k[k_at + i]) * q[q_at + i])
    return np.float32(total)


@nb.njit(inline="always", cache=True, nogil=True)
def _rescale_add_f16(acc, acc_at, v, v_at, ms, D):
    """ggml_vec_scale_f16, then ggml_vec_mad_f16 with 1: acc = f16(v + f16(acc * ms)) over D
    values from acc_at and v_at (flat arrays)."""
    if D % 32 == 0:
        for d in range(0, D, 32):
            f16_rescale_add_rows(acc, acc_at + d, v, v_at + d, ms)
    else:
        for d in range(D):
            acc[acc_at + d] = f16_round_finite(f16_value(v[v_at + d]) + f16_round_finite(acc[acc_at + d] * ms))


@nb.njit(inline="always", cache=True, nogil=True)
def _mad_f16(acc, acc_at, v, v_at, vs, D):
    """ggml_vec_mad_f16: acc = f16(fma(v, vs, acc)), the sum kept in float16 (as above)."""
    if D % 32 == 0:
        for d in range(0, D, 32):
            f16_mad_rows(acc, acc_at + d, v, v_at + d, vs)
    else:
        for d in range(D):
            acc[acc_at + d] = f16_round_finite(fma(f16_value(v[v_at + d]), vs, acc[acc_at + d]))


@nb.njit(inline="always", cache=True, nogil=True)
def _capped(score, softcap):
    """Logit soft-capping (Gemma 2): softcap * tanh(score), the score already divided by
    softcap through the scale (see `attention`); softcap 0: none."""
    if softcap == 0:
        return score
    return softcap * np.float32(math.tanh(score))


@nb.njit(inline="always", cache=True, nogil=True)
def _visible_rows(first, end, pos, window, n_keep, ring_start, n_slots, kv_pos, table, shift, n_kv_heads, kvh):
    """row * n_kv_heads + kvh (KV head kvh's row in the cache seen as (P * Hkv, ...)) for the
    cache row of each cell in [first, end) that a query at pos sees, in cell order (the
    one-chunk walk's cells, looked up once for all its heads)."""
    at = np.empty(max(0, end - first), np.int64)
    n = 0
    cell, row = _next_visible(first, end, pos, window, n_keep, ring_start, n_slots, kv_pos, table, shift)
    while row >= 0:
        at[n] = row * n_kv_heads + kvh
        n += 1
        cell, row = _next_visible(cell + 1, end, pos, window, n_keep, ring_start, n_slots, kv_pos, table, shift)
    return at[:n]


@nb.njit(inline="always", cache=True, nogil=True)
def _head_walk(k, v, row_at, q, q_at, scale, softcap, acc, acc_at, D):
    """heads_walk_f16's steps in Numba code, for what _one_chunk does not give it (soft-capping,
    other head sizes than 64, 128 and 256): acc[acc_at:acc_at + D] the V sum; returns (M, S)."""
    acc[acc_at:acc_at + D] = 0
    m, s_sum = np.float32(-np.inf), np.float32(0.0)
    for at in row_at:
        score = _capped(_dot_f16(k, at, q, q_at, D) * scale, softcap)
        if score > m:
            ms = expf_exact(m - score)
            m = score
            _rescale_add_f16(acc, acc_at, v, at, ms, D)
            s_sum = fma(s_sum, ms, np.float32(1.0))
        else:
            vs = expf_exact(score - m)
            _mad_f16(acc, acc_at, v, at, vs, D)
            s_sum = s_sum + vs
    return m, s_sum


@nb.njit(inline="always", cache=True, nogil=True)
def _run_rows(first, last, pos, newest, n_keep, n_slots, kv_pos, table, shift, window, n_kv_heads):
    """row * n_kv_heads for the cache row of each cell in [first, last) that a query at pos sees
    (newest: the batch's last position), in cell order: a run's cells, found once for all its
    KV heads (KV head kvh's rows are these + kvh). The sequence's n_slots slots are rows of the
    cache, through its block table when paged (_row)."""
    return _visible_rows(max(first, _first_cell(pos, window)), min(last, pos + 1), pos, window, n_keep,
                         _ring_start(newest, n_keep, n_slots), n_slots, kv_pos, table, shift, n_kv_heads, 0)


@nb.njit(**_SER)
def _one_chunk(q16, rows, kvh, kcache, vcache, scale, softcap, acc, m, s_sum):
    """Online softmax over the cells whose rows of the caches seen as (P * Hkv, D) are rows + kvh
    (_run_rows; kvh the KV head), as ggml's one_chunk, for the G heads of q16 (G, D) (f16-rounded
    queries) that share that KV head. Head g's result: acc[g] (D,) the f16-rounded, unnormalized
    V sum, m[g] the running max, s_sum[g] the sum. Each head walks the cells as ggml does one
    head (heads_walk_f16). The caches and buffers are used through flat views by offset (the KV
    head's: from kvh * D): a view per cell (kcache[slot, kvh]) would cost two atomic reference
    counts, and rows + kvh an array a walk."""
    G, D = q16.shape
    P, H = kcache.shape[0], kcache.shape[1]
    k, v = kcache.reshape(P * H * D)[kvh * D:], vcache.reshape(P * H * D)[kvh * D:]
    q, a = q16.reshape(G * D), acc.reshape(G * D)
    if softcap == 0 and walk_fits(G, D):
        # the common head sizes, each as a constant: the walk's loops over D unroll (with D a
        # run-time value it was 1.4x slower); every copy costs compile time
        if D == 64:
            heads_walk_f16(k, v, rows, rows.shape[0], q, scale, a, m, s_sum, 64)
            return
        if D == 128:
            heads_walk_f16(k, v, rows, rows.shape[0], q, scale, a, m, s_sum, 128)
            return
        if D == 256:
            heads_walk_f16(k, v, rows, rows.shape[0], q, scale, a, m, s_sum, 256)
            return
    for g in range(G):
        m[g], s_sum[g] = _head_walk(k, v, rows * D, q, g * D, scale, softcap, a, g * D, D)


@nb.njit(inline="always", cache=True, nogil=True)
def _queries_f16(q, t, h0, G, D, q16):
    """The f16-rounded queries of heads h0..h0+G-1 of token t, into q16[:G] (G, D)."""
    for g in range(G):
        for d in range(D):
            q16[g, d] = f16_round(q[t, (h0 + g) * D + d])
    return q16[:G]


@nb.njit(inline="always", cache=True, nogil=True)
def _run_cells(pos, part, parts):
    """Cells [first, last) of run `part` of the `parts` equal runs that a query at pos's padded
    cells are cut into (parts 1: all of them)."""
    n_cells = (pos + KV_PAD) // KV_PAD * KV_PAD  # llama.cpp's cells: positions so far, padded
    run = (n_cells + parts - 1) // parts
    return part * run, min((part + 1) * run, n_cells)


@nb.njit(cache=True, nogil=True)
def head_jobs(units, q_pos, window, n_slots, n_heads, group, max_heads, n_jobs):
    """Share out the (unit, head) pairs, unit-major, as n_jobs contiguous runs of about equal
    work (a head of a unit costs the cells the unit visits): each thread gets one run, wherever
    it falls, so 9 heads make 4 + 5 rather than 3 jobs of 3 for 2 threads. Each run is cut into
    pieces within one KV head's group (a piece's heads share one walk over the cells) of at
    most max_heads heads. units (U, 3): (row t, run, runs); returns pieces (N, 3) of (unit,
    first head, heads) and starts (n_jobs + 1,): job j's pieces are pieces[starts[j]:starts[j + 1]]."""
    U = units.shape[0]
    cost = np.empty(U, np.float64)
    for u in range(U):
        pos = q_pos[units[u, 0]]
        first, last = _run_cells(pos, units[u, 1], units[u, 2])
        cells = min(last, pos + 1) - max(first, _first_cell(pos, window))
        cost[u] = min(max(cells, 0), n_slots) + 16.0  # + a piece's own steps
    share = cost.sum() * n_heads / n_jobs
    bounds = np.empty(n_jobs + 1, np.int64)  # each job's first (unit, head) pair
    bounds[0], j, done = 0, 1, 0.0
    for i in range(U * n_heads):
        c = cost[i // n_heads]
        while j < n_jobs and done + c / 2 >= share * j:
            bounds[j] = i
            j += 1
        done += c
    bounds[j:] = U * n_heads
    pieces = np.empty((U * n_heads, 3), np.int64)
    starts = np.empty(n_jobs + 1, np.int64)
    n = 0
    for job in range(n_jobs):
        starts[job] = n
        i = bounds[job]
        while i < bounds[job + 1]:
            u, h = i // n_heads, i % n_heads
            end = min(bounds[job + 1], u * n_heads + (h // group + 1) * group, i + max_heads)
            pieces[n, 0], pieces[n, 1], pieces[n, 2] = u, h, end - i
            n += 1
            i = end
    starts[n_jobs] = n
    return pieces, starts


@nb.njit(cache=True, nogil=True)
def whole_rows(T):
    """head_jobs' units for T rows of one run each (a function of its own: in a parallel
    function, array expressions become parallel loops of their own)."""
    units = np.zeros((T, 3), np.int64)
    for t in range(T):
        units[t, 0], units[t, 2] = t, 1
    return units


@nb.njit(inline="always", cache=True, nogil=True)
def walk_heads(group, D):
    """The most heads of a group one walk takes."""
    G = group
    while G > 1 and not walk_fits(G, D):
        G -= 1
    return G


@nb.njit(**_PAR)
def _unit_runs(q, q_pos, units, row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos, window, scale,
               softcap, n_heads, acc, m, s_sum):
    """The one-chunk passes of units (U, 3) (row t, run, runs: t's cells cut into that many
    runs): acc (T, P, H, D), m and s_sum (T, P, H). Rows read their sequence's cells through
    tables[row_seq[t]], or (row_seq empty) the cache's own slots, as one batch."""
    D = kcache.shape[2]
    group = n_heads // kcache.shape[1]
    G_most = walk_heads(group, D)
    pieces, starts = head_jobs(units, q_pos, window, n_slots, n_heads, group, G_most, SPLIT_PARTS)
    own = row_seq.shape[0] == 0
    no_table = np.zeros(0, np.int64)
    for job in nb.prange(SPLIT_PARTS):
        unit_rows, rows_of = no_table, -1  # the run's cell rows (KV head 0), found for unit rows_of
        q16 = np.empty((G_most, D), np.float32)  # a piece's queries and results, G <= G_most heads
        acc_j = np.empty((G_most, D), np.float32)
        m_j = np.empty(G_most, np.float32)
        s_j = np.empty(G_most, np.float32)
        for p in range(starts[job], starts[job + 1]):
            u, h0, G = pieces[p, 0], pieces[p, 1], pieces[p, 2]
            t, part = units[u, 0], units[u, 1]
            pos = q_pos[t]
            first, last = _run_cells(pos, part, units[u, 2])
            if first >= last:
                s_sum[t, part, h0:h0 + G] = 0
                continue
            if u != rows_of:  # a job's pieces are unit-major: a unit's KV heads share its cells
                table = no_table if own else tables[row_seq[t]]
                unit_rows = _run_rows(first, last, pos, q_pos[-1] if own else pos, n_keep, n_slots, kv_pos, table,
                                      np.int64(-1) if own else shift, window, kcache.shape[1])
                rows_of = u
            _one_chunk(_queries_f16(q, t, h0, G, D, q16), unit_rows, h0 // group, kcache, vcache, scale, softcap,
                       acc_j[:G], m_j[:G], s_j[:G])
            acc[t, part, h0:h0 + G] = acc_j[:G]
            m[t, part, h0:h0 + G] = m_j[:G]
            s_sum[t, part, h0:h0 + G] = s_j[:G]


@nb.njit(**_SER)
def _attend_rows(q, q_pos, row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos, window, scale, softcap,
                 n_heads, split, out):
    """out (T, H*D) for fewer than Q_TILE rows, each one chunk over its cells; with `split`, a
    row over at least SPLIT_MIN_CELLS cells is cut into SPLIT_PARTS runs, merged in order (the
    split path of a lone query)."""
    T, D = q.shape[0], kcache.shape[2]
    acc = np.empty((T, SPLIT_PARTS, n_heads, D), np.float32)
    m = np.empty((T, SPLIT_PARTS, n_heads), np.float32)
    s_sum = np.empty((T, SPLIT_PARTS, n_heads), np.float32)
    units = np.empty((T * SPLIT_PARTS, 3), np.int64)  # (row, run, runs): only the runs a row has
    n_units = 0
    for t in range(T):
        parts = SPLIT_PARTS if split and _run_cells(q_pos[t], 0, 1)[1] >= SPLIT_MIN_CELLS else 1
        for part in range(parts):
            units[n_units, 0], units[n_units, 1], units[n_units, 2] = t, part, parts
            n_units += 1
    _unit_runs(q, q_pos, units[:n_units], row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos, window,
               scale, softcap, n_heads, acc, m, s_sum)
    u = 0
    for t in range(T):
        parts = units[u, 2]
        u += parts
        if parts > 1:
            _merge_runs(acc[t], m[t], s_sum[t], parts, out, t)
            continue
        for h in range(n_heads):  # one chunk: normalized as ggml's one_chunk
            inv = np.float32(1.0) / s_sum[t, 0, h] if s_sum[t, 0, h] != 0 else np.float32(0.0)
            for d in range(D):
                out[t, h * D + d] = acc[t, 0, h, d] * inv


@nb.njit(inline="always", cache=True, nogil=True)
def _merge_runs(acc, m, s_sum, n_parts, out, t):
    """out[t] from the first n_parts runs' results (acc (P, H, D), m and s_sum (P, H)), merged in
    order as ggml_flash_attn_ext_reduce_partials (the compiler fuses the first product of each sum)."""
    H, D = acc.shape[1], acc.shape[2]
    total = np.empty(D, np.float32)
    for h in range(H):
        total[:] = 0
        m_all = np.float32(-np.inf)
        s_all = np.float32(0.0)
        for part in range(n_parts):
            if s_sum[part, h] == 0:
                continue
            m_new = max(m_all, m[part, h])
            scale_old = np.float32(math.exp(m_all - m_new))
            scale_new = np.float32(math.exp(m[part, h] - m_new))
            for d in range(D):
                total[d] = fma(total[d], scale_old, acc[part, h, d] * scale_new)
            s_all = fma(s_all, scale_old, s_sum[part, h] * scale_new)
            m_all = m_new
        inv = np.float32(1.0) / s_all if s_all != 0 else np.float32(1.0)
        for d in range(D):
            out[t, h * D + d] = total[d] * inv


@nb.njit(inline="always", cache=True, nogil=True)
def _reduce16(x, at):
    """_mm512_reduce_add_ps of x[at:at+16]: lanes i + i+8, then i + i+4, then (0+2) + (1+3)."""
    a0 = (x[at] + x[at + 8]) + (x[at + 4] + x[at + 12])
    a1 = (x[at + 1] + x[at + 9]) + (x[at + 5] + x[at + 13])
    a2 = (x[at + 2] + x[at + 10]) + (x[at + 6] + x[at + 14])
    a3 = (x[at + 3] + x[at + 11]) + (x[at + 7] + x[at + 15])
    return (a0 + a2) + (a1 + a3)


@nb.njit(inline="always", cache=True, nogil=True)
def _reduce8(x, at):
    """ggml's AVX2 sum of x[at:at+8]: the 128-bit halves added (i + i+4), then (0+2) + (1+3)."""
    a0, a1 = x[at] + x[at + 4], x[at + 1] + x[at + 5]
    a2, a3 = x[at + 2] + x[at + 6], x[at + 3] + x[at + 7]
    return (a0 + a2) + (a1 + a3)


@nb.njit(inline="always", cache=True, nogil=True)
def _tiled_job(job, n_jobs, n_kv_heads):
    """(KV head, first query row) of a tiled-attention job. A query tile's work grows with its
    position (causal: tile i reads i + 1 KV tiles), and prange hands each thread one contiguous
    run of jobs; so jobs alternate from the light and the heavy end of the tiles, and every
    run of an even length holds pairs of equal total work."""
    rank = job // 2 if job % 2 == 0 else n_jobs - 1 - job // 2  # in order of work
    return rank % n_kv_heads, rank // n_kv_heads * Q_TILE


@nb.njit(**_PAR)
def _attend_tiled(q, q_pos, kcache, vcache, kv_pos, n_keep, n_cells, window, scale, softcap, n_heads, out):
    """ggml_compute_forward_flash_attn_ext_tiled: per head, 64 query rows against 64-cell tiles.
    The heads that share a KV head share each tile's copy of K and V and its mask."""
    T = q.shape[0]
    D = kcache.shape[2]
    group = n_heads // kcache.shape[1]
    n_qt = (T + Q_TILE - 1) // Q_TILE
    n_jobs = kcache.shape[1] * n_qt
    for job in nb.prange(n_jobs):
        kvh, t0 = _tiled_job(job, n_jobs, kcache.shape[1])
        rows = min(Q_TILE, T - t0)
        vkq = np.zeros((group, Q_TILE, D), np.float32)  # per head: unnormalized output rows
        s_sum = np.zeros((group, Q_TILE), np.float32)
        m = np.full((group, Q_TILE), -np.inf, np.float32)
        kt = np.zeros((D, KV_TILE), np.float32)      # the tile's keys, transposed
        vt = np.zeros((KV_TILE, D), np.float32)
        kq = np.empty((Q_TILE, KV_TILE), np.float32)  # scores, then probabilities
        bias = np.empty((Q_TILE, KV_TILE), np.float32)  # the mask: 0 where a row sees a cell, else -inf
        slots = np.empty(KV_TILE, np.int64)         # the tile's cells' slots
        cached = np.empty(KV_TILE, np.bool_)         # whether the ring still holds each cell
        # tiles wholly before the first visible cell or after the last query are masked: skipped
        c_first = _first_cell(q_pos[t0], window) // KV_TILE * KV_TILE
        ring_start = _ring_start(q_pos[T - 1], n_keep, kcache.shape[0])
        for c0 in range(c_first, min(n_cells, q_pos[t0 + rows - 1] + 1), KV_TILE):
            if c0 >= n_keep and c0 + KV_TILE <= ring_start:  # a tile of forgotten cells
                continue
            for tk in range(KV_TILE):
                slots[tk] = _slot(c0 + tk, n_keep, kcache.shape[0])
                cached[tk] = kv_pos[slots[tk]] == c0 + tk
            if _tile_mask(q_pos, t0, rows, c0, cached, window, bias) == 0:
                continue
            _tile_kv(kcache, vcache, slots, cached, kvh, kt, vt)
            for hh in range(group):
                _tile_head(q, t0, rows, kvh * group + hh, kt, vt, kq, bias, scale, softcap, m[hh], s_sum[hh], vkq[hh])
        for hh in range(group):
            h = kvh * group + hh
            for tq in range(rows):
                inv = np.float32(1.0) / s_sum[hh, tq] if s_sum[hh, tq] != 0 else np.float32(0.0)
                for d in range(D):
                    out[t0 + tq, h * D + d] = vkq[hh, tq, d] * inv


@nb.njit(inline="always", cache=True, nogil=True)
def _tile_mask(q_pos, t0, rows, c0, cached, window, bias):
    """bias[tq, tk]: 0 where query row t0 + tq sees cell c0 + tk (_visible, the cache lookups
    done once a tile in `cached`), else -inf. Returns how many it sees."""
    n_seen = 0
    for tq in range(rows):
        pos = q_pos[t0 + tq]
        lo = _first_cell(pos, window)
        for tk in range(KV_TILE):
            seen = cached[tk] and c0 + tk >= lo and c0 + tk <= pos
            bias[tq, tk] = np.float32(0.0) if seen else np.float32(-np.inf)
            n_seen += seen
    return n_seen


@nb.njit(inline="always", cache=True, nogil=True)
def _tile_kv(kcache, vcache, slots, cached, kvh, kt, vt):
    """A tile's keys (kt (D, KV_TILE), transposed) and values (vt (KV_TILE, D)) as float32, from
    the cells the ring holds; 0 for the others."""
    D = kcache.shape[2]
    for tk in range(KV_TILE):
        if not cached[tk]:
            kt[:, tk] = 0
            vt[tk] = 0
            continue
        at = (slots[tk] * kcache.shape[1] + kvh) * D
        if D % 16 == 0:
            widen_f32(vcache, at, vt, tk * D, D // 16)
        else:
            for d in range(D):
                vt[tk, d] = f16_value(vcache[slots[tk], kvh, d])
        for d in range(D):
            kt[d, tk] = f16_value(kcache[slots[tk], kvh, d])


@nb.njit(inline="always", cache=True, nogil=True)
def _tile_head(q, t0, rows, h, kt, vt, kq, bias, scale, softcap, m, s_sum, vkq):
    """One head's step over one tile: scores, online softmax, the V sum (vkq (Q_TILE, D))."""
    D = kt.shape[0]
    _tile_scores(q, t0, rows, h, kt, kq)
    for tq in range(rows):
        _tile_softmax(kq, bias, tq, scale, softcap, m, s_sum, vkq)
    if D % 64 == 0:  # vkq[tq] = fma(vt[tk], p[tk], vkq[tq]) for tk in order, 64 dims at a time
        tq = 0
        while tq < rows:
            n_rows = _group_rows(rows - tq)
            for d in range(0, D, 64):
                _fma_chains(n_rows, vkq, tq * D + d, D, vt, d, D, kq, tq * KV_TILE, KV_TILE, 1, KV_TILE)
            tq += n_rows
        return
    for tq in range(rows):
        for tk in range(KV_TILE):
            p = kq[tq, tk]
            if p == 0:  # fma(v, 0, acc) leaves acc as it is
                continue
            for d in range(D):
                vkq[tq, d] = fma(vt[tk, d], p, vkq[tq, d])


@nb.njit(inline="always", cache=True, nogil=True)
def _group_rows(rows_left):
    """How many of a tile's rows the next _fma_chains takes: as many as fill the registers
    (CHAIN_ROWS), then 2, then 1."""
    return CHAIN_ROWS if rows_left >= CHAIN_ROWS else 2 if rows_left >= 2 else 1


@nb.njit(inline="always", cache=True, nogil=True)
def _fma_chains(n_rows, acc, acc_off, acc_row, mat, m_off, m_stride, s, s_off, s_row, s_step, n):
    """simd's fma chains for n_rows rows (_group_rows) of 64 columns: AVX-512 in one call (4
    registers a row), AVX2 32 columns a call."""
    for col in range(0, 64, 64 if GGML_AVX512 else 32):
        a_at, m_at = acc_off + col, m_off + col
        if GGML_AVX512 and n_rows == CHAIN_ROWS:
            fma_chains_64x6(acc, a_at, acc_row, mat, m_at, m_stride, s, s_off, s_row, s_step, n)
        elif GGML_AVX512 and n_rows == 2:
            fma_chains_64x2(acc, a_at, acc_row, mat, m_at, m_stride, s, s_off, s_row, s_step, n)
        elif GGML_AVX512:
            fma_chain_64(acc, a_at, acc_row, mat, m_at, m_stride, s, s_off, s_row, s_step, n)
        elif n_rows == CHAIN_ROWS:
            fma_chains_32x3(acc, a_at, acc_row, mat, m_at, m_stride, s, s_off, s_row, s_step, n)
        elif n_rows == 2:
            fma_chains_32x2(acc, a_at, acc_row, mat, m_at, m_stride, s, s_off, s_row, s_step, n)
        else:
            fma_chain_32(acc, a_at, acc_row, mat, m_at, m_stride, s, s_off, s_row, s_step, n)


@nb.njit(inline="always", cache=True, nogil=True)
def _tile_scores(q, t0, rows, h, kt, kq):
    """kq[tq, tk] = one fma chain over the head dimension (simd_gemm), Q in f32."""
    D = kt.shape[0]
    kq[:] = 0
    q_row = q.shape[1]
    # kq[tq] = fma(kt[d], q[tq, d], kq[tq]) for d in order
    tq = 0
    while tq < rows:
        n_rows = _group_rows(rows - tq)
        _fma_chains(n_rows, kq, tq * KV_TILE, KV_TILE, kt, 0, KV_TILE, q, (t0 + tq) * q_row + h * D, q_row, 1, D)
        tq += n_rows


@nb.njit(inline="always", cache=True, nogil=True)
def _tile_softmax(kq, bias, tq, scale, softcap, m, s_sum, vkq):
    """Scale and mask row tq of the scores, update the row's max and sum; the row becomes the
    probabilities (0 where masked), vkq[tq] rescaled when the max grows."""
    at = tq * KV_TILE
    if softcap == 0:
        tile_max = scaled_masked_max(kq, at, bias, at, scale, KV_TILE // 16)
    else:
        tile_max = np.float32(-np.inf)
        for tk in range(KV_TILE):
            kq[tq, tk] = _capped(kq[tq, tk] * scale, softcap) + bias[tq, tk]
            tile_max = max(tile_max, kq[tq, tk])
    if tile_max == -np.inf:
        kq[tq] = 0
        return
    m_new = max(m[tq], tile_max)
    if m_new > m[tq]:
        ms = np.float32(math.exp(m[tq] - m_new))
        for d in range(vkq.shape[1]):
            vkq[tq, d] = vkq[tq, d] * ms
        s_sum[tq] = s_sum[tq] * ms
    m[tq] = m_new
    total = _EXP_SUM_ROWS(kq, at, m_new, KV_TILE // 16)  # ggml_vec_soft_max_f32's double sum
    s_sum[tq] = np.float32(np.float64(s_sum[tq]) + total)


@nb.njit(**_SER)
def attention(q, q_pos, kcache, vcache, kv_pos, n_keep, window, scale, softcap, n_heads, out):
    """out (T, H*D): attention of q (positions q_pos, ascending) over the cache, by the path
    ggml would take."""
    if softcap != 0:  # as ggml: the scale is divided by the cap, the capped score multiplied
        scale = np.float32(scale / softcap)
    T = q.shape[0]
    if T >= Q_TILE:
        n_cells = (q_pos[-1] + KV_PAD) // KV_PAD * KV_PAD
        _attend_tiled(q, q_pos, kcache, vcache, kv_pos, n_keep, n_cells, window, scale, softcap, n_heads, out)
    else:
        no_rows, no_tables = np.zeros(0, np.int64), np.zeros((1, 1), np.int64)  # the cache's own slots
        _attend_rows(q, q_pos, no_rows, no_tables, np.int64(-1), kcache.shape[0], n_keep, kcache, vcache, kv_pos,
                     window, scale, softcap, n_heads, np.bool_(T == 1), out)


@nb.njit(**_SER)
def attention_rows(q, q_pos, row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos, window, scale, softcap, n_heads,
                   out):
    """out (T, H*D): attention of each row of q over the cells of its own sequence (row_seq[t]),
    each row exactly as a lone query at its position (q_pos[t]) is computed by `attention`
    (split or one chunk), whatever the other rows: the batching scheduler's rows. The sequences'
    slots are rows of a shared pool, through block tables (n_seq, blocks) of 2^shift rows."""
    if softcap != 0:
        scale = np.float32(scale / softcap)
    _attend_rows(q, q_pos, row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos, window, scale, softcap,
                 n_heads, np.bool_(True), out)
