"""Matrix products on the GPU: quantized weights with quantized activations, and float weights.

A quantized matrix stays as the file's blocks (kernels/cuda/blocks.py: raw uint8 (N, row_bytes)
and its float16 view), decoded in registers:

    out[t, n] = sum_g scale(n, g) * d_x[t, g] * isum(n, t, g)  (+ bias(n, g) * s_x[t, g])

with isum the exact int32 dot product of group g's codes and the activations' int8 codes, and
the group's float32 terms added in order of g, as ggml sums a row's blocks. Two kernels:
  - qmatvec_kernel (decode: T <= MATVEC_MAX_T; the batching scheduler's rows at any T, in
    blocks of MATVEC_MAX_T tokens): one warp per row, each lane a group at a time (its codes
    decoded once for every token of the block), partial sums added by a warp shuffle tree;
    a token's result is the same whatever the other tokens;
  - qmatmul_tiled_kernel (prefill): TILE_N rows x TILE_T tokens per block, K walked in chunks of
    CHUNK_WORDS words of 4 codes, decoded into shared memory, each thread one output.
For formats of 32-value groups each has a twin on the tensor cores (int8 MMA; MINILLM_CUDA_MMA)
with its results bit for bit: qmatmul_mma_kernel (prefill) and qmatvec_mma_kernel (the
scheduler's rows from ROWS_MMA_MIN_T tokens: the weights read once for 32 rows, not 4).
The float kernels (fmatvec_kernel, fmatmul_tiled_kernel) have the same shapes for F32/F16/BF16
weights (kept as float16 on the device for F16, float32 otherwise); as on the CPU's float path
(kernels/cpu/layers.py), the activations are first rounded to the weight type (round_f16_kernel,
round_bf16_kernel).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
from numba import cuda

from .blocks import FORMAT_IDS, codes4, group_scale
from .device import WARP, f16_round, pow2_threads, warp_sum
from .launch import launch
from .ptx import dp4a, mma_s8
from .registry import device, kernel

MATVEC_ROWS = 4        # rows (warps) per block of the matrix-vector kernels
MATVEC_MAX_T = 4       # batches up to this many tokens use the matrix-vector kernels
TILE_N = 16            # weight rows per block of the tiled kernels
TILE_T = 16            # tokens per block of the tiled kernels
CHUNK_WORDS = 32       # int32 words of K staged per step (128 int8 codes: 4 or 8 whole groups)
CHUNK_F = 32           # float values of K staged per step in the float tiled kernel
CHUNK_WORDS_PAD = CHUNK_WORDS + 1  # shared row length: the +1 keeps a warp's rows on distinct banks
CHUNK_F_PAD = CHUNK_F + 1
MMA_WARPS = 4          # warps per block of qmatmul_mma_kernel, each 16 weight rows
MMA_SUBTILES = 8       # tiles of 8 tokens each of its warps takes: a group's decoded codes serve 64 tokens
ROWS_MMA_WARPS = WARP // 4  # warps per block of qmatvec_mma_kernel, each 4 of qmatvec's lanes (acc0..acc3)
ROWS_MMA_SUBTILES = 4  # tiles of 8 tokens a block of qmatvec_mma_kernel takes
ROWS_MMA_TOKENS = 8 * ROWS_MMA_SUBTILES
ROWS_MMA_MIN_T = 8     # the scheduler's rows take it from this many tokens (one whole tile)
# products of 32-value groups on the tensor cores (qmatmul_mma_kernel for prefill, qmatvec_mma_kernel
# for the scheduler's rows): "1" turns them on (off until measured on a GPU: make gpu-check compares)
MMA = os.environ.get("MINILLM_CUDA_MMA") == "1"

_Q_ARGS = ("uint8[:, ::1], float16[:, ::1], uint16[:, ::1], int64, int64, int64, "
           "int32[:, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1]")


@device
def _codes4(raw, raw_w, n, fmt, k):
    """Codes k..k+3 of weight row n as one int32 word (blocks.codes4); 0 past the rows."""
    if n >= raw.shape[0]:
        return np.int32(0)
    return codes4(raw_w, n, fmt, k)


@device
def _row_group(raw, raw_h, fmt, n, g):
    """(scale, bias) of group g of weight row n; zeros past the rows."""
    if n >= raw.shape[0]:
        return np.float32(0.0), np.float32(0.0)
    return group_scale(raw, raw_h, n, fmt, g)


@device
def _add_group(acc, scale, bias, has_bias, xd, xs, t, g, isum):
    """acc plus group g's terms of one output of token t (the float terms of every quantized
    product here: one expression, so the GPU compiler contracts it alike in each kernel)."""
    if t >= xd.shape[0]:
        return acc
    acc += scale * xd[t, g] * np.float32(isum)
    if has_bias:
        acc += bias * xs[t, g]
    return acc


@kernel(f"void({_Q_ARGS})")
def qmatvec_kernel(raw, raw_h, raw_w, fmt, group, has_bias, x_words, xd, xs, out):
    """out (T, N), tokens MATVEC_MAX_T at a time: block (WARP, MATVEC_ROWS), grid
    (ceil(N / MATVEC_ROWS), ceil(T / MATVEC_MAX_T)). A token's sums do not depend on the others.
    Each word of 4 codes is decoded once for the block's tokens and summed with dp4a; the loops
    over tokens have a constant bound, so the per-token sums stay in registers."""
    partial = cuda.shared.array((MATVEC_ROWS, WARP), np.float32)  # warp_sum's scratch (simulator only)
    isum = cuda.local.array(MATVEC_MAX_T, np.int32)   # (MATVEC_MAX_T,) the group's integer sums
    acc = cuda.local.array(MATVEC_MAX_T, np.float32)  # (MATVEC_MAX_T,) the lane's partial sums
    lane = cuda.threadIdx.x
    n = cuda.blockIdx.x * MATVEC_ROWS + cuda.threadIdx.y
    t0 = cuda.blockIdx.y * MATVEC_MAX_T
    n_t = min(MATVEC_MAX_T, out.shape[0] - t0)  # (the same for the whole block)
    words = group // 4
    for t in range(MATVEC_MAX_T):
        acc[t] = np.float32(0.0)
    if n < raw.shape[0]:
        for g in range(lane, x_words.shape[1] // words, WARP):
            for t in range(MATVEC_MAX_T):
                isum[t] = np.int32(0)
            for w in range(words):
                word = _codes4(raw, raw_w, n, fmt, g * group + 4 * w)
                for t in range(MATVEC_MAX_T):
                    if t < n_t:
                        isum[t] = dp4a(word, x_words[t0 + t, g * words + w], isum[t])
            scale, bias = group_scale(raw, raw_h, n, fmt, g)
            for t in range(MATVEC_MAX_T):
                if t < n_t:
                    acc[t] = _add_group(acc[t], scale, bias, has_bias, xd, xs, t0 + t, g, isum[t])
    for t in range(MATVEC_MAX_T):
        if t < n_t:
            total = warp_sum(acc[t], partial)
            if lane == 0 and n < raw.shape[0]:
                out[t0 + t, n] = total


@kernel(f"void({_Q_ARGS})")
def qmatmul_tiled_kernel(raw, raw_h, raw_w, fmt, group, has_bias, x_words, xd, xs, out):
    """out (T, N); block (TILE_N, TILE_T), grid (ceil(N / TILE_N), ceil(T / TILE_T))."""
    w_sh = cuda.shared.array((TILE_N, CHUNK_WORDS_PAD), np.int32)
    x_sh = cuda.shared.array((TILE_T, CHUNK_WORDS_PAD), np.int32)
    tn = cuda.threadIdx.x
    tt = cuda.threadIdx.y
    n0 = cuda.blockIdx.x * TILE_N
    t0 = cuda.blockIdx.y * TILE_T
    n = n0 + tn
    t = t0 + tt
    N = raw.shape[0]
    T, n_words = x_words.shape
    n_groups = n_words * 4 // group
    words_per_group = group // 4
    flat = tt * TILE_N + tn
    acc = np.float32(0.0)
    for c0 in range(0, n_words, CHUNK_WORDS):
        for e in range(flat, TILE_N * CHUNK_WORDS, TILE_N * TILE_T):
            row = e // CHUNK_WORDS
            col = e % CHUNK_WORDS
            word = np.int32(0)
            if c0 + col < n_words:
                word = _codes4(raw, raw_w, n0 + row, fmt, (c0 + col) * 4)
            w_sh[row, col] = word
        for e in range(flat, TILE_T * CHUNK_WORDS, TILE_N * TILE_T):
            row = e // CHUNK_WORDS
            col = e % CHUNK_WORDS
            ok = t0 + row < T and c0 + col < n_words
            x_sh[row, col] = x_words[t0 + row, c0 + col] if ok else 0
        cuda.syncthreads()
        if n < N and t < T:
            g0 = c0 // words_per_group
            for gi in range(min(CHUNK_WORDS // words_per_group, n_groups - g0)):
                isum = np.int32(0)
                for j in range(gi * words_per_group, (gi + 1) * words_per_group):
                    isum = dp4a(w_sh[tn, j], x_sh[tt, j], isum)
                g = g0 + gi
                scale, bias = group_scale(raw, raw_h, n, fmt, g)
                acc = _add_group(acc, scale, bias, has_bias, xd, xs, t, g, isum)
        cuda.syncthreads()
    if n < N and t < T:
        out[t, n] = acc


@device
def _mma_group(raw, raw_h, raw_w, fmt, has_bias, x_words, xd, xs, row, g, live, t_first, n_tiles, acc, scratch_a,
               scratch_b):
    """Group g's terms for weight rows row and row + 8 (this lane's gid) and n_tiles tiles of 8
    tokens from t_first, added to acc (n_tiles, 4) if live: the codes decoded once, one m16n8k32
    MMA a tile (kernels/cuda/ptx.py: the group's exact int32 sums). acc[s] holds this lane's sums
    of (row, ta), (row, ta + 1), (row + 8, ta), (row + 8, ta + 1), ta = t_first + 8 s + 2 tig.
    A warp-collective: every lane of the block calls it alike (live or not)."""
    tig = cuda.threadIdx.x & 3
    T = x_words.shape[0]
    k = g * 32 + 4 * tig
    a0, a1 = _codes4(raw, raw_w, row, fmt, k), _codes4(raw, raw_w, row + 8, fmt, k)
    a2, a3 = _codes4(raw, raw_w, row, fmt, k + 16), _codes4(raw, raw_w, row + 8, fmt, k + 16)
    scale_lo, bias_lo = _row_group(raw, raw_h, fmt, row, g)
    scale_hi, bias_hi = _row_group(raw, raw_h, fmt, row + 8, g)
    for s in range(n_tiles):
        t0 = t_first + 8 * s
        if t0 >= T:  # (the same for the whole block: every warp stops alike)
            break
        token = t0 + (cuda.threadIdx.x >> 2)  # the B column this lane loads
        b0 = x_words[token, g * 8 + tig] if token < T else np.int32(0)
        b1 = x_words[token, g * 8 + 4 + tig] if token < T else np.int32(0)
        d0, d1, d2, d3 = mma_s8(a0, a1, a2, a3, b0, b1, scratch_a, scratch_b)
        ta = t0 + 2 * tig
        if not live:
            continue
        acc[s, 0] = _add_group(acc[s, 0], scale_lo, bias_lo, has_bias, xd, xs, ta, g, d0)
        acc[s, 1] = _add_group(acc[s, 1], scale_lo, bias_lo, has_bias, xd, xs, ta + 1, g, d1)
        acc[s, 2] = _add_group(acc[s, 2], scale_hi, bias_hi, has_bias, xd, xs, ta, g, d2)
        acc[s, 3] = _add_group(acc[s, 3], scale_hi, bias_hi, has_bias, xd, xs, ta + 1, g, d3)


@kernel(f"void({_Q_ARGS})")
def qmatmul_mma_kernel(raw, raw_h, raw_w, fmt, group, has_bias, x_words, xd, xs, out):
    """out (T, N) for formats of 32-value groups, on the tensor cores: each warp 16 weight rows
    x MMA_SUBTILES tiles of 8 tokens (_mma_group), the group's float terms added in order of g
    as qmatmul_tiled_kernel adds them (so the same results).
    Block (WARP, MMA_WARPS), grid (ceil(N / (16 * MMA_WARPS)), ceil(T / (8 * MMA_SUBTILES)))."""
    scratch_a = cuda.shared.array((MMA_WARPS, WARP, 4), np.int32)  # mma_s8's scratch (simulator only)
    scratch_b = cuda.shared.array((MMA_WARPS, WARP, 2), np.int32)
    acc = cuda.local.array((MMA_SUBTILES, 4), np.float32)  # per tile, as _mma_group says
    gid = cuda.threadIdx.x >> 2
    tig = cuda.threadIdx.x & 3
    row = (cuda.blockIdx.x * MMA_WARPS + cuda.threadIdx.y) * 16 + gid  # and row + 8
    t_first = cuda.blockIdx.y * 8 * MMA_SUBTILES
    for s in range(MMA_SUBTILES):
        for i in range(4):
            acc[s, i] = np.float32(0.0)
    for g in range(x_words.shape[1] // 8):
        _mma_group(raw, raw_h, raw_w, fmt, has_bias, x_words, xd, xs, row, g, True, t_first, MMA_SUBTILES, acc,
                   scratch_a, scratch_b)
    N, T = raw.shape[0], x_words.shape[0]
    for s in range(MMA_SUBTILES):
        for i in range(4):
            n = row + 8 * (i >> 1)
            t = t_first + 8 * s + 2 * tig + (i & 1)
            if n < N and t < T:
                out[t, n] = acc[s, i]


@device
def _class_group(weights, activations, row, g, t_first, acc, scratch_a, scratch_b):
    """_mma_group for group g of a class, or (past the last group) the same instructions adding
    nothing; weights (raw, raw_h, raw_w, fmt, has_bias), activations (x_words, xd, xs)."""
    raw, raw_h, raw_w, fmt, has_bias = weights
    x_words, xd, xs = activations
    n_groups = x_words.shape[1] // 8
    _mma_group(raw, raw_h, raw_w, fmt, has_bias, x_words, xd, xs, row, min(g, n_groups - 1), g < n_groups, t_first,
               ROWS_MMA_SUBTILES, acc, scratch_a, scratch_b)


@kernel(f"void({_Q_ARGS})")
def qmatvec_mma_kernel(raw, raw_h, raw_w, fmt, group, has_bias, x_words, xd, xs, out):
    """out (T, N) for formats of 32-value groups on the tensor cores, each output the same
    float32 as qmatvec_kernel's (so a row's result still does not depend on the other rows).
    qmatvec's lane c sums the groups g = c (mod 32) in order, then warp_sum adds the 32 lanes'
    sums by a tree (c += c + 16, c += c + 8, ... for c below the offset). Here that lane is a
    class of groups, and warp w takes classes w, w + 8, w + 16 and w + 24 (acc0..acc3) for 16
    weight rows x ROWS_MMA_SUBTILES tiles of 8 tokens (_mma_group). The tree's first two levels
    pair classes of the same warp, so they are added in registers; the last three across the 8
    warps, in shared memory. Block (WARP, ROWS_MMA_WARPS = 8), grid (ceil(N / 16),
    ceil(T / (8 * ROWS_MMA_SUBTILES)))."""
    scratch_a = cuda.shared.array((ROWS_MMA_WARPS, WARP, 4), np.int32)  # mma_s8's scratch (simulator only)
    scratch_b = cuda.shared.array((ROWS_MMA_WARPS, WARP, 2), np.int32)
    tiles = cuda.shared.array((ROWS_MMA_WARPS, 16, ROWS_MMA_TOKENS), np.float32)  # (class, row, token)
    # one array per class, not one indexed by class: a loop over classes is not unrolled, and an
    # array indexed in it is not kept in registers
    acc0 = cuda.local.array((ROWS_MMA_SUBTILES, 4), np.float32)  # per tile, as _mma_group says
    acc1 = cuda.local.array((ROWS_MMA_SUBTILES, 4), np.float32)
    acc2 = cuda.local.array((ROWS_MMA_SUBTILES, 4), np.float32)
    acc3 = cuda.local.array((ROWS_MMA_SUBTILES, 4), np.float32)
    gid = cuda.threadIdx.x >> 2
    tig = cuda.threadIdx.x & 3
    warp = cuda.threadIdx.y
    row0 = cuda.blockIdx.x * 16
    t_first = cuda.blockIdx.y * ROWS_MMA_TOKENS
    n_groups = x_words.shape[1] // 8
    for s in range(ROWS_MMA_SUBTILES):
        for i in range(4):
            acc0[s, i] = acc1[s, i] = acc2[s, i] = acc3[s, i] = np.float32(0.0)
    weights = (raw, raw_h, raw_w, fmt, has_bias)
    activations = (x_words, xd, xs)
    for r in range((n_groups + WARP - 1) // WARP):  # as many rounds for every warp
        g = warp + WARP * r
        _class_group(weights, activations, row0 + gid, g, t_first, acc0, scratch_a, scratch_b)
        _class_group(weights, activations, row0 + gid, g + ROWS_MMA_WARPS, t_first, acc1, scratch_a, scratch_b)
        _class_group(weights, activations, row0 + gid, g + 2 * ROWS_MMA_WARPS, t_first, acc2, scratch_a, scratch_b)
        _class_group(weights, activations, row0 + gid, g + 3 * ROWS_MMA_WARPS, t_first, acc3, scratch_a, scratch_b)
    for s in range(ROWS_MMA_SUBTILES):
        for i in range(4):
            # the tree's levels 16 and 8 (classes w + 16 and w + 24, then w + 8), then to shared memory
            tiles[warp, gid + 8 * (i >> 1), 8 * s + 2 * tig + (i & 1)] = (
                (acc0[s, i] + acc2[s, i]) + (acc1[s, i] + acc3[s, i]))
    cuda.syncthreads()
    n_out = 16 * ROWS_MMA_TOKENS
    flat = warp * WARP + cuda.threadIdx.x
    offset = ROWS_MMA_WARPS // 2
    while offset > 0:  # the tree's levels 4, 2 and 1: class c += class c + offset
        for e in range(flat, offset * n_out, ROWS_MMA_WARPS * WARP):
            c, r, t = e // n_out, (e // ROWS_MMA_TOKENS) % 16, e % ROWS_MMA_TOKENS
            tiles[c, r, t] += tiles[c + offset, r, t]
        cuda.syncthreads()
        offset //= 2
    N, T = raw.shape[0], x_words.shape[0]
    for e in range(flat, n_out, ROWS_MMA_WARPS * WARP):
        r, t = e // ROWS_MMA_TOKENS, e % ROWS_MMA_TOKENS
        if row0 + r < N and t_first + t < T:
            out[t_first + t, row0 + r] = tiles[0, r, t]


@kernel("void(float32[:, ::1], float32[:, ::1], float32[:, ::1])",
        "void(float16[:, ::1], float32[:, ::1], float32[:, ::1])")
def fmatvec_kernel(w, x, out):
    """out (T, N) = x (T, K) @ w (N, K).T, tokens MATVEC_MAX_T at a time; launch as qmatvec_kernel."""
    partial = cuda.shared.array((MATVEC_ROWS, WARP), np.float32)  # warp_sum's scratch (simulator only)
    lane = cuda.threadIdx.x
    r = cuda.threadIdx.y
    n = cuda.blockIdx.x * MATVEC_ROWS + r
    N, K = w.shape
    for t in range(cuda.blockIdx.y * MATVEC_MAX_T, min(out.shape[0], (cuda.blockIdx.y + 1) * MATVEC_MAX_T)):
        acc = np.float32(0.0)
        if n < N:
            for k in range(lane, K, WARP):
                acc += np.float32(w[n, k]) * x[t, k]
        total = warp_sum(acc, partial)
        if lane == 0 and n < N:
            out[t, n] = total


@kernel("void(float32[:, ::1], float32[:, ::1], float32[:, ::1])",
        "void(float16[:, ::1], float32[:, ::1], float32[:, ::1])")
def fmatmul_tiled_kernel(w, x, out):
    """out (T, N) = x @ w.T; launch as qmatmul_tiled_kernel."""
    w_sh = cuda.shared.array((TILE_N, CHUNK_F_PAD), np.float32)
    x_sh = cuda.shared.array((TILE_T, CHUNK_F_PAD), np.float32)
    tn = cuda.threadIdx.x
    tt = cuda.threadIdx.y
    n0 = cuda.blockIdx.x * TILE_N
    t0 = cuda.blockIdx.y * TILE_T
    N, K = w.shape
    T = x.shape[0]
    flat = tt * TILE_N + tn
    acc = np.float32(0.0)
    for c0 in range(0, K, CHUNK_F):
        for e in range(flat, TILE_N * CHUNK_F, TILE_N * TILE_T):
            row = e // CHUNK_F
            col = e % CHUNK_F
            ok = n0 + row < N and c0 + col < K
            w_sh[row, col] = np.float32(w[n0 + row, c0 + col]) if ok else np.float32(0.0)
        for e in range(flat, TILE_T * CHUNK_F, TILE_N * TILE_T):
            row = e // CHUNK_F
            col = e % CHUNK_F
            ok = t0 + row < T and c0 + col < K
            x_sh[row, col] = x[t0 + row, c0 + col] if ok else np.float32(0.0)
        cuda.syncthreads()
        for j in range(CHUNK_F):
            acc += w_sh[tn, j] * x_sh[tt, j]
        cuda.syncthreads()
    if n0 + tn < N and t0 + tt < T:
        out[t0 + tt, n0 + tn] = acc


@kernel("void(float32[:, ::1], float32[:, ::1])")
def round_f16_kernel(x, out):
    """out = x rounded to float16 values (T, K); grid over T * K threads."""
    i = cuda.grid(1)
    if i < x.size:
        t = i // x.shape[1]
        k = i % x.shape[1]
        out[t, k] = f16_round(x[t, k])


@kernel("void(uint32[:, ::1], uint32[:, ::1])")
def round_bf16_kernel(x_bits, out_bits):
    """The bits of x rounded to bfloat16 (nearest even), on uint32 views of float32 (T, K) arrays."""
    i = cuda.grid(1)
    if i < x_bits.size:
        t = i // x_bits.shape[1]
        k = i % x_bits.shape[1]
        b = int(x_bits[t, k])
        out_bits[t, k] = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000


# ---------------------------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------------------------
@dataclass
class QWeights:
    """A quantized matrix on the device: the file's blocks (see kernels/cuda/blocks.py)."""

    raw: object     # uint8 (N, row_bytes)
    fmt: int        # blocks.FORMAT_IDS
    group: int      # codes sharing a scale (16 or 32)
    has_bias: bool
    n_rows: int
    n_cols: int
    raw_h: object = field(init=False)  # float16 (N, row_bytes / 2): the same memory
    raw_w: object = field(init=False)  # uint16 (N, row_bytes / 2): the same memory

    def __post_init__(self):
        self.read_from(self.raw)

    def read_from(self, raw) -> None:
        """Take the blocks from raw (the same bytes elsewhere on the device), with its views."""
        self.raw, self.raw_h, self.raw_w = raw, raw.view(np.float16), raw.view(np.uint16)


