"""Building blocks that architectures compose inside one compiled function per layer, so a
decode step costs one Python -> Numba call per layer instead of one per operation.

A weight matrix travels as the fields of one `Weights` named tuple, of uniform type
(minillm/weights.py builds it), so one compiled layer serves every format mix; a layer's view of
its KV cache is a `KVView`. Both cross into compiled code as plain tuples (`plain`): Numba's
dispatcher reads a plain tuple's types in C but a named tuple's in Python, 3-4x the time of each
layer call (3.7 against 10-14 us for a layer's weights, measured). Compiled code unpacks them
into named locals, or reads one field by its index constant (W_KIND...); it does not build the
named tuples again (KVView(*kv) built inside `attend` left kv_pos unwritten here, Numba 0.68).
"""
import math
from typing import NamedTuple

import numba as nb
import numpy as np
from numba import types
from numba.extending import overload

from . import ops
from .attention_fns import call_attention
from .attention_q import hadamard_rotated, rotation_size, store_kv_quantized
from .f16 import f16_round
from .float_matmul import FLOAT_BF16, FLOAT_F16, FLOAT_F32, PARALLEL_MIN
from .float_products import call_product, call_rows3
from .delta_net import (causal_conv, decay_and_beta, gated_delta_net, gated_norm, l2_heads, short_conv,  # noqa: F401
                        sigmoid_gated)
from .mamba2 import mamba2  # noqa: F401
from . import moe
from .matmul import KIND_Q8_1, PRODUCT_LANES, PRODUCT_LANES_BLOCKS, R, quantize_act
from .quant_products import call_lanes3, call_qproduct



class Weights(NamedTuple):
    """A weight matrix (n_rows outputs) as the compiled layers take it. Quantized formats use
    data (and, but for the 32-block "lanes" formats whose scales live in data, scale and bias)
    with kind >= 0; float formats (F32/F16/BF16) use fweight, kind -1 and float_format."""
    data: np.ndarray          # uint8 (flat tiles): codes (and a lanes format's scales)
    scale: np.ndarray         # (NT, K/G, R) float32; the K-quants' int8 sub-block scales in its bytes
    bias: np.ndarray          # (NT, K/G or 0, R) likewise: mins
    offset: int               # code offset (Q4_0: 8; formats with a min: 0)
    bits: int                 # code width in data
    fweight: np.ndarray       # uint16: the bits of F16 or BF16 weights (N, K), of F32 ones (N, 2K); else (0, 0)
    n_rows: int
    group: int                # values a scale covers
    kind: int                 # the activation quantization it pairs with (matmul.KIND_*), -1 for floats
    float_format: int         # FLOAT_F32/F16/BF16 (float formats)
    sb: np.ndarray            # K-quants: each super-block's d and dmin, tiled
    product: int              # how llama.cpp's x86 backend sums it (matmul.PRODUCT_*)
    row_by_row: bool          # each batch row multiplied as if alone (where the sums follow the batch size)
    product_fn: int           # its product's C function (float_products.products, quant_products.qproducts)
    rows3_fn: int             # and its several matrices' one (the float and lanes formats'): addresses, so
                              # that one compiled layer serves every model


# a Weights field's index in the plain tuple, for compiled code
W_DATA, W_OFFSET, W_BITS, W_FWEIGHT, W_N_ROWS, W_KIND, W_FLOAT_FORMAT, W_PRODUCT, W_ROWS3_FN = (
    Weights._fields.index(name) for name in ("data", "offset", "bits", "fweight", "n_rows", "kind", "float_format",
                                             "product", "rows3_fn"))


class Paging(NamedTuple):
    """How rows find their cells: in the batching scheduler's shared pool, each row's sequence
    and its block table; for one sequence's own cache NO_PAGING (or, computing each row alone,
    row_seq with no tables: shift -1)."""
    row_seq: np.ndarray       # (T,) int64 each row's sequence; (0,) for one sequence's own cache
    tables: np.ndarray        # (n_seq, blocks) int64 block tables
    shift: int                # blocks of 2^shift rows; -1: the slots are the cache's rows
    n_slots: int              # slots each sequence sees


