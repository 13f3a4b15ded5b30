"""Element-wise kernels (norms, RoPE, activations, the KV store), written to reproduce ggml's CPU
arithmetic. Attention is in attention.py.

Shapes: T tokens in the batch, E embedding width, H query heads, Hkv key/value heads,
D head dimension, S cache slots.
"""
import math

import numba as nb
import numpy as np

from .f16 import f16_bits, f16_round, float32_bits, float32_from_bits
from .fma import fma
from .simd import swiglu_16
from .target import GGML_AVX512, GGML_AVX512_BF16, SIMD_WIDTH
from .unpack import F16_TO_F32

_PAR = dict(parallel=True, cache=True, nogil=True)
_SER = dict(cache=True, nogil=True)

# the threads a parallel region may run, read once: calling nb.get_num_threads() in compiled code
# would keep Numba from caching it (with fewer threads set at run time, the extra parts run in turn)
THREADS = max(1, nb.config.NUMBA_NUM_THREADS)

GELU_COEF_A = np.float32(0.044715)
SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)


# Each element-wise op has a row function and two drivers: a parallel one for batches and a
# serial one for a few rows (decode), where starting threads would cost more than the work.
PARALLEL_MIN_ROWS = 8
PARALLEL_MIN_NORM_ROWS = 32  # rmsnorm takes rows four at a time (_rmsnorm_rows)


@nb.njit(inline="always", cache=True, nogil=True)
def _scale_row(x, i, weight, total, eps, out):
    # as ggml_rms_norm after its sum of squares: scale = 1/sqrtf(mean + eps) in float32
    mean = np.float32(total / x.shape[1])
    scale = np.float32(1.0) / np.float32(math.sqrt(mean + eps))
    for j in range(x.shape[1]):
        out[i, j] = (x[i, j] * scale) * weight[j]


@nb.njit(inline="always", cache=True, nogil=True)
def _rmsnorm_rows(x, i, weight, eps, out):
    """Rows i..i+3 (or row i alone, where fewer are left) of rmsnorm. ggml sums a row's squares
    in float64 in column order, a chain of dependent adds: four rows' chains side by side take
    about the time of one."""
    w = x.shape[1]
    if i + 4 > x.shape[0]:
        total = 0.0
        for j in range(w):
            v = x[i, j]
            total += np.float64(v * v)
        _scale_row(x, i, weight, total, eps, out)
        return
    t0 = t1 = t2 = t3 = 0.0
    for j in range(w):
        v0, v1, v2, v3 = x[i, j], x[i + 1, j], x[i + 2, j], x[i + 3, j]
        t0 += np.float64(v0 * v0)
        t1 += np.float64(v1 * v1)
        t2 += np.float64(v2 * v2)
        t3 += np.float64(v3 * v3)
    _scale_row(x, i, weight, t0, eps, out)
    _scale_row(x, i + 1, weight, t1, eps, out)
    _scale_row(x, i + 2, weight, t2, eps, out)
    _scale_row(x, i + 3, weight, t3, eps, out)


@nb.njit(**_PAR)
def _rmsnorm_parallel(x, weight, eps, out):
    n = x.shape[0] // 4
    for g in nb.prange(n + x.shape[0] % 4):  # groups of 4 rows, then the last rows one by one
        _rmsnorm_rows(x, 4 * g if g < n else 4 * n + g - n, weight, eps, out)


@nb.njit(**_SER)
def rmsnorm(x, weight, eps, out):
    """out (T, W) = x / rms(x) * weight over the last axis; x may be (T, W) or (T*heads, W)."""
    if x.shape[0] >= PARALLEL_MIN_NORM_ROWS:
        _rmsnorm_parallel(x, weight, eps, out)
    else:
        i = 0
        while i < x.shape[0]:
            _rmsnorm_rows(x, i, weight, eps, out)
            i += 4 if i + 4 <= x.shape[0] else 1