@dataclass
class FWeights:
    """A float matrix on the device: weight (N, K) float16 (F16) or float32 (F32, BF16)."""

    weight: object
    round_mode: str  # activations are rounded to this type first: "f32" (none), "f16", "bf16"
    n_rows: int
    n_cols: int


def upload_blocks(fmt, raw: np.ndarray, n_cols: int) -> QWeights:
    """A quantized Format's rows of blocks raw (N, row_bytes) uint8 copied to the device as they are."""
    if fmt.name not in FORMAT_IDS or fmt.group not in (16, 32):
        raise ValueError(f"the CUDA products do not read {fmt.name} blocks")
    if raw.shape[1] != n_cols // fmt.block_size * fmt.type_size or n_cols % fmt.block_size:
        raise ValueError(f"{fmt.name}: rows of {raw.shape[1]} bytes do not hold {n_cols} values")
    device_raw = cuda.to_device(np.ascontiguousarray(raw, np.uint8))
    return QWeights(device_raw, FORMAT_IDS[fmt.name], fmt.group, fmt.has_bias, raw.shape[0], n_cols)


def upload_float_matrix(weight: np.ndarray, fmt_name: str) -> FWeights:
    """weight (N, K) with the values of an F32, F16 or BF16 tensor -> device copy."""
    modes = {"F32": "f32", "F16": "f16", "BF16": "bf16"}
    dtype = np.float16 if fmt_name == "F16" else np.float32
    dev = cuda.to_device(np.ascontiguousarray(weight, dtype=dtype))
    return FWeights(dev, modes[fmt_name], weight.shape[0], weight.shape[1])


