"""The operations an architecture's layer is written in (minillm/arch/*.py), on the GPU.

Same names, arguments and results as kernels/cpu/layers.py, over device arrays:
    x, q, k, v, ...   float32 (T, width) device arrays
    weights           DeviceMatrix (a matrix: QWeights or FWeights and the activation kind it
                      takes) or a float32 (width,) device vector (norms)
    positions         int64 (T,) device array
    rope_table        (cos, sin) float32 (T, rope_dims/2) device arrays: the CPU's tables, uploaded
    kv                a DeviceKV: the CPU's KVView (paging None: one sequence's own cache)
so that `Backend.layer_with_ops(this module)` runs an architecture's layer on the GPU.

Results are taken from POOL, device buffers reused from one layer to the next: the backend
calls `recycle(keep)` once a layer is done, which hands every buffer but `keep` back. (numba
frees device memory in batches that synchronise the device; reusing buffers avoids that and
the allocation calls.) One forward pass at a time.

Some ops write into an argument, as the CPU's rope_attend rotates q and k in place:
rope_attend rotates q and k, add(x, y) computes x + y into y (in the launch of the norm taken of
the sum next, where there is one), add_bias and scaled change x (always temporaries in the
layers).
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numba import cuda

from .attention import attention, attention_rows, quantizes_output
from .matmul import FWeights, QWeights, fmatmul, qmatmul
from .norm_quant import GLU_GELU, GLU_SILU, QActivations, glu_quantize, quantize, rmsnorm, rmsnorm_quantize
from .launch import COUNTS, launch
from .ops import _launch, add_inplace, add_rows_kernel, geglu as geglu_into, rope_store_kv, scale_kernel, swiglu as swiglu_into



class DevicePaging(NamedTuple):
    """How the batching scheduler's rows find their cells in a shared pool (the CPU's Paging)."""
    row_seq: object           # (T,) int64 device array: each row's sequence
    tables: object            # (n_seq, blocks) int64 device array: block tables
    shift: int                # blocks of 2^shift rows; -1: the slots are the cache's rows
    n_slots: int              # slots each sequence sees


class DeviceKV(NamedTuple):
    """A layer's cache on the device, as rope_attend takes it."""
    k: object                 # (S, Hkv, D) float16 device array
    v: object
    kv_pos: object            # (S,) int64: the position each row holds (-1: empty)
    slots: object             # (T,) int64: the rows this batch's k/v go to
    n_keep: int               # attention-sink tokens kept when the ring wraps
    paging: DevicePaging | None = None  # None: one sequence's own cache


FLOAT_KIND = -1  # DeviceMatrix.kind of float weights: activations are rounded, not quantized

# which matrix-product kernels: None chooses by batch size (matrix-vector for a few tokens,
# tiled above); True always takes the tiled ones (the tests do under the CUDA simulator, where
# the matrix-vector kernels' warp reductions cost minutes; test_cuda_kernels checks them)
BATCHED: bool | None = None
# inside rows_alone(): the batching scheduler's rows, each computed as a lone token is (the
# matrix-vector kernels at any batch size, unless BATCHED says otherwise: both kernels give a
# row the same result whatever the other rows, but not each other's)
_ROWS_ALONE = [False]


@dataclass(frozen=True)
class DeviceMatrix:
    """A weight matrix (n_rows outputs, n_cols inputs) on the device."""

    weights: QWeights | FWeights
    kind: int  # the activation quantization it takes (KIND_Q8_0/Q8_1/Q8_K), FLOAT_KIND for floats
    # the matrices stacked with this one for single-token products (_stacked), by the others' ids
    stacks: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def n_rows(self) -> int:
        return self.weights.n_rows

    @property
    def weights_are_blocks(self) -> bool:
        return self.kind != FLOAT_KIND


class BufferPool:
    """Device buffers by (row class, trailing shape, dtype); rows are rounded up to a power of
    two so that batches of varying length share a few sizes. `take` returns a view of the
    first rows of a pooled buffer."""

    def __init__(self):
        self.free: dict[tuple, list] = {}  # key -> buffers not in use
        self.used: list[tuple] = []        # (key, buffer, the view handed out)

    def take(self, shape: tuple[int, ...], dtype=np.float32):
        rows = 1 << max(0, int(shape[0]) - 1).bit_length()
        key = (rows, tuple(shape[1:]), np.dtype(dtype).str)
        stack = self.free.get(key)
        if stack:
            buffer = stack.pop()
        else:
            COUNTS["allocations"] += 1
            buffer = cuda.device_array((rows, *shape[1:]), dtype)
        view = buffer[:shape[0]]
        self.used.append((key, buffer, view))
        return view

    def upload(self, host: np.ndarray):
        """A pooled device copy of a host array."""
        view = self.take(host.shape, host.dtype)
        view.copy_to_device(np.ascontiguousarray(host))
        return view

    def recycle(self, keep=(), keep_memory=()) -> None:
        """Every buffer handed out is free for reuse, but those of the views in keep and those
        holding an array of keep_memory (views of rows of a buffer, made outside the pool)."""
        kept = []
        for entry in self.used:
            key, buffer, view = entry
            if any(view is k for k in keep) or any(_holds(key, buffer, a) for a in keep_memory):
                kept.append(entry)
            else:
                self.free.setdefault(key, []).append(buffer)
        self.used = kept