class KVView(NamedTuple):
    """A layer's cache as the layer gets it (kernels/cuda/layers.py has its own, without paging)."""
    k: np.ndarray             # (S, Hkv, D) uint16 (f16) or uint8 blocks (q8_0/q4_0)
    v: np.ndarray
    kv_pos: np.ndarray        # (S,) int64 the position each row holds (-1: empty)
    slots: np.ndarray         # (T,) int64 the rows this batch's k/v go to
    n_keep: int               # attention-sink tokens kept when the ring wraps
    paging: Paging
    attend_fn: int            # the address of its cache type's attention (attention_fns.attention_fn)


def plain(fields: tuple) -> tuple:
    """A named tuple (Weights, KVView, Paging) as the plain tuple compiled calls take."""
    return tuple(fields)


NO_PAGING = plain(Paging(np.zeros(0, np.int64), np.zeros((0, 0), np.int64), -1, 0))
# a matrix slot a layer leaves empty: zero rows, of a float matrix's types
_NO_SCALES = np.zeros((0, 0, R), np.float32)
NO_WEIGHTS = Weights(np.zeros(0, np.uint8), _NO_SCALES, _NO_SCALES, 0, 0, np.zeros((0, 0), np.uint16), 0, 0, -1,
                     FLOAT_F32, _NO_SCALES, 0, False, 0, 0)

_SPLIT_BF16 = np.float32(65537.0)  # 2^(24-8) + 1: keeps bfloat16's 8 significant bits

# Each function here compiles once, as its own library, for every architecture's layer: the
# kernels under it (products, attention) are C functions called by address, so none of them is
# compiled again into a caller, and an inlined wrapper (inline="always") would be typed again
# in every layer.
_SER = dict(cache=True, nogil=True)


