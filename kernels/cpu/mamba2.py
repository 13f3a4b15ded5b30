"""Mamba2's mixer (Granite 4.0-H's recurrent layers), as ggml's CPU ops compute it.

Shapes: T tokens, E embedding width, Hs SSM heads of P values (d_inner = Hs*P), G groups of
N state values (B and C per group; head h reads group h // (Hs/G)), C = d_inner + 2*G*N conv
channels (x | B | C), Kc the convolution's width.

The state a sequence carries, per Mamba2 layer:
    conv  (Kc - 1, C)   the last inputs of the causal convolution (delta_net.causal_conv's)
    ssm   (Hs, P, N)    each head's state, ggml's layout: row p of head h is contiguous
"""
import math

import numba as nb
import numpy as np

from .delta_net import _dot, _silu_row, causal_conv, softplus
from .fma import fma
from .ops import rmsnorm, swiglu

_PAR = dict(parallel=True, cache=True, nogil=True)
_SER = dict(cache=True, nogil=True)


@nb.njit(**_PAR)
def ssm_scan(xbc, dt, A, states, row_seq, n_group, N):
    """ggml_ssm_scan (Mamba2: a scalar decay per head), one token after the other, each head on
    its own thread. Per token and head: dA = exp(softplus(dt) * A); for each of its P rows
    state = fma(state, dA, B * (x * softplus(dt))) (gcc contracts ggml's mul, mul, add so),
    y = state . C (ggml_vec_dot_f32's sums).
    xbc (T, C) after the convolution; dt (T, Hs) with its bias; A (Hs,); states (n_seq, Hs,
    P, N) in place, row t's that of sequence row_seq[t]. -> y (T, Hs*P)."""
    T = xbc.shape[0]
    Hs, P = states.shape[1], states.shape[2]
    d_inner = Hs * P
    y = np.empty((T, d_inner), np.float32)
    for h in nb.prange(Hs):
        g = h // (Hs // n_group)
        b_at, c_at = d_inner + g * N, d_inner + n_group * N + g * N
        for t in range(T):
            soft = softplus(dt[t, h])
            decay = np.float32(math.exp(soft * A[h]))
            state = states[row_seq[t], h]
            for p in range(P):
                x_dt = xbc[t, h * P + p] * soft
                row = state[p]
                for i in range(N):  # SIMD steps and scalar loop alike compiled with the first product fused
                    row[i] = fma(row[i], decay, xbc[t, b_at + i] * x_dt)
                y[t, h * P + p] = _dot(row, 0, xbc[t], c_at, N)
    return y


@nb.njit(**_SER)
def mamba2(zxbcdt, conv_states, conv_w, conv_b, dt_b, A, D, norm_w, ssm_states, row_seq, n_group, N, eps):
    """The mixer after ssm_in: zxbcdt (T, 2*d_inner + 2*G*N + Hs) is z | x B C | dt. The
    convolution with its bias, then SiLU; the scan; y + x * D; y * SiLU(z) (ggml_swiglu_split,
    rows of P); the RMS norm of each group of d_inner/G values times its weights
    (norm_w (d_inner,)). -> (T, d_inner), ssm_out's input."""
    T = zxbcdt.shape[0]
    Hs = dt_b.size
    d_inner = norm_w.size
    P = d_inner // Hs
    C = d_inner + 2 * n_group * N
    xbc = causal_conv(zxbcdt[:, d_inner:d_inner + C].copy(), conv_states, conv_w, row_seq, False)
    xbc += conv_b
    ones = np.ones(C, np.float32)
    for t in range(T):
        _silu_row(xbc[t], ones)
    dt = zxbcdt[:, d_inner + C:d_inner + C + Hs] + dt_b
    y = ssm_scan(xbc, dt, A, ssm_states, row_seq, n_group, N)
    for t in range(T):
        for h in range(Hs):
            for p in range(P):
                y[t, h * P + p] = y[t, h * P + p] + xbc[t, h * P + p] * D[h]
    gated = np.empty((T * Hs, P), np.float32)
    swiglu(zxbcdt[:, :d_inner].copy().reshape(T * Hs, P), y.reshape(T * Hs, P), gated)
    size = d_inner // n_group
    groups = gated.reshape(T, n_group, size)
    out = np.empty((T, d_inner), np.float32)
    for g in range(n_group):
        rows = groups[:, g, :].copy()
        rmsnorm(rows, norm_w[g * size:(g + 1) * size].copy(), eps, rows)
        out[:, g * size:(g + 1) * size] = rows
    return out