def _address(array) -> int:
    """Where an array's first element is in device memory."""
    try:
        return array.device_ctypes_pointer.value
    except AttributeError:  # the simulator's arrays wrap numpy's
        return array.__array_interface__["data"][0]


def _holds(key: tuple, buffer, array) -> bool:
    """Whether a pooled buffer (its pool key) holds array, a view of some of its rows."""
    if key[1:] != (tuple(array.shape[1:]), array.dtype.str):
        return False
    start = _address(buffer)
    return start <= _address(array) < start + buffer.nbytes


POOL = BufferPool()  # the pool the operations take from (using_pool swaps it)


@contextlib.contextmanager
def using_pool(pool: BufferPool):
    """The operations take their buffers from `pool` inside the block (a recorded decode step
    keeps a pool of its own, whose buffers its replays write again)."""
    global POOL
    saved, POOL = POOL, pool
    try:
        yield pool
    finally:
        POOL = saved
        _PENDING_ADDS.clear()  # (a pass that raised): no add outlives its buffers' pool


def recycle(keep=()) -> None:
    """Every buffer the operations handed out is free again, but the arrays in keep (and the
    residual of a pending add whose sum is kept: a view the layer code may have made)."""
    _PENDING_ADDS[:] = [(y, x) for y, x in _PENDING_ADDS if any(y is k for k in keep)]
    POOL.recycle(keep, keep_memory=[x for _, x in _PENDING_ADDS])
    _QUANTIZED.clear()
    _AWAITING.clear()
    _CALLS.clear()


# ---- matrix products -------------------------------------------------------------------
#
# Three fusions spare launches and passes over memory:
#  - a norm whose output the next product quantizes quantizes it in the same launch
#    (rmsnorm_quantize): the kind each norm's weight is followed by is learned on the first
#    pass (_NORM_KINDS), and the quantized rows wait in _QUANTIZED for the product that reads them;
#  - so do a SwiGLU or GeGLU (glu_quantize) and attention (the block that merges a head's runs,
#    for the 32-group kinds), their kinds learned per call of the layer (the n-th GLU of a layer, at its width:
#    _CALL_KINDS). A product that wants another kind than the one learned quantizes the output
#    again and learns the new kind: never wrong, and one launch more only where the kinds
#    alternate;
#  - a single token's products with matrices of one format, width and activation kind (q, k, v;
#    gate, up) are one launch over their rows stacked: the matrices are moved into one device
#    buffer on first use, each keeping a view of its rows (no byte stored twice).

_NORM_KINDS: dict[int, tuple] = {}  # id(norm weight) -> (weak reference to it, the kind after it)
_QUANTIZED: dict[int, tuple] = {}  # id(x) -> (x, learn(kind), its QActivations) until the buffers recycle
_AWAITING: dict[int, tuple] = {}   # id(x) -> (x, learn(kind)): outputs (norms, GLUs, attention) not quantized yet
_CALL_KINDS: dict[tuple, int] = {}  # (operation, its call index in the layer, width) -> the kind after it
_CALLS: Counter = Counter()        # calls of each operation since the buffers last recycled (the layer so far)


def _call_kind(operation: str, width: int):
    """(the kind the product after this call of operation took on an earlier pass, or None;
    learn(kind), which records the kind it takes on this pass)."""
    key = (operation, _CALLS[operation], width)
    _CALLS[operation] += 1
    return _CALL_KINDS.get(key), functools.partial(_CALL_KINDS.__setitem__, key)