@nb.njit(**_SER)
def quantize(x, kind):
    """x (T, K) -> (q (T*K,) int8, d16, s16, n16, d32, s32, n32, n4) for activation kind."""
    T, K = x.shape
    q = np.empty((T, K), np.int8)
    d16 = np.empty((T, K // 16), np.float32)
    s16 = np.empty((T, K // 16), np.float32)
    n16 = np.empty((T, K // 16), np.int32)
    d32 = np.empty((T, K // 32), np.float32)
    s32 = np.empty((T, K // 32), np.float32)
    n32 = np.empty((T, K // 32), np.int32)
    n4 = np.empty((T, K // 4), np.int32)  # sums of the codes of every 4 columns (one SIMD lane of ggml's)
    quantize_act(x, kind, q, d16, s16, n16, d32, s32, n32, n4)
    return q.reshape(T * K), d16, s16, n16, d32, s32, n32, n4


@nb.njit(parallel=True, cache=True, nogil=True)
def _round_to_format(x, fmt):
    """x (T, K) rounded to F16's or BF16's values (nearest even), as ggml converts activations
    to a float weight's vec_dot type."""
    out = np.empty_like(x)
    T, K = x.shape
    if T * K < PARALLEL_MIN:  # one token: a fork/join would cost more than the pass
        for t in range(T):
            _round_row(x, t, fmt, out)
        return out
    for t in nb.prange(T):
        _round_row(x, t, fmt, out)
    return out


@nb.njit(inline="always", cache=True, nogil=True)
def _round_row(x, t, fmt, out):
    for k in range(x.shape[1]):
        v = x[t, k]
        if fmt == FLOAT_F16:
            v = f16_round(v)
        elif fmt == FLOAT_BF16:
            c = _SPLIT_BF16 * v
            v = c - (c - v)
        out[t, k] = v


@nb.njit(**_SER)
def _activations(w, x):
    """x quantized for W's kind; for float weights, which read x itself, quantize's arrays of no rows."""
    kind = w[W_KIND]
    return quantize(x if kind >= 0 else x[:0], max(kind, 0))


@nb.njit(**_SER)
def _float_input(w, x):
    """x as W's float product reads it: rounded to F16's or BF16's values; x itself otherwise."""
    if w[W_KIND] < 0 and w[W_FLOAT_FORMAT] != FLOAT_F32:
        return _round_to_format(x, w[W_FLOAT_FORMAT])
    return x


@nb.njit(inline="always", cache=True, nogil=True)
def _same_input(w1, w2):
    """Whether W2 reads what W1 reads: the same activation kind and, for floats, the same format."""
    return w2[W_KIND] == w1[W_KIND] and (w1[W_KIND] >= 0 or w2[W_FLOAT_FORMAT] == w1[W_FLOAT_FORMAT])


@nb.njit(**_SER)
def _apply(w, x, act):
    """out (T, N) = x @ W.T with act = _activations(W, x), x = _float_input(W, x) for float weights."""
    (data, scale, bias, offset, bits, fweight, n_rows, group, kind, float_format, sb, product, row_by_row,
     product_fn, _) = w
    T = x.shape[0]
    out = np.empty((T, n_rows), np.float32)
    if kind < 0:
        call_product(product_fn, fweight, np.ascontiguousarray(x), float_format, out)
        return out
    q, d16, s16, n16, d32, s32, n32, n4 = act
    call_qproduct(product_fn, data, scale, bias, sb, offset, bits, 1 if kind == KIND_Q8_1 else 0,
                  1 if row_by_row else 0, q, d32, s32, n4, n16, n32, out)
    return out


@nb.njit(**_SER)
def linear(w, x):
    """out (T, N) = x (T, K) @ W.T, activations quantized as llama.cpp pairs them with W."""
    return _apply(w, _float_input(w, x), _activations(w, x))


@nb.njit(inline="always", cache=True, nogil=True)
def _lanes_together(w1, w2, w3):
    """Whether the products can run as one qmatmul_lanes3: one 32-block format (so one code
    offset and layout, and the same activations) for all (w3 may repeat w1 when there are two)."""
    product, kind, offset, bits = w1[W_PRODUCT], w1[W_KIND], w1[W_OFFSET], w1[W_BITS]
    return ((product == PRODUCT_LANES or product == PRODUCT_LANES_BLOCKS) and kind >= 0
            and w2[W_PRODUCT] == product and w3[W_PRODUCT] == product and w2[W_KIND] == kind and w3[W_KIND] == kind
            and w2[W_OFFSET] == offset and w3[W_OFFSET] == offset and w2[W_BITS] == bits and w3[W_BITS] == bits)


@nb.njit(**_SER)
def _lanes3(w1, w2, w3, n_mats, x):
    """(x @ W1.T, x @ W2.T, x @ W3.T or None-like) in one parallel region (see _lanes_together)."""
    q, d16, s16, n16, d32, s32, n32, n4 = quantize(x, w1[W_KIND])
    T = x.shape[0]
    o1, o2 = np.empty((T, w1[W_N_ROWS]), np.float32), np.empty((T, w2[W_N_ROWS]), np.float32)
    o3 = np.empty((T, w3[W_N_ROWS] if n_mats == 3 else 0), np.float32)
    call_lanes3(w1[W_ROWS3_FN], w1[W_DATA], w2[W_DATA], w3[W_DATA], w1[W_BITS], 1 if w1[W_KIND] == KIND_Q8_1 else 0,
                w1[W_OFFSET], q, d32, s32, n4, o1, o2, o3)
    return o1, o2, o3


@nb.njit(inline="always", cache=True, nogil=True)
def _float_token(w1, w2, w3, x):
    """Whether one token's products with float matrices of one format run in one parallel region."""
    return x.shape[0] == 1 and w1[W_KIND] < 0 and _same_input(w1, w2) and _same_input(w1, w3)


@nb.njit(**_SER)
def _float_token_products(w1, w2, w3, n_mats, x):
    """(x @ W1.T, x @ W2.T, x @ W3.T or an empty array) for one token (see _float_token)."""
    xr = np.ascontiguousarray(_float_input(w1, x))
    fw1, fw2, fw3, fmt = w1[W_FWEIGHT], w2[W_FWEIGHT], w3[W_FWEIGHT], w1[W_FLOAT_FORMAT]
    o1, o2 = np.empty((1, fw1.shape[0]), np.float32), np.empty((1, fw2.shape[0]), np.float32)
    o3 = np.empty((1, fw3.shape[0] if n_mats == 3 else 0), np.float32)
    call_rows3(w1[W_ROWS3_FN], fw1, fw2, fw3, n_mats, xr, fmt, o1, o2, o3)
    return o1, o2, o3


@nb.njit(**_SER)
def linear2(w1, w2, x):
    """(x @ W1.T, x @ W2.T), quantizing (or rounding) x once when both read it alike."""
    if _lanes_together(w1, w2, w1):
        o1, o2, _ = _lanes3(w1, w2, w1, 2, x)
        return o1, o2
    if _float_token(w1, w2, w1, x):
        o1, o2, _ = _float_token_products(w1, w2, w1, 2, x)
        return o1, o2
    a1, x1 = _activations(w1, x), _float_input(w1, x)
    a2, x2 = (a1, x1) if _same_input(w1, w2) else (_activations(w2, x), _float_input(w2, x))
    return _apply(w1, x1, a1), _apply(w2, x2, a2)


@nb.njit(**_SER)
def linear3(w1, w2, w3, x):
    """(x @ W1.T, x @ W2.T, x @ W3.T), quantizing (or rounding) x once per distinct input."""
    if _lanes_together(w1, w2, w3):
        return _lanes3(w1, w2, w3, 3, x)
    if _float_token(w1, w2, w3, x):
        return _float_token_products(w1, w2, w3, 3, x)
    a1, x1 = _activations(w1, x), _float_input(w1, x)
    a2, x2 = (a1, x1) if _same_input(w1, w2) else (_activations(w2, x), _float_input(w2, x))
    if _same_input(w1, w3):
        a3, x3 = a1, x1
    elif _same_input(w2, w3):
        a3, x3 = a2, x2
    else:
        a3, x3 = _activations(w3, x), _float_input(w3, x)
    return _apply(w1, x1, a1), _apply(w2, x2, a2), _apply(w3, x3, a3)


@nb.njit(**_SER)
def norm(x, weight, eps):
    out = np.empty_like(x)
    ops.rmsnorm(x, weight, eps, out)
    return out


@nb.njit(**_SER)
def attend(q, k, v, positions, kv, window, scale, softcap, n_heads, n_kv_heads, head_dim):
    """Store this batch's k/v at their slots, then attention of q over the cache (kv: a KVView;
    with a pool's paging every row is computed as if alone) by the cache type's C function."""
    kcache, vcache, kv_pos, slots, n_keep, paging, attend_fn = kv  # KVView's fields
    for i in range(slots.shape[0]):
        kv_pos[slots[i]] = positions[i]
    _store_kv(k, v, slots, n_kv_heads, head_dim, kcache, vcache)
    row_seq, tables, shift, n_slots = paging
    out = np.empty((q.shape[0], n_heads * head_dim), np.float32)
    call_attention(attend_fn, np.ascontiguousarray(q), positions, row_seq, tables, np.int64(shift), np.int64(n_slots),
                   np.int64(n_keep), kcache, vcache, kv_pos, np.int64(window), np.float32(scale),
                   np.float32(softcap), np.int64(n_heads), np.int64(head_dim), out)
    return out


def _store_kv(k, v, slots, n_kv_heads, head_dim, kcache, vcache):
    """The cache's own store: F16 (uint16 caches) or q8_0/q4_0 blocks (uint8 caches)."""


@overload(_store_kv, inline="always")
def _store_kv_impl(k, v, slots, n_kv_heads, head_dim, kcache, vcache):
    if kcache.dtype == types.uint8:
        def quantized(k, v, slots, n_kv_heads, head_dim, kcache, vcache):  # in llama.cpp's rotated space
            n_rot_k, n_rot_v = rotation_size(head_dim, True), rotation_size(head_dim, False)
            store_kv_quantized(hadamard_rotated(k, n_rot_k), hadamard_rotated(v, n_rot_v), slots, n_kv_heads, head_dim,
                               kcache, vcache)
        return quantized

    def f16(k, v, slots, n_kv_heads, head_dim, kcache, vcache):
        ops.store_kv(k, v, slots, n_kv_heads, head_dim, kcache, vcache)
    return f16


# ---- the operations an architecture's layer is written in (kernels/cuda/layers.py has the
# same names for the GPU; an architecture builds its layer from either module) --------------

@nb.njit(**_SER)
def head_norm(x, weight, eps, n_heads, head_dim):
    """RMS norm of each head: x (T, n_heads*head_dim) -> new array."""
    T = x.shape[0]
    return norm(x.reshape(T * n_heads, head_dim), weight, eps).reshape(T, n_heads * head_dim)


@nb.njit(**_SER)
def rope_attend(q, k, v, positions, rope_table, kv, q_scale, window, kq_scale, softcap, n_heads, n_kv_heads,
                head_dim, rope_dims, neox):
    """RoPE on q and k (cos/sin rope_table), q *= q_scale, store k/v in the cache, attention
    with scores scaled by kq_scale and soft-capped at softcap (0: not capped)."""
    cos, sin = rope_table
    ops.rope(q, n_heads, head_dim, rope_dims, cos, sin, neox)
    ops.rope(k, n_kv_heads, head_dim, rope_dims, cos, sin, neox)
    if q_scale != 1:
        q *= q_scale
    return attend(q, k, v, positions, kv, window, kq_scale, softcap, n_heads, n_kv_heads, head_dim)


@nb.njit(**_SER)
def moe_ffn(x, router, gate_exps, up_exps, down_exps, n_used, norm_w, w_scale):
    """build_moe_ffn (softmax router, SwiGLU experts): x (T, E) -> (T, E). The router's
    probabilities pick each token's n_used experts (kernels/cpu/moe.py); each expert multiplies
    the tokens routed to it as one product, as mul_mat_id does (a repacked expert's views say
    row_by_row: a token at a time), its weights read once for them; the outputs, times their
    weights, are added in top-k order."""
    probs = moe.softmax_rows(linear(router, x))
    chosen, weights = moe.route(probs, n_used, norm_w, w_scale)
    T, E = x.shape
    outs = np.zeros((T, n_used, E), np.float32)  # each token's experts' weighted outputs, in top-k order
    for e in range(probs.shape[1]):
        pairs = moe.tokens_of(chosen, e)
        if pairs.shape[0] == 0:
            continue
        xe = np.empty((pairs.shape[0], E), np.float32)
        for i in range(pairs.shape[0]):
            xe[i] = x[pairs[i, 0]]
        gate, up = linear(moe.expert(gate_exps, e), xe), linear(moe.expert(up_exps, e), xe)
        down = linear(moe.expert(down_exps, e), swiglu(gate, up))
        for i in range(pairs.shape[0]):
            t, k = pairs[i, 0], pairs[i, 1]
            outs[t, k] = down[i] * weights[t, k]
    return moe.add_experts(outs)


@nb.njit(**_SER)
def rope_attend_rows(q, k, v, positions, rope_table, kv, q_rows, kq_scale, n_heads, n_kv_heads, head_dim, rope_dims):
    """rope_attend (normal pairs, no window or cap) with each row of q, after RoPE, times its own
    scale q_rows (T,) (Llama 4's attention temperature by position; empty: none)."""
    cos, sin = rope_table
    ops.rope(q, n_heads, head_dim, rope_dims, cos, sin, False)
    ops.rope(k, n_kv_heads, head_dim, rope_dims, cos, sin, False)
    if q_rows.size:
        for t in range(q.shape[0]):
            q[t] *= q_rows[t]
    return attend(q, k, v, positions, kv, 0, kq_scale, np.float32(0.0), n_heads, n_kv_heads, head_dim)


@nb.njit(**_SER)
def first_halves(x, n_heads, head_dim):
    """The first head_dim values of each head of x (T, n_heads*2*head_dim): (T, n_heads*head_dim)."""
    return x.reshape(x.shape[0], n_heads, 2 * head_dim)[:, :, :head_dim].copy().reshape(x.shape[0], n_heads * head_dim)


@nb.njit(**_SER)
def add_bias(x, bias):
    """x (T, N) + bias (N,) (ggml_add's broadcast); an empty bias: x as it is."""
    if bias.size == 0:
        return x
    return x + bias


@nb.njit(**_SER)
def scaled(x, s):
    """x * s (ggml_scale); s == 1: x as it is."""
    if s == 1:
        return x
    return x * np.float32(s)


@nb.njit(**_SER)
def add(x, y):
    return x + y


@nb.njit(**_SER)
def swiglu(gate, up):
    out = np.empty_like(gate)
    ops.swiglu(gate, up, out)
    return out


@nb.njit(**_SER)
def geglu(gate, up):
    out = np.empty_like(gate)
    ops.geglu(gate, up, out)
    return out


@nb.njit(**_SER)
def tanh_capped(x, inv_cap, cap):
    """Soft-capping as ggml computes it: ggml_scale by 1/cap, ggml_tanh (tanhf), ggml_scale by cap."""
    out = np.empty_like(x)
    flat, res = x.reshape(-1), out.reshape(-1)
    for i in range(flat.size):
        res[i] = np.float32(math.tanh(flat[i] * inv_cap)) * cap
    return out
