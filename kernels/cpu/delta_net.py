"""The recurrent layers' kernels (Qwen3.5's gated delta net, LFM2's short convolution), as
ggml's CPU ops compute them.

Shapes: T tokens in the batch, C convolution channels (the q, k and v projections side by side),
Kc the convolution's width, Hk key heads and Hv value heads of S values each (keys and values
have the same head size), E embedding width.

The state a sequence carries from token to token, per recurrent layer:
    conv  (Kc - 1, C)   the last Kc - 1 inputs of the channels' causal convolution, oldest first
    ssm   (Hv, S, S)    each value head's state matrix, transposed as ggml keeps it: ssm[h, j, i]
                        is S[i][j], so that row j (column j of S) is contiguous
The kernels take a batch's sequences' states stacked (n_seq, ...) and each row's sequence.
"""
import math

import numba as nb
import numpy as np

from .fma import fma
from .ops import PARALLEL_MIN_ROWS, rmsnorm, v_expf
from .simd import dot_f16_32, dot_f16_64, swiglu_16
from .target import GGML_AVX512, SIMD_WIDTH

_PAR = dict(parallel=True, cache=True, nogil=True)
_SER = dict(cache=True, nogil=True)
_ONE = np.float32(1.0)
DOT_STEP = 64 if GGML_AVX512 else 32  # ggml_vec_dot_f32's values a step (GGML_F32_STEP)


@nb.njit(inline="always", cache=True, nogil=True)
def _dot(a, a_at, b, b_at, n):
    """ggml_vec_dot_f32 of a[a_at:a_at+n] and b[b_at:b_at+n] (1-D float32): its SIMD
    accumulators over whole steps, then the rest one by one (fused, as compiled)."""
    n_simd = n - n % DOT_STEP
    if DOT_STEP == 64:
        total = dot_f16_64(a, a_at, b, b_at, n_simd)
    else:
        total = dot_f16_32(a, a_at, b, b_at, n_simd)
    for i in range(n_simd, n):
        total = fma(a[a_at + i], b[b_at + i], total)
    return total


@nb.njit(inline="always", cache=True, nogil=True)
def _silu_row(row, ones):
    """ggml_vec_silu_f32 of row (1-D) in place: SIMD_WIDTH at a time with ggml_v_expf, the rest
    with libm's expf. ones: at least as long as row, all 1 (AVX-512: swiglu_16's vector step
    times 1, which changes nothing)."""
    n = row.shape[0]
    n_simd = n - n % SIMD_WIDTH
    if GGML_AVX512:
        for j in range(0, n_simd, SIMD_WIDTH):
            swiglu_16(row, ones, row, j)
    else:  # branch-free: the loop vectorizes
        for j in range(n_simd):
            v = row[j]
            row[j] = v / (_ONE + v_expf(np.float32(0.0) - v))
    for j in range(n_simd, n):
        v = row[j]
        row[j] = v / (_ONE + np.float32(math.exp(-v)))


# ggml_ssm_conv's sum over a channel's Kc products, as gcc vectorizes it: whole vectors of
# products (AVX-512: 16, then 8; AVX2: 8, then 4) multiplied, then added one by one in order;
# the products left over fused into the sum (vfmadd231ss). Qwen3.5's Kc = 4: one unfused vector
# of 4 on AVX2, four fmas on AVX-512.
CONV_VECTORS = (16, 8) if GGML_AVX512 else (8, 4)


@nb.njit(inline="always", cache=True, nogil=True)
def _unfused_taps(Kc):
    """How many of a channel's Kc products ggml's build sums unfused (the rest fused)."""
    big, small = CONV_VECTORS
    n = Kc - Kc % big
    if Kc - n >= small:
        n += small
    return n