def _activation_buffers(T: int, K: int, kind: int) -> QActivations:
    return QActivations(kind, POOL.take((T, K // 4), np.int32),
                        POOL.take((T, K // 16)), POOL.take((T, K // 16)),   # d16, s16
                        POOL.take((T, K // 32)), POOL.take((T, K // 32)))   # d32, s32


def _quantize(x, kind: int):
    """x (T, K) quantized for activation kind into pooled buffers; None for float weights."""
    if kind == FLOAT_KIND:
        return None
    done = _QUANTIZED.get(id(x))
    if done is not None and done[0] is x:
        if done[2].kind == kind:
            return done[2]
        done[1](kind)  # quantized in its launch for another kind: learn this one
    made = _AWAITING.get(id(x))
    if made is not None and made[0] is x:  # the next pass quantizes in the launch that made x
        made[1](kind)
    return quantize(x, kind, _activation_buffers(*x.shape, kind))


@contextlib.contextmanager
def rows_alone():
    """The products inside the block take each row as a lone token (the matrix-vector kernels)."""
    _ROWS_ALONE[0] = True
    try:
        yield
    finally:
        _ROWS_ALONE[0] = False


def _apply(w: DeviceMatrix, x, act, out=None):
    """out (T, N) = x @ W.T, act the quantized x for w's kind (None for float weights)."""
    out = POOL.take((x.shape[0], w.n_rows)) if out is None else out
    batched = False if BATCHED is None and _ROWS_ALONE[0] else BATCHED
    if w.kind == FLOAT_KIND:
        return fmatmul(w.weights, x, out, scratch=POOL.take(x.shape), batched=batched)
    return qmatmul(w.weights, act, out, batched=batched)


def _stacked(weights) -> DeviceMatrix | None:
    """One DeviceMatrix over the rows of `weights` (same format, width and kind), or None."""
    first = weights[0]
    key = tuple(id(w) for w in weights[1:])
    if key in first.stacks:
        return first.stacks[key]
    blocks = [w.weights for w in weights]
    same = all(w.weights_are_blocks and w.kind == first.kind for w in weights) and \
        len({(b.fmt, b.n_cols) for b in blocks}) == 1
    stacked = None
    if same:
        raw = cuda.device_array((sum(b.n_rows for b in blocks), blocks[0].raw.shape[1]), np.uint8)
        r0 = 0
        for b in blocks:
            raw[r0:r0 + b.n_rows].copy_to_device(b.raw)
            b.read_from(raw[r0:r0 + b.n_rows])
            r0 += b.n_rows
        stacked = DeviceMatrix(QWeights(raw, blocks[0].fmt, blocks[0].group, blocks[0].has_bias, r0, blocks[0].n_cols),
                               first.kind)
    first.stacks[key] = stacked
    return stacked


def _products(weights, x) -> list:
    """x @ W.T for each matrix: one launch for a single token where they stack, else one each,
    quantizing x once per distinct activation kind."""
    if x.shape[0] == 1 and BATCHED is not True:
        stacked = _stacked(weights)
        if stacked is not None:
            out = _apply(stacked, x, _quantize(x, stacked.kind))
            bounds = np.cumsum([0] + [w.n_rows for w in weights])
            return [out[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])]  # (1, N_i) views: contiguous
    by_kind = {}
    for w in weights:
        if w.kind not in by_kind:
            by_kind[w.kind] = _quantize(x, w.kind)
    return [_apply(w, x, by_kind[w.kind]) for w in weights]


def linear(w, x):
    """out (T, N) = x (T, K) @ W.T, activations quantized as llama.cpp pairs them with W."""
    _settle_adds()
    return _apply(w, x, _quantize(x, w.kind))


def linear2(w1, w2, x):
    _settle_adds()
    return tuple(_products((w1, w2), x))


def linear3(w1, w2, w3, x):
    _settle_adds()
    return tuple(_products((w1, w2, w3), x))


# ---- residual adds -----------------------------------------------------------------------
#
# add(x, y) launches nothing by itself: the sum is left pending, and the norm the layer takes
# of it next (the feed-forward norm, the next layer's attention norm, the output norm) adds it
# in its own launch, row by row before normalizing it. Every other operation launches the
# pending add first (_settle_adds), so no kernel reads a sum not yet computed. A pending add
# may outlive its layer (the layer's output, kept for the next): recycle keeps its operands'
# buffers; an add whose sum nobody keeps is dropped.

_PENDING_ADDS: list[tuple] = []  # (y, x): y is to become x + y (at most one at a time)


def _settle_adds() -> None:
    """Launch the pending adds (before an operation reads their operands or sums)."""
    while _PENDING_ADDS:
        y, x = _PENDING_ADDS.pop()
        add_inplace(y, x)


def _pending_residual(x):
    """The residual of x when x is a pending add's sum (then taken over by the caller), else
    None with every pending add launched."""
    if _PENDING_ADDS and _PENDING_ADDS[-1][0] is x:
        return _PENDING_ADDS.pop()[1]
    _settle_adds()
    return None


# ---- norms, attention, element-wise ------------------------------------------------------

def norm(x, weight, eps):
    """rmsnorm(x) * weight over the last axis: x (R, W) -> new (R, W); quantized in the same
    launch when a product has quantized this norm's output before, and x's pending add
    computed there too."""
    res = _pending_residual(x)
    out = POOL.take(x.shape)
    learned = _NORM_KINDS.get(id(weight))
    kind = learned[1] if learned is not None and learned[0]() is weight else None
    learn = functools.partial(_learn_norm_kind, weight)
    if kind is None:
        _AWAITING[id(out)] = (out, learn)
        return rmsnorm(x, weight, eps, out, res)
    act = rmsnorm_quantize(x, weight, eps, kind, out, _activation_buffers(*x.shape, kind), res)
    _QUANTIZED[id(out)] = (out, learn, act)
    return out


def _learn_norm_kind(weight, kind: int) -> None:
    _NORM_KINDS[id(weight)] = (weakref.ref(weight), kind)


def head_norm(x, weight, eps, n_heads, head_dim):
    """RMS norm of each head: x (T, n_heads*head_dim) -> new array."""
    T = x.shape[0]
    return norm(x.reshape(T * n_heads, head_dim), weight, eps).reshape(T, n_heads * head_dim)


def rope_attend(q, k, v, positions, rope_table, kv, q_scale, window, kq_scale, softcap, n_heads, n_kv_heads,
                head_dim, rope_dims, neox):
    """RoPE on q and k (in place), store k/v in the cache, attention of q * q_scale -> (T, H*D),
    scores soft-capped at softcap (0: not capped).

    Batches of attention.TILE rows or more scale q itself, as the CPU's layer does. Smaller ones
    fold q_scale into the score scale: that path rounds q to f16 before the dot products, and
    f16(q * s) * (dot scale) == f16(q) * (s * dot scale) exactly when s is a power of two
    (Gemma 3's 1/sqrt(256)); otherwise the two differ by one f16 rounding of q."""
    _settle_adds()
    cos_t, sin_t = rope_table
    rope_store_kv(q, k, v, positions, kv.slots, n_heads, rope_dims, cos_t, sin_t, neox, kv.k, kv.v, kv.kv_pos)
    out = POOL.take((q.shape[0], n_heads * head_dim))
    act = _attention_quantized(out, head_dim, kv.paging is not None)
    if kv.paging is not None:  # the scheduler's rows: each as a lone query over its sequence's cells
        p = kv.paging
        return attention_rows(q, positions, p.row_seq, p.tables, p.shift, p.n_slots, kv.k, kv.v, kv.kv_pos, window,
                              kq_scale, softcap, n_heads, out, q_scale, take=POOL.take, n_keep=kv.n_keep, act=act)
    return attention(q, positions, kv.k, kv.v, kv.kv_pos, kv.n_keep, window, kq_scale, softcap, n_heads, out,
                     q_scale, take=POOL.take, act=act)


def _attention_quantized(out, head_dim: int, rows: bool) -> QActivations | None:
    """The buffers attention quantizes its output `out` into, in its own launch, for the kind
    the product after it took on an earlier pass (None where it cannot: then that product
    quantizes it)."""
    T, width = out.shape
    kind, learn = _call_kind("attention", width)
    if kind is None or not quantizes_output(T, head_dim, kind, rows):
        _AWAITING[id(out)] = (out, learn)
        return None
    act = _activation_buffers(T, width, kind)
    _QUANTIZED[id(out)] = (out, learn, act)
    return act


def add_bias(x, bias):
    """x (T, N) + bias (N,) into x (a temporary); an empty bias: x as it is."""
    if bias.size == 0:
        return x
    _settle_adds()
    _QUANTIZED.pop(id(x), None)  # (x changes: a quantization of it made before is stale)
    launch(add_rows_kernel, *_launch(x.size), x, bias)
    return x


def scaled(x, s):
    """x * s into x (a temporary); s == 1: x as it is."""
    if s == 1:
        return x
    _settle_adds()
    _QUANTIZED.pop(id(x), None)
    launch(scale_kernel, *_launch(x.size), x, np.float32(s))
    return x


def add(x, y):
    """x + y, computed into y (x is left as it was): by the norm taken of it next, where that
    comes first (see _PENDING_ADDS)."""
    _settle_adds()
    if x.shape != y.shape:
        raise ValueError(f"adding arrays of shapes {x.shape} and {y.shape}")
    if y.size:  # (a pass's last layer may keep no row)
        _PENDING_ADDS.append((y, x))
    return y


def swiglu(gate, up):
    return _glu(gate, up, GLU_SILU)


def geglu(gate, up):
    return _glu(gate, up, GLU_GELU)


def _glu(gate, up, glu: int):
    """silu(gate) * up or gelu(gate) * up into a new buffer, quantized in the same launch for
    the kind the product after this call took on an earlier pass."""
    _settle_adds()
    kind, learn = _call_kind("glu", gate.shape[1])
    out = POOL.take(gate.shape)
    if kind is None:
        _AWAITING[id(out)] = (out, learn)
        return (swiglu_into if glu == GLU_SILU else geglu_into)(gate, up, out)
    _QUANTIZED[id(out)] = (out, learn, glu_quantize(gate, up, glu, kind, out, _activation_buffers(*gate.shape, kind)))
    return out