def _grid(n: int, per_block: int) -> int:
    return (n + per_block - 1) // per_block


def _use_tiled(T: int, batched: bool | None) -> bool:
    return T > MATVEC_MAX_T if batched is None else batched


def qmatmul(w: QWeights, act, out, batched: bool | None = None, mma: bool | None = None):
    """out (T, N) = x @ W.T on the device, act the QActivations of x for w's activation kind.

    batched: use the tiled kernels (True) or the matrix-vector one (False, any T); None: by T.
    mma: products of 32-value groups on the tensor cores (None: as MMA says): the tiled one, and
    the matrix-vector one from ROWS_MMA_MIN_T tokens (the same results as without)."""
    T, K = act.shape
    if K != w.n_cols or out.shape != (T, w.n_rows):
        raise ValueError(f"shapes: W ({w.n_rows}, {w.n_cols}), x ({T}, {K}), out {out.shape}")
    xd, xs = act.scales(w.group)
    args = (w.raw, w.raw_h, w.raw_w, w.fmt, w.group, int(w.has_bias), act.words, xd, xs, out)
    tensor_cores = (mma if mma is not None else MMA) and w.group == 32
    if not _use_tiled(T, batched) and tensor_cores and T >= ROWS_MMA_MIN_T:
        launch(qmatvec_mma_kernel, (_grid(w.n_rows, 16), _grid(T, ROWS_MMA_TOKENS)), (WARP, ROWS_MMA_WARPS),
               *args)
    elif not _use_tiled(T, batched):
        launch(qmatvec_kernel, (_grid(w.n_rows, MATVEC_ROWS), _grid(T, MATVEC_MAX_T)), (WARP, MATVEC_ROWS), *args)
    elif tensor_cores:
        launch(qmatmul_mma_kernel, (_grid(w.n_rows, 16 * MMA_WARPS), _grid(T, 8 * MMA_SUBTILES)), (WARP, MMA_WARPS),
               *args)
    else:
        launch(qmatmul_tiled_kernel, (_grid(w.n_rows, TILE_N), _grid(T, TILE_T)), (TILE_N, TILE_T), *args)
    return out