@nb.njit(inline="always", cache=True, nogil=True)
def _yarn_ramp(low, high, i0):
    """ggml's rope_yarn_ramp: 1 below the low correction dim, 0 above the high one."""
    y = np.float32(np.float32(np.float32(i0 // 2) - low) / max(np.float32(0.001), np.float32(high - low)))
    return np.float32(np.float32(1.0) - min(np.float32(1.0), max(np.float32(0.0), y)))


@nb.njit(**_SER)
def yarn_corr_dims(n_dims, n_ctx_orig, freq_base, beta_fast, beta_slow):
    """ggml_rope_yarn_corr_dims: the first and last dims YaRN blends (float32, as ggml)."""
    two_pi = np.float32(2.0) * np.float32(math.pi)
    denom = np.float32(2.0) * np.float32(math.log(np.float32(freq_base)))
    lo = np.float32(n_dims) * np.float32(math.log(np.float32(n_ctx_orig) / (np.float32(beta_fast) * two_pi))) / denom
    hi = np.float32(n_dims) * np.float32(math.log(np.float32(n_ctx_orig) / (np.float32(beta_slow) * two_pi))) / denom
    return max(np.float32(0.0), np.float32(math.floor(lo))), min(np.float32(n_dims - 1), np.float32(math.ceil(hi)))


@nb.njit(**_SER)
def yarn_attn_factor(freq_scale, log_mul):
    """llama_context's yarn_attn_factor for YaRN at freq_scale (float32, fused as compiled):
    get_mscale(1/freq_scale, 1), over get_mscale(1/freq_scale, log_mul) where the file sets a
    YaRN log multiplier (log_mul; 0: none), times 1/(1 + 0.1 log(1/freq_scale))."""
    factor = np.float32(1.0) / np.float32(freq_scale)
    log_f = np.float32(math.log(factor))
    mscale = fma(np.float32(0.1), log_f, np.float32(1.0)) if factor > 1 else np.float32(1.0)
    if log_mul != 0 and factor > 1:
        mscale = mscale / fma(np.float32(np.float32(0.1) * np.float32(log_mul)), log_f, np.float32(1.0))
    return mscale * (np.float32(1.0) / fma(np.float32(0.1), log_f, np.float32(1.0)))


@nb.njit(**_SER)
def rope_angles(positions, n_dims, freq_base, freq_scale, factors, ext_factor, corr_low, corr_high, mscale,
                cos_out, sin_out):
    """cos/sin (T, n_dims/2) as ggml_rope_cache_init with rope_yarn: theta multiplied by
    theta_scale per pair in f32, divided by the pair's frequency factor (factors (n_dims/2,),
    or empty: none), interpolated by freq_scale, blended with YaRN's ramp where ext_factor is
    not 0, and both scaled by mscale (the attention factor)."""
    theta_scale = np.float32(np.float32(freq_base) ** np.float32(-2.0 / n_dims))
    m = np.float32(mscale)
    if ext_factor != 0:  # YaRN's magnitude correction (fused: 1 + 0.1 * log(1/scale))
        m = m * fma(np.float32(0.1), np.float32(math.log(np.float32(1.0) / freq_scale)), np.float32(1.0))
    for t in range(positions.shape[0]):
        theta = np.float32(positions[t])
        for i in range(n_dims // 2):
            extrap = np.float32(theta / factors[i]) if factors.size else theta
            angle = np.float32(np.float32(freq_scale) * extrap)
            if ext_factor != 0:
                mix = np.float32(_yarn_ramp(corr_low, corr_high, 2 * i) * np.float32(ext_factor))
                angle = fma(angle, np.float32(np.float32(1.0) - mix), np.float32(extrap * mix))
            cos_out[t, i] = np.float32(math.cos(angle)) * m
            sin_out[t, i] = np.float32(math.sin(angle)) * m
            theta = np.float32(theta * theta_scale)


@nb.njit(**_SER)
def rope(x, n_heads, head_dim, n_dims, cos_t, sin_t, neox):
    """Rotate x (T, n_heads*head_dim) in place; neox pairs (i, i+n_dims/2), else (2i, 2i+1)."""
    T = x.shape[0]
    half = n_dims // 2
    for t in range(T):
        for h in range(n_heads):
            base = h * head_dim
            for i in range(half):
                if neox:
                    a, b = base + i, base + i + half
                else:
                    a, b = base + 2 * i, base + 2 * i + 1
                c, s = cos_t[t, i], sin_t[t, i]
                x0, x1 = x[t, a], x[t, b]
                x[t, a] = fma(x0, c, -(x1 * s))  # as compiled: the first product fused
                x[t, b] = fma(x0, s, x1 * c)


# ggml_v_expf (AVX-512): exp(x) = 2^n * p(b), n = round(x / ln 2), b = x - n ln 2 (two parts)
_EXP_ROUND = np.float32(float.fromhex("0x1.8p23"))  # adding it rounds to an integer
_LOG2E = np.float32(float.fromhex("0x1.715476p+0"))
_LN2_HI = np.float32(float.fromhex("0x1.62e4p-1"))
_LN2_LO = np.float32(float.fromhex("0x1.7f7d1cp-20"))
_EXP_C1 = np.float32(float.fromhex("0x1.ffffecp-1"))
_EXP_C2 = np.float32(float.fromhex("0x1.fffdb6p-2"))
_EXP_C3 = np.float32(float.fromhex("0x1.555e66p-3"))
_EXP_C4 = np.float32(float.fromhex("0x1.573e2ep-5"))
_EXP_C5 = np.float32(float.fromhex("0x1.0e4020p-7"))


def ggml_build(bf16: bool = False) -> str:
    """The name of ggml's build for this CPU that minillm computes as (reference data are kept per
    build): "avx2" or "avx512", and with bf16, "avx512_bf16" where BF16 products differ too."""
    if not GGML_AVX512:
        return "avx2"
    return "avx512_bf16" if bf16 and GGML_AVX512_BF16 else "avx512"


_AVX2_ONE_BITS = 0x3F800000          # the bits of 1.0f
_AVX2_SPECIAL_NEG = -0x7E000000      # 0x82000000 as int32


@nb.njit(inline="always", cache=True, nogil=True)
def v_expf(x):
    """ggml_v_expf, one lane, as ggml is built for this CPU (the exp of its SiLU and softmax)."""
    if GGML_AVX512:
        return v_expf_avx512(x)
    return v_expf_avx2(x)


@nb.njit(inline="always", cache=True, nogil=True)
def v_expf_avx2(x):
    """One lane of ggml_v_expf's AVX2 version: 2^n built in the exponent bits of z, the
    polynomial without its constant term, then fma(j, 2^n, 2^n); |n| > 126 through two
    factors. Branch-free (selects), so that loops over it vectorize."""
    z = fma(x, _LOG2E, _EXP_ROUND)
    n = z - _EXP_ROUND
    b = fma(-n, _LN2_LO, fma(-n, _LN2_HI, x))
    e = np.int32(np.int64(float32_bits(z)) << 23)
    k = float32_from_bits(np.int32(np.int64(e) + _AVX2_ONE_BITS))
    u = b * b
    j = fma(fma(fma(_EXP_C5, b, _EXP_C4), u, fma(_EXP_C3, b, _EXP_C2)), u, _EXP_C1 * b)
    g = np.int32(_AVX2_SPECIAL_NEG) if n <= 0 else np.int32(0)
    s1 = float32_from_bits(np.int32(np.int64(g) + 0x7F000000))
    s2 = float32_from_bits(np.int32(np.int64(e) - np.int64(g)))
    an = abs(n)
    special = s1 * s1 if an > np.float32(192.0) else fma(s2, j, s2) * s1
    return special if an > np.float32(126.0) else fma(j, k, k)


@nb.njit(inline="always", cache=True, nogil=True)
def v_expf_avx512(x):
    """ggml_v_expf, one lane of the AVX-512 version."""
    z = fma(x, _LOG2E, _EXP_ROUND)
    n = z - _EXP_ROUND
    b = fma(-n, _LN2_LO, fma(-n, _LN2_HI, x))
    u = b * b
    j = fma(fma(fma(_EXP_C5, b, _EXP_C4), u, fma(_EXP_C3, b, _EXP_C2)), u, fma(_EXP_C1, b, np.float32(1.0)))
    if abs(n) > np.float32(192.0):
        return np.float32(0.0) if n <= 0 else np.float32(np.inf)
    e = np.int32(n)
    if e >= -126 and e <= 127:  # scalef(j, n): one exact multiply by the float 2^n
        return j * float32_from_bits((e + np.int32(127)) << np.int32(23))
    return np.float32(math.ldexp(np.float64(j), int(n)))


@nb.njit(inline="always", cache=True, nogil=True)
def _swiglu_row(gate, up, t, out):
    # ggml_vec_swiglu_f32: SIMD_WIDTH at a time with ggml_v_expf, the rest with libm's expf
    n = gate.shape[1]
    n16 = n - n % SIMD_WIDTH
    if GGML_AVX512:  # 16 lanes a step (the scalar steps below do not vectorize)
        g_row, u_row, o_row = gate[t], up[t], out[t]
        for j in range(0, n16, SIMD_WIDTH):
            swiglu_16(g_row, u_row, o_row, j)
    else:
        for j in range(n16):
            g = gate[t, j]
            out[t, j] = (g / (np.float32(1.0) + v_expf(np.float32(0.0) - g))) * up[t, j]
    for j in range(n16, n):
        g = gate[t, j]
        out[t, j] = (g / (np.float32(1.0) + np.float32(math.exp(-g)))) * up[t, j]


@nb.njit(**_PAR)
def _swiglu_parallel(gate, up, out):
    for t in nb.prange(gate.shape[0]):
        _swiglu_row(gate, up, t, out)


@nb.njit(**_SER)
def swiglu(gate, up, out):
    """out = silu(gate) * up (ggml_swiglu)."""
    if gate.shape[0] >= PARALLEL_MIN_ROWS:
        _swiglu_parallel(gate, up, out)
    else:
        for t in range(gate.shape[0]):
            _swiglu_row(gate, up, t, out)


@nb.njit(inline="always", cache=True)
def gelu_f32(x):
    # ggml_gelu_f32 as compiled (the compiler contracts 1 + (A*x)*x into an fma)
    inner = (SQRT_2_OVER_PI * x) * fma(GELU_COEF_A * x, x, np.float32(1.0))
    return (np.float32(0.5) * x) * (np.float32(1.0) + np.float32(math.tanh(inner)))


@nb.njit(cache=True)
def _gelu_table():
    """ggml_table_gelu_f16: float16 bits -> float16(gelu(value)), as float32 (65536,)."""
    table = np.empty(65536, np.float32)
    for bits in range(65536):
        table[bits] = f16_round(gelu_f32(F16_TO_F32[bits]))
    return table


GELU_F16 = _gelu_table()


@nb.njit(inline="always", cache=True, nogil=True)
def _geglu_row(gate, up, t, out):
    for j in range(gate.shape[1]):
        g = gate[t, j]
        if g <= np.float32(-10.0):
            out[t, j] = 0.0
        elif g >= np.float32(10.0):
            out[t, j] = g * up[t, j]
        else:  # ggml's table read by the float16 bits of g (one vcvtps2ph)
            out[t, j] = GELU_F16[f16_bits(g)] * up[t, j]


@nb.njit(**_PAR)
def _geglu_parallel(gate, up, out):
    for t in nb.prange(gate.shape[0]):
        _geglu_row(gate, up, t, out)


@nb.njit(**_SER)
def geglu(gate, up, out):
    """out = gelu(gate) * up as ggml_geglu with GGML_GELU_FP16: gelu read from an f16 table."""
    if gate.shape[0] >= PARALLEL_MIN_ROWS:
        _geglu_parallel(gate, up, out)
    else:
        for t in range(gate.shape[0]):
            _geglu_row(gate, up, t, out)


@nb.njit(**_SER)
def store_kv(k, v, slots, n_kv_heads, head_dim, kcache, vcache):
    """Write k, v (T, Hkv*D) into cache rows `slots` as float16 bit patterns, llama.cpp's F16 cache."""
    for t in range(k.shape[0]):
        s = slots[t]
        for h in range(n_kv_heads):
            for d in range(head_dim):
                kcache[s, h, d] = f16_bits(k[t, h * head_dim + d])
                vcache[s, h, d] = f16_bits(v[t, h * head_dim + d])


@nb.njit(**_PAR)
def add_inplace(x, y):
    """x += y."""
    T, E = x.shape
    for t in nb.prange(T):
        for j in range(E):
            x[t, j] += y[t, j]


@nb.njit(**_SER)
def top_k_indices(x, k):
    """Indices of the k largest values of x (in no particular order), in one pass: numpy's
    argpartition takes 2.5 ms on a 262,144-token vocabulary, this about 0.3 ms."""
    n = min(k, x.shape[0])
    idx = np.arange(n)
    val = x[:n].copy()
    worst = np.argmin(val) if n else 0
    for i in range(n, x.shape[0]):
        if x[i] > val[worst]:
            idx[worst] = i
            val[worst] = x[i]
            worst = np.argmin(val)
    return idx
