"""Products of float weights (F32, F16, BF16) as llama.cpp's x86 CPU backend computes them. The
activations are first rounded to the weight's type (layers._round_to_format), as ggml converts
them to the type's vec_dot type; weight (N, K) holds the weights' bit patterns, which say the
format (_weight): uint32 F32, uint16 F16 (widened as they load, simd._load_f32x16), int16 BF16;
or float32 values multiplied as format fmt's (the tests' widened F16 and BF16 weights). Then:

- a batch of 2 rows or more: llamafile's tinyBLAS. Per output one accumulator of LANES floats
  (8 on AVX2, 16 with AVX-512), acc[j] = fma(w[l + j], x[l + j], acc[j]) over steps of LANES
  columns (the last step partial), then its hsum; with K a multiple of 16, computed for tiles of
  outputs at once, in registers (_tiny_blas_tiles);
- one row: ggml_vec_dot_f32/_f16, four such accumulators over steps of 4 LANES summed as ggml's
  REDUCE (attention's dot_f16_*), the columns past the last step added after (F16: in double;
  F32: product, then sum, in float); ggml_vec_dot_bf16, four (AVX-512: two) accumulators of
  products added, reduced, then the rest in double.

BF16 where the CPU has AVX512_BF16 (GGML_AVX512_BF16): both take vdpbf16ps, whose lane j adds
the products of a 32-value step's pair 2j + 1, then 2j, each as an fma (the products of two
bfloat16 are exact in float32), flushing a subnormal sum to zero: tinyBLAS one accumulator of 16
lanes over steps of 32 (the last step padded with zeros), vec_dot two over steps of 64.
"""
import numba as nb
import numpy as np
from numba import types
from numba.extending import overload

from .attention import F16_DOT_STEP, _reduce8, _reduce16
from .f16 import f16_value, float32_from_bits
from .fma import fma
from .ops import GGML_AVX512, GGML_AVX512_BF16, THREADS
from .simd import (dot_f16_32_ahead, dot_f16_64_ahead, dpbf16_dot_4x2, dpbf16_lanes_2x4, dpbf16_lanes_4x6,
                   fma8_lanes_2x2, fma8_lanes_4x3, fma_lanes_2x4, fma_lanes_4x6, mul_add8_dot_2x4, widen_f32)

LANES = 16 if GGML_AVX512 else 8
_FLT_MIN = np.float32(1.1754944e-38)  # the smallest normal float32
FLOAT_F32, FLOAT_F16, FLOAT_BF16 = 0, 1, 2
PARALLEL_MIN = 1 << 16     # element-wise passes over fewer values run on one thread (no fork/join)
X_BLOCK_BYTES = 256 * 1024  # activation rows a pass over the weights reads (well inside L2)
# register tiles (weight rows, activation rows) of a batch's products, and the smaller ones of a
# batch under SMALL_BATCH rows: 24 accumulators of the 32 AVX-512 registers, 12 of AVX2's 16
TILE, SMALL_TILE, SMALL_BATCH = ((4, 6), (2, 4), 8) if LANES == 16 else ((4, 3), (2, 2), 3)