@nb.njit(inline="always", cache=True, nogil=True)
def _conv_row(x, conv_state, taps, t, ones, out, silu):
    """Row t of causal_conv: each tap's inputs across the channels, times its weights."""
    Kc = taps.shape[0]
    unfused = _unfused_taps(Kc)
    row = out[t]
    row[:] = 0
    for i in range(Kc):
        at = t + i  # in the channels' inputs: the state's, then this batch's
        inputs = conv_state[at] if at < Kc - 1 else x[at - (Kc - 1)]
        tap = taps[i]
        if i < unfused:
            for c in range(row.shape[0]):
                row[c] = row[c] + inputs[c] * tap[c]
        else:
            for c in range(row.shape[0]):
                row[c] = fma(inputs[c], tap[c], row[c])
    if silu:
        _silu_row(row, ones)


@nb.njit(**_PAR)
def _conv_parallel(x, conv_state, taps, ones, out, silu):
    for t in nb.prange(x.shape[0]):
        _conv_row(x, conv_state, taps, t, ones, out, silu)


@nb.njit(**_SER)
def causal_conv(x, conv_states, weights, row_seq, silu):
    """The causal convolution of each channel over its last Kc inputs (ggml_ssm_conv: a float
    sum from 0, product by product, fused or not as compiled: CONV_VECTORS), then, if silu, SiLU
    (ggml_silu, row by row); each sequence's state takes its last Kc - 1 inputs. x (T, C) ->
    (T, C); conv_states (n_seq, Kc - 1, C) in place, oldest first; weights (C*Kc,), the (C, Kc)
    tensor's values; row_seq (T,) each row's sequence, a sequence's rows in order."""
    T, C = x.shape
    Kc = weights.size // C
    taps = weights.reshape(C, Kc).T.copy()  # (Kc, C): each tap's weights across the channels
    ones = np.ones(C, np.float32)
    out = np.empty_like(x)
    if conv_states.shape[0] > 1:  # rows of several sequences (the scheduler's): one at a time
        for t in range(T):
            state = conv_states[row_seq[t]]
            _conv_row(x[t:t + 1], state, taps, 0, ones, out[t:t + 1], silu)
            for i in range(Kc - 2):
                state[i] = state[i + 1]
            state[Kc - 2] = x[t]
        return out
    conv_state = conv_states[0]
    if T >= PARALLEL_MIN_ROWS:
        _conv_parallel(x, conv_state, taps, ones, out, silu)
    else:  # a few rows: a fork/join would cost more than the work
        for t in range(T):
            _conv_row(x, conv_state, taps, t, ones, out, silu)
    if T >= Kc - 1:
        conv_state[:] = x[T - (Kc - 1):]
    else:  # the state's newest inputs, then the batch's
        conv_state[:Kc - 1 - T] = conv_state[T:].copy()
        conv_state[Kc - 1 - T:] = x
    return out


@nb.njit(**_SER)
def short_conv(bcx, conv_states, weights, row_seq):
    """LFM2's gated short convolution: bcx (T, 3E), the in-projection's b | c | x, ->
    c * conv(b * x) (T, E), the convolution without SiLU (conv_states (n_seq, Kc - 1, E))."""
    E = bcx.shape[1] // 3
    bx = bcx[:, :E] * bcx[:, 2 * E:]
    return bcx[:, E:2 * E] * causal_conv(bx, conv_states, weights, row_seq, False)


@nb.njit(inline="always", cache=True, nogil=True)
def _l2_row(x, t, at, n, eps, scale):
    """ggml_rms_norm(x, eps) of x[t, at:at+n] (a float64 sum of squares), then ggml_scale."""
    total = 0.0
    for j in range(n):
        v = x[t, at + j]
        total += np.float64(v * v)
    mean = np.float32(total / n)
    inv = _ONE / np.float32(math.sqrt(mean + eps))
    for j in range(n):
        x[t, at + j] = (x[t, at + j] * inv) * scale


@nb.njit(**_SER)
def l2_heads(x, at, n_heads, S, eps):
    """Qwen3.5's L2 norm of each head of x[:, at:at + n_heads*S] in place: rms_norm with
    eps / S, times 1/sqrt(S) (float32, as llama.cpp's build_gdn_l2_norm)."""
    eps_n = np.float32(np.float32(eps) / np.float32(S))
    scale = _ONE / np.float32(math.sqrt(np.float32(S)))
    for t in range(x.shape[0]):
        for h in range(n_heads):
            _l2_row(x, t, at + h * S, S, eps_n, scale)


