"""Device helpers shared by the kernels.

All of them also run under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1), which executes kernels
as Python with NumPy scalars: float16 only through NumPy casts, and no warp shuffles, so
warp_sum has a shared-memory twin of its shuffle tree for the simulator (same additions in the
same order). Every thread of the block must call the reducing helpers.
"""
import math

import numpy as np
from numba import cuda
from numba.core import config

from .registry import device

NEG_INF = np.float32(-np.inf)
WARP = 32
FULL_MASK = 0xFFFFFFFF
SIMULATOR = bool(config.ENABLE_CUDASIM)  # a compile-time constant in the kernels

# the largest thread block any kernel here is launched with (sizes of shared scratch arrays)
MAX_THREADS = 256


@device
def f16_round(x):
    """float32 -> the float32 value of float16(x), round to nearest even (a cvt.rn.f16.f32)."""
    return np.float32(np.float16(x))


@device
def fma32(a, b, c):
    """fma(a, b, c) of float32 values, one rounding. The simulator's cuda.fma rounds the
    product first; there the exact product (in float64) plus c is rounded to float64, then to
    float32 (a second rounding that changes the result only at rare exact ties)."""
    if SIMULATOR:
        return np.float32(np.float64(a) * np.float64(b) + np.float64(c))
    return cuda.fma(np.float32(a), np.float32(b), np.float32(c))


@device
def signed_byte(word, j):
    """Byte j (0 = lowest) of an int32 word, as a signed int8 value."""
    b = (word >> (8 * j)) & 255
    return b - ((b & 128) << 1)


@device
def dot4(a, b):
    """Sum of the products of the 4 signed bytes of a and b (what the dp4a instruction does)."""
    total = 0
    for j in range(4):
        total += signed_byte(a, j) * signed_byte(b, j)
    return total


@device
def pack4(v0, v1, v2, v3):
    """Four int8 values -> one int32 word, v0 in the lowest byte (little-endian, as NumPy's view)."""
    return (v0 & 255) | ((v1 & 255) << 8) | ((v2 & 255) << 16) | (v3 << 24)


@device
def warp_sum(value, scratch):
    """Sum of a float32 over the 32 lanes (threadIdx.x) of each warp, valid in lane 0.

    On the GPU a shuffle tree; under the simulator (no shuffles) the same tree through scratch,
    a shared float32 (blockDim.y, WARP) array with one row per warp (threadIdx.y)."""
    if SIMULATOR:
        lane = cuda.threadIdx.x
        row = cuda.threadIdx.y
        scratch[row, lane] = value
        cuda.syncthreads()
        offset = WARP // 2
        while offset > 0:
            if lane < offset:
                scratch[row, lane] += scratch[row, lane + offset]
            cuda.syncthreads()
            offset //= 2
        total = scratch[row, 0]
        cuda.syncthreads()
        return total
    offset = WARP // 2
    while offset > 0:
        value += cuda.shfl_down_sync(FULL_MASK, value, offset)
        offset //= 2
    return value


@device
def block_sum_f64(value, scratch):
    """Sum of `value` over the 1-D block (blockDim.x a power of two); scratch: shared float64
    (MAX_THREADS,). Returns the total in every thread."""
    tid = cuda.threadIdx.x
    scratch[tid] = value
    cuda.syncthreads()
    step = cuda.blockDim.x // 2
    while step > 0:
        if tid < step:
            scratch[tid] += scratch[tid + step]
        cuda.syncthreads()
        step //= 2
    total = scratch[0]
    cuda.syncthreads()  # scratch may be reused right after
    return total


@device
def row_inv_rms(x, row, eps, scratch):
    """1 / sqrt(mean(x[row]^2) + eps) as ggml_rms_norm: squares summed in float64, the rest in float32."""
    width = x.shape[1]
    total = 0.0
    for j in range(cuda.threadIdx.x, width, cuda.blockDim.x):
        v = x[row, j]
        total += np.float64(v * v)
    total = block_sum_f64(total, scratch)
    mean = np.float32(total / width)
    return np.float32(1.0) / np.float32(math.sqrt(mean + eps))


def pow2_threads(work_items: int, lo: int = 32, hi: int = 128) -> int:
    """Host side: a power-of-two block size in [lo, hi] for a block that loops over work_items."""
    n = lo
    while n < work_items and n < hi:
        n *= 2
    return n