def round_activations(x, mode: str, out):
    """out = x rounded to float16 ("f16") or bfloat16 ("bf16") values; device (T, K) float32."""
    threads = pow2_threads(x.size, hi=256)
    blocks = _grid(x.size, threads)
    if mode == "f16":
        launch(round_f16_kernel, blocks, threads, x, out)
    elif mode == "bf16":
        launch(round_bf16_kernel, blocks, threads, x.view(np.uint32), out.view(np.uint32))
    else:
        raise ValueError(f"unknown rounding {mode!r}")
    return out


def fmatmul(w: FWeights, x, out, scratch=None, batched: bool | None = None):
    """out (T, N) = x @ W.T with x (T, K) float32 rounded to the weight type (into scratch) first."""
    T, K = x.shape
    if K != w.n_cols or out.shape != (T, w.n_rows):
        raise ValueError(f"shapes: W ({w.n_rows}, {w.n_cols}), x ({T}, {K}), out {out.shape}")
    if w.round_mode != "f32":
        if scratch is None or scratch.shape != x.shape:
            scratch = cuda.device_array(x.shape, np.float32)
        x = round_activations(x, w.round_mode, scratch)
    if not _use_tiled(T, batched):
        launch(fmatvec_kernel, (_grid(w.n_rows, MATVEC_ROWS), _grid(T, MATVEC_MAX_T)), (WARP, MATVEC_ROWS),
               w.weight, x, out)
    else:
        launch(fmatmul_tiled_kernel, (_grid(w.n_rows, TILE_N), _grid(T, TILE_T)), (TILE_N, TILE_T), w.weight, x, out)
    return out