@nb.njit(inline="always", cache=True, nogil=True)
def softplus(x):
    """ggml_compute_softplus_f32: x past 20 as it is, else logf(1 + expf(x))."""
    return x if x > np.float32(20.0) else np.float32(math.log(_ONE + np.float32(math.exp(x))))


@nb.njit(**_SER)
def decay_and_beta(alpha, beta, dt_bias, a):
    """g = softplus(alpha + dt_bias) * a (ggml_softplus: x past 20 as it is) and
    beta = sigmoid(beta), both (T, Hv) in place."""
    for t in range(alpha.shape[0]):
        for h in range(alpha.shape[1]):
            alpha[t, h] = softplus(alpha[t, h] + dt_bias[h]) * a[h]
            beta[t, h] = _ONE / (_ONE + np.float32(math.exp(-beta[t, h])))


@nb.njit(**_PAR)
def gated_delta_net(qkv, q_at, k_at, v_at, g, beta, states, row_seq, n_k_heads, S):
    """ggml_gated_delta_net, one token after the other, each value head on its own thread.
    Per token: state *= exp(g); delta = (v - S^T k) * beta; S += k (x) delta; out = S^T q / sqrt(S).
    qkv (T, C): q (Hk heads), k (Hk) and v (Hv) from columns q_at, k_at, v_at; value head h
    reads key head h % Hk. g, beta (T, Hv); states (n_seq, Hv, S, S) in place, row t's that of
    sequence row_seq[t]. -> out (T, Hv*S)."""
    T = qkv.shape[0]
    Hv = states.shape[1]
    out = np.empty((T, Hv * S), np.float32)
    scale = _ONE / np.float32(math.sqrt(np.float32(S)))
    for h in nb.prange(Hv):
        kh = h % n_k_heads
        for t in range(T):
            decay = np.float32(math.exp(g[t, h]))
            k = qkv[t, k_at + kh * S:k_at + kh * S + S]
            q = qkv[t, q_at + kh * S:q_at + kh * S + S]
            v = qkv[t, v_at + h * S:v_at + h * S + S]
            b = beta[t, h]
            # ggml's passes (scale all, delta from each row, update all, read each row) touch
            # row j only for delta[j], out[j]: here one row at a time, while it is in L1
            state = states[row_seq[t], h]
            for j in range(S):
                row = state[j]
                for i in range(S):
                    row[i] *= decay
                d = (v[j] - _dot(row, 0, k, 0, S)) * b
                for i in range(S):
                    row[i] = fma(k[i], d, row[i])
                out[t, h * S + j] = _dot(row, 0, q, 0, S) * scale
    return out


@nb.njit(**_SER)
def gated_norm(x, weight, z, eps, n_heads, S):
    """RMS norm of each head of x (T, Hv*S) times weight (S,), times SiLU(z) (ggml_silu over
    rows of S values): Qwen3.5's gated output norm, in place of x."""
    T = x.shape[0]
    gate = z.copy().reshape(T * n_heads, S)
    ones = np.ones(S, np.float32)
    for r in range(T * n_heads):
        _silu_row(gate[r], ones)
    rows = x.reshape(T * n_heads, S)
    rmsnorm(rows, weight, eps, rows)  # ggml_rms_norm, then ggml_mul by the weight
    rows *= gate
    return x


@nb.njit(**_SER)
def sigmoid_gated(x, gate, n_heads, D):
    """x (T, H*D) times sigmoid of the gate half of each head of gate (T, H*2D): columns
    h*2D + D .. h*2D + 2D (ggml_sigmoid: 1 / (1 + expf(-g)))."""
    for t in range(x.shape[0]):
        for h in range(n_heads):
            for d in range(D):
                g = gate[t, h * 2 * D + D + d]
                x[t, h * D + d] = x[t, h * D + d] * (_ONE / (_ONE + np.float32(math.exp(-g))))
    return x