@nb.njit(parallel=True, cache=True, nogil=True)
def float_matmul(weight, x, fmt, out):
    """out (T, N) = x (T, K) @ weight.T for weights of float format fmt (module doc)."""
    N, K = weight.shape
    T = x.shape[0]
    w, xf = weight.reshape(N * K), x.reshape(T * K)
    xb = _bf16_bits(xf if _vector_bf16(w, K) else xf[:0])  # (T * K,) x's bits for vdpbf16ps
    if T == 1:
        for quad in nb.prange((N + 3) // 4):
            _four_rows(w, N, K, quad, xf, xb, fmt, out)
        return
    if _vector_bf16(w, K):
        _dpbf16_products(w, xb, N, K, T, out)
        return
    if K % 16 == 0 and not (fmt == FLOAT_BF16 and GGML_AVX512_BF16):
        _tiny_blas_tiles(w, xf, N, K, T, out)
        return
    for n in nb.prange(N):
        acc = np.empty(4 * LANES, np.float32)
        for t in range(T):
            out[t, n] = _batch_dot(w, n * K, xf, t * K, K, acc, fmt)


@nb.njit(parallel=True, cache=True, nogil=True)
def float_matvec3(w1, w2, w3, n_mats, x, fmt, o1, o2, o3):
    """o_i (1, N_i) = x (1, K) @ w_i.T for n_mats (2 or 3) matrices of one float format and
    width, in one parallel region (a token's q/k/v or gate/up), each output as float_matmul's."""
    K = x.shape[1]
    xf = x.reshape(K)
    xb = _bf16_bits(xf if _vector_bf16(w1, K) else xf[:0])
    N1, N2, N3 = w1.shape[0], w2.shape[0], w3.shape[0] if n_mats == 3 else 0
    q1, q2, q3 = (N1 + 3) // 4, (N2 + 3) // 4, (N3 + 3) // 4
    f1, f2, f3 = w1.reshape(N1 * K), w2.reshape(N2 * K), w3.reshape(w3.shape[0] * K)
    for quad in nb.prange(q1 + q2 + q3):
        # one call site, so that the rows' code compiles once, not once per matrix
        first = quad < q1
        second = not first and quad < q1 + q2
        w = f1 if first else f2 if second else f3
        out = o1 if first else o2 if second else o3
        N = N1 if first else N2 if second else N3
        _four_rows(w, N, K, quad - (0 if first else q1 if second else q1 + q2), xf, xb, fmt, out)


@nb.njit(inline="always", cache=True, nogil=True)
def _vector_bf16(w, K):
    """Whether BF16 products take vdpbf16ps on whole vectors: the CPU has it, w holds bf16 bit
    patterns and K is a multiple of 32."""
    return GGML_AVX512_BF16 and _holds_bf16_bits(w) and K % 32 == 0


@nb.njit(inline="always", cache=True, nogil=True)
def _four_rows(w, N, K, quad, xf, xb, fmt, out):
    """out[0, n] for rows n of quad (4 rows: fewer for the last) of w (N * K,) flat, one token:
    ggml's vec_dot for the format (module doc); xb: x's bf16 bits where _vector_bf16."""
    if _vector_bf16(w, K):
        _bf16_vector_rows(w, N, K, quad, xb, out)
        return
    if LANES == 8 and _holds_bf16_bits(w) and K % 32 == 0:
        _bf16_avx2_rows(w, N, K, quad, xf, out)
        return
    acc = np.empty(4 * LANES, np.float32)
    for n in range(4 * quad, min(4 * quad + 4, N)):
        out[0, n] = _token_dot(w, n * K, xf, K, acc, fmt)


# The models' weights say their format by their dtype (uint32: F32 bits, uint16: F16 bits, int16:
# BF16 bits), so the code of each format's dot compiles only where it can run: these choose it
# when compiling. float32 weights follow fmt (the tests' widened values of any format).
def _token_dot(w, w_at, x, K, acc, fmt):
    """One output of one token: ggml's vec_dot for the format (module doc)."""


@overload(_token_dot, inline="always")
def _token_dot_impl(w, w_at, x, K, acc, fmt):
    if w.dtype == types.int16 and GGML_AVX512_BF16:
        return lambda w, w_at, x, K, acc, fmt: _dpbf16_dot(w, w_at, x, 0, K, acc, 2, 64)
    if w.dtype == types.int16:
        return lambda w, w_at, x, K, acc, fmt: _vec_dot_bf16(w, w_at, x, 0, K, acc)
    if w.dtype == types.uint16:
        return lambda w, w_at, x, K, acc, fmt: _vec_dot(w, w_at, x, 0, K, True)
    if w.dtype == types.uint32:
        return lambda w, w_at, x, K, acc, fmt: _vec_dot(w, w_at, x, 0, K, False)

    def any_format(w, w_at, x, K, acc, fmt):
        if fmt == FLOAT_BF16 and GGML_AVX512_BF16:
            return _dpbf16_dot(w, w_at, x, 0, K, acc, 2, 64)
        if fmt == FLOAT_BF16:
            return _vec_dot_bf16(w, w_at, x, 0, K, acc)
        return _vec_dot(w, w_at, x, 0, K, fmt == FLOAT_F16)
    return any_format


def _batch_dot(w, w_at, x, x_at, K, acc, fmt):
    """One output of a batch row where no tiles apply: tinyBLAS's dot for the format."""


@overload(_batch_dot, inline="always")
def _batch_dot_impl(w, w_at, x, x_at, K, acc, fmt):
    if w.dtype == types.int16 and GGML_AVX512_BF16:
        return lambda w, w_at, x, x_at, K, acc, fmt: _dpbf16_dot(w, w_at, x, x_at, K, acc, 1, 32)
    if w.dtype != types.float32 or not GGML_AVX512_BF16:
        return lambda w, w_at, x, x_at, K, acc, fmt: _tiny_blas_dot(w, w_at, x, x_at, K, acc)

    def any_format(w, w_at, x, x_at, K, acc, fmt):
        if fmt == FLOAT_BF16:
            return _dpbf16_dot(w, w_at, x, x_at, K, acc, 1, 32)
        return _tiny_blas_dot(w, w_at, x, x_at, K, acc)
    return any_format


def _bf16_vector_rows(w, N, K, quad, xb, out):
    """_four_rows where _vector_bf16 (compiled for bfloat16 bits only)."""


@overload(_bf16_vector_rows, inline="always")
def _bf16_vector_rows_impl(w, N, K, quad, xb, out):
    if w.dtype != types.int16:
        return lambda w, N, K, quad, xb, out: None

    def rows(w, N, K, quad, xb, out):
        acc = np.empty(4 * 2, np.float32)   # (4, 2): the hsums of each row's two accumulators
        at = np.empty(5, np.int64)          # where the 4 weight rows (the last repeated) and x start
        for k in range(4):
            at[k] = min(4 * quad + k, N - 1) * K
        at[4] = 0
        dpbf16_dot_4x2(w, at[:4], xb, at[4:], K // 64, acc)  # the activations load once for 4 rows
        for k in range(min(4, N - 4 * quad)):
            n = 4 * quad + k
            wide = np.float64(acc[2 * k]) + np.float64(acc[2 * k + 1])
            for i in range(K - K % 64, K):
                wide += np.float64(_weight(w, n * K + i) * _weight(xb, i))
            out[0, n] = np.float32(wide)
    return rows


def _bf16_avx2_rows(w, N, K, quad, x, out):
    """_four_rows for BF16 weights on AVX2 (K a multiple of 32): _vec_dot_bf16's four 8-lane
    accumulators in registers, two rows at a time (mul_add8_dot_2x4); compiled for bfloat16 bits
    only."""


@overload(_bf16_avx2_rows, inline="always")
def _bf16_avx2_rows_impl(w, N, K, quad, x, out):
    if w.dtype != types.int16 or LANES != 8:
        return lambda w, N, K, quad, x, out: None

    def rows(w, N, K, quad, x, out):
        acc = np.empty(2 * 4 * 8, np.float32)  # (2 rows, 4 accumulators, 8 lanes)
        at = np.empty(3, np.int64)             # where the 2 weight rows (the last repeated) and x start
        at[2] = 0
        for n0 in range(4 * quad, min(4 * quad + 4, N), 2):
            at[0], at[1] = n0 * K, min(n0 + 1, N - 1) * K
            mul_add8_dot_2x4(w, at[:2], x, at[2:], K // 32, acc)
            for k in range(min(2, N - n0)):
                out[0, n0 + k] = _bf16_avx2_sum(acc[32 * k:])
    return rows


def _tiny_blas_tiles(w, x, N, K, T, out):
    """tinyBLAS (K a multiple of 16): each output's LANES-lane accumulator exactly as
    _tiny_blas_dot's, computed in register tiles (TILE) so that a weight vector loads once for
    the tile's activation rows and an activation vector once for its weight rows (_tiles). Not
    compiled where it cannot run: BF16 takes vdpbf16ps where the CPU has it."""


@overload(_tiny_blas_tiles, inline="always")
def _tiny_blas_tiles_impl(w, x, N, K, T, out):
    if w.dtype == types.int16 and GGML_AVX512_BF16:
        return lambda w, x, N, K, T, out: None
    if LANES == 8:
        return lambda w, x, N, K, T, out: _tiles(w, x, N, K, T, out, fma8_lanes_4x3, fma8_lanes_2x2, 8)
    return lambda w, x, N, K, T, out: _tiles(w, x, N, K, T, out, fma_lanes_4x6, fma_lanes_2x4, 16)


@nb.njit(inline="always", cache=True, nogil=True)
def _tiles(w, x, N, K, T, out, tile_lanes, small_lanes, step):
    """Register tiles of TILE's shape (tile_lanes computes them), or under SMALL_BATCH rows
    SMALL_TILE's (small_lanes), in one parallel region (one to compile): each thread takes a run
    of tiles (_run_tiles)."""
    small = T < SMALL_BATCH
    n_w = SMALL_TILE[0] if small else TILE[0]
    n_tiles = (N + n_w - 1) // n_w
    n_runs = min(n_tiles, THREADS)
    for run in nb.prange(n_runs):
        first, last = run * n_tiles // n_runs, (run + 1) * n_tiles // n_runs
        if small:
            _run_tiles(w, x, N, K, T, out, small_lanes, SMALL_TILE[0], SMALL_TILE[1], step, first, last)
        else:
            _run_tiles(w, x, N, K, T, out, tile_lanes, TILE[0], TILE[1], step, first, last)


@nb.njit(inline="always", cache=True, nogil=True)
def _run_tiles(w, x, N, K, T, out, lanes, n_w, n_x, step, first, last):
    """Tiles first..last - 1 of n_w weight rows, by n_x activation rows at a time: lanes(...)
    leaves each output's LANES-lane accumulator over K // step steps, then its hsum. The
    activations are taken a block of rows at a time, as many as fit X_BLOCK_BYTES, and every
    tile walks the block: each pass over the weights then reads activations from L2, not from
    memory. 16-bit weights are widened to float32 once per tile and block (_tile_rows), not once
    per activation rows. A partial tile repeats its last rows, unused."""
    block = max(n_x, X_BLOCK_BYTES // (K * x.itemsize) // n_x * n_x)
    acc = np.empty(n_w * n_x, np.float32)       # (n_w, n_x): each output's lanes, summed
    w_at = np.empty(n_w, np.int64)              # where each weight row starts
    x_at = np.empty(n_x, np.int64)              # where each activation row starts
    wide = _wide_rows(w, x, n_w * K)            # (n_w * K,) the tile's rows widened, if they are
    wide_at = np.arange(n_w) * K
    for b0 in range(0, T, block):
        b1 = min(T, b0 + block)
        for tile in range(first, last):
            n0, n_rows = n_w * tile, min(n_w, N - n_w * tile)
            for k in range(n_w):
                w_at[k] = min(n0 + k, N - 1) * K
            rows, rows_at = _tile_rows(w, x, w_at, K, wide, wide_at)
            for t0 in range(b0, b1, n_x):
                for r in range(n_x):
                    x_at[r] = min(t0 + r, T - 1) * K
                lanes(rows, rows_at, x, x_at, K // step, acc)
                for k in range(n_rows):
                    for r in range(min(n_x, b1 - t0)):
                        out[t0 + r, n0 + k] = acc[n_x * k + r]


def _widens(w, x) -> bool:
    """Whether the tiles widen w's rows first: 16-bit weights times float32 activations (fma);
    vdpbf16ps takes bfloat16 bits as they are (x holds bits too)."""
    return w.dtype in (types.uint16, types.int16) and x.dtype == types.float32


def _wide_rows(w, x, n):
    """Room for n weights widened to float32 (none where _widens is false)."""


@overload(_wide_rows, inline="always")
def _wide_rows_impl(w, x, n):
    size = 1 if _widens(w, x) else 0
    return lambda w, x, n: np.empty(n * size, np.float32)


def _tile_rows(w, x, w_at, K, wide, wide_at):
    """(array, starts) a tile's products read its weight rows (at w_at) from: in place, or where
    _widens, widened into wide (exact) at wide_at."""


@overload(_tile_rows, inline="always")
def _tile_rows_impl(w, x, w_at, K, wide, wide_at):
    if not _widens(w, x):
        return lambda w, x, w_at, K, wide, wide_at: (w, w_at)

    def widened(w, x, w_at, K, wide, wide_at):
        for k in range(len(w_at)):
            widen_f32(w, w_at[k], wide, wide_at[k], K // 16)
        return wide, wide_at
    return widened


@nb.njit(inline="always", cache=True, nogil=True)
def _bf16_bits(x):
    """x (n,) float32 holding bfloat16 values (rounded already) -> their bit patterns (int16)."""
    words = x.view(np.int32)
    bits = np.empty(x.size, np.int16)
    if x.size < PARALLEL_MIN:
        for i in range(x.size):
            bits[i] = np.int16(words[i] >> 16)
        return bits
    for i in nb.prange(x.size):
        bits[i] = np.int16(words[i] >> 16)
    return bits


def _dpbf16_products(w, xb, N, K, T, out):
    """A batch (T >= 2) with BF16 weights where _vector_bf16: tinyBLAS's single accumulator over
    steps of 32, in register tiles (4 weight rows by 6 activation rows, 2 by 4 under 8 rows);
    compiled for bfloat16 bits only."""


@overload(_dpbf16_products, inline="always")
def _dpbf16_products_impl(w, xb, N, K, T, out):
    if w.dtype != types.int16 or not GGML_AVX512_BF16:
        return lambda w, xb, N, K, T, out: None

    return lambda w, xb, N, K, T, out: _tiles(w, xb, N, K, T, out, dpbf16_lanes_4x6, dpbf16_lanes_2x4, 32)


def _holds_bf16_bits(w):
    """Whether w holds bfloat16 bit patterns (int16), known when compiling."""


@overload(_holds_bf16_bits)
def _holds_bf16_bits_impl(w):
    is_bits = w.dtype == types.int16
    return lambda w: is_bits


def _weight(w, i):
    """w[i] as float32: the weights are kept as their bit patterns, F16 as uint16 (half F32's
    bytes), BF16 as int16 (numpy has no bfloat16, and uint16 means float16 here), F32 as uint32."""


@overload(_weight, inline="always")
def _weight_impl(w, i):
    if w.dtype == types.uint16:
        return lambda w, i: f16_value(w[i])
    if w.dtype == types.int16:
        return lambda w, i: float32_from_bits(np.int32(np.uint16(w[i])) << 16)
    if w.dtype == types.uint32:
        return lambda w, i: float32_from_bits(np.int32(w[i]))
    return lambda w, i: w[i]


@nb.njit(inline="always", cache=True, nogil=True)
def _hsum(acc, at, lanes):
    return _reduce16(acc, at) if lanes == 16 else _reduce8(acc, at)


@nb.njit(inline="always", cache=True, nogil=True)
def _tiny_blas_dot(w, w_at, x, x_at, K, acc):
    acc[:LANES] = 0
    for l in range(0, K, LANES):
        for j in range(min(LANES, K - l)):
            acc[j] = fma(_weight(w, w_at + l + j), x[x_at + l + j], acc[j])
    return _hsum(acc, 0, LANES)


@nb.njit(inline="always", cache=True, nogil=True)
def _vec_dot(w, w_at, x, x_at, K, f16):
    n_simd = K - K % F16_DOT_STEP
    if F16_DOT_STEP == 64:
        total = dot_f16_64_ahead(w, w_at, x, x_at, n_simd)
    else:
        total = dot_f16_32_ahead(w, w_at, x, x_at, n_simd)
    if f16:  # ggml_float sum of the rest
        wide = np.float64(total)
        for i in range(n_simd, K):
            wide += np.float64(_weight(w, w_at + i) * x[x_at + i])
        return np.float32(wide)
    for i in range(n_simd, K):
        total += _weight(w, w_at + i) * x[x_at + i]
    return total


@nb.njit(inline="always", cache=True, nogil=True)
def _vec_dot_bf16(w, w_at, x, x_at, K, acc):
    """ggml_vec_dot_bf16: AVX2 c1..c4 of 8 lanes (AVX-512: c1, c2 of 16) over steps of 32."""
    acc[:] = 0
    n_parts = 2 if LANES == 16 else 4
    i = 0
    while i + 32 <= K:
        for c in range(n_parts):
            for j in range(LANES):
                at = i + c * LANES + j
                acc[c * LANES + j] = acc[c * LANES + j] + _weight(w, w_at + at) * x[x_at + at]
        i += 32
    if LANES == 16:
        wide = np.float64(_reduce16(acc, 0)) + np.float64(_reduce16(acc, 16))
    else:
        wide = np.float64(_bf16_avx2_sum(acc))
    for k in range(i, K):
        wide += np.float64(_weight(w, w_at + k) * x[x_at + k])
    return np.float32(wide)


@nb.njit(inline="always", cache=True, nogil=True)
def _bf16_avx2_sum(acc):
    """ggml_vec_dot_bf16's AVX2 reduction of its accumulators c1..c4 (acc[0:32], 8 lanes each):
    (c1 + c3) + (c2 + c4), then the 8 lanes summed (_reduce8). Overwrites acc[0:8]."""
    for j in range(8):
        acc[j] = (acc[j] + acc[16 + j]) + (acc[8 + j] + acc[24 + j])
    return _reduce8(acc, 0)


@nb.njit(inline="always", cache=True, nogil=True)
def _dpbf16(acc, w, w_at, x, x_at, step, K):
    """acc (16,) after one vdpbf16ps over the 32 values from `step` (zero past K)."""
    for j in range(16):
        for e in (step + 2 * j + 1, step + 2 * j):
            we, xe = (_weight(w, w_at + e), x[x_at + e]) if e < K else (np.float32(0.0), np.float32(0.0))
            a = fma(we, xe, acc[j])
            acc[j] = a if abs(a) >= _FLT_MIN else a * np.float32(0.0)  # FTZ, keeping the sign


@nb.njit(inline="always", cache=True, nogil=True)
def _dpbf16_dot(w, w_at, x, x_at, K, acc, n_acc, width):
    """BF16 with AVX512_BF16: n_acc accumulators of 16 lanes over steps of `width` (32 per
    accumulator) (tinyBLAS: 1 and 32, every step; vec_dot: 2 and 64, whole steps only, the rest
    in double); each reduced, in double."""
    acc[:16 * n_acc] = 0
    i = 0
    while i < K and (n_acc == 1 or i + width <= K):
        for c in range(n_acc):
            _dpbf16(acc[16 * c:], w, w_at, x, x_at, i + 32 * c, K)
        i += width
    if n_acc == 1:
        return _reduce16(acc, 0)
    wide = np.float64(_reduce16(acc, 0)) + np.float64(_reduce16(acc, 16))
    for k in range(i, K):
        wide += np.float64(_weight(w, w_at + k) * x[x_at + k])
    return np.float32(wide)
