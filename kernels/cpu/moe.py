"""The mixture-of-experts feed-forward (llama.cpp's build_moe_ffn with a softmax router), on the CPU.

An expert tensor (ffn_gate_exps, ffn_up_exps, ffn_down_exps: one matrix per expert, stacked) is
held as `stacked` Weights: every array of a Weights with a leading expert axis (n_exp, ...),
the scalars shared. `expert(stacked, e)` is expert e's Weights, views into them, so the products
are the usual ones. llama.cpp's CPU mul_mat_id multiplies the tokens routed to an expert as one
product (vec_dot, or from 8 tokens on the tiled K-quant kernel), a repacked expert a token at
a time (its gemv): those views are marked row_by_row (weights.stack_experts).

Shapes: T tokens, E embedding width, F an expert's width, X experts, K experts used a token.
"""
import math

import numba as nb
import numpy as np

from .attention import _reduce8
from .ops import v_expf
from .simd import exp_sum_rows, exp_sum_rows8
from .target import GGML_AVX512

_SER = dict(cache=True, nogil=True)
WEIGHT_SUM_MIN = np.float32(6.103515625e-5)  # build_moe_ffn's clamp of the weights' sum


@nb.njit(inline="always", cache=True, nogil=True)
def expert(stacked, e):
    """Expert e's plain Weights tuple (kernels/cpu/layers.py's fields) from stacked ones."""
    return (stacked[0][e], stacked[1][e], stacked[2][e], stacked[3], stacked[4], stacked[5][e], stacked[6],
            stacked[7], stacked[8], stacked[9], stacked[10][e], stacked[11], stacked[12], stacked[13], stacked[14])


@nb.njit(**_SER)
def softmax_rows(logits):
    """ggml_soft_max of each row (T, X) in place: the row's max; exp(x - max) with ggml_v_expf
    over whole SIMD vectors (their sums added in double), libm's expf for the rest; each value
    times (float) 1/sum."""
    T, n = logits.shape
    for t in range(T):
        row = logits[t]
        top = np.float32(-np.inf)
        for i in range(n):
            top = max(top, row[i])
        i = 16 * (n // 16)
        if GGML_AVX512:
            total = exp_sum_rows(row, 0, top, n // 16)
        else:
            total = exp_sum_rows8(row, 0, top, n // 16)
            if n - i >= 8:  # one more vector of 8
                for j in range(i, i + 8):
                    row[j] = v_expf(row[j] - top)
                total += np.float64(_reduce8(row, i))  # ggml_vec_soft_max_f32's AVX2 hsum
                i += 8
        for j in range(i, n):
            row[j] = np.float32(math.exp(row[j] - top))
            total += np.float64(row[j])
        scale = np.float32(1.0 / total)
        for j in range(n):
            row[j] *= scale
    return logits


@nb.njit(**_SER)
def route(probs, n_used, norm_w, w_scale):
    """Each token's experts (T, K), in ggml_argsort_top_k's order (descending probability), and
    their weights (T, K): the probabilities, divided by their sum (in double, clamped) where
    norm_w, scaled by w_scale unless it is 0 or 1."""
    T = probs.shape[0]
    chosen = np.empty((T, n_used), np.int64)
    weights = np.empty((T, n_used), np.float32)
    for t in range(T):
        order = np.argsort(-probs[t], kind="mergesort")
        total = 0.0
        for k in range(n_used):
            chosen[t, k] = order[k]
            weights[t, k] = probs[t, order[k]]
            total += np.float64(weights[t, k])
        if norm_w:
            s = max(np.float32(total), WEIGHT_SUM_MIN)
            for k in range(n_used):
                weights[t, k] = weights[t, k] / s
        if w_scale != 0 and w_scale != 1:
            for k in range(n_used):
                weights[t, k] = weights[t, k] * w_scale
    return chosen, weights


@nb.njit(**_SER)
def tokens_of(chosen, e):
    """The (token, slot) pairs routed to expert e: (n, 2)."""
    T, K = chosen.shape
    n = 0
    for t in range(T):
        for k in range(K):
            if chosen[t, k] == e:
                n += 1
    pairs = np.empty((n, 2), np.int64)
    n = 0
    for t in range(T):
        for k in range(K):
            if chosen[t, k] == e:
                pairs[n, 0], pairs[n, 1] = t, k
                n += 1
    return pairs


@nb.njit(**_SER)
def add_experts(outs):
    """The experts' weighted outputs (T, K, E) added in top-k order (ggml_add of the views)."""
    total = outs[:, 0, :].copy()
    for k in range(1, outs.shape[1]):
        total = total + outs[:, k, :]
    return total
