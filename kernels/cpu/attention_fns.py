"""Attention over the KV cache (attention.py for F16 caches, attention_q.py for q8_0/q4_0
ones) as C functions whose addresses the compiled layers call (layers.KVView.attend_fn;
call_attention), as the products are called (quant_products.py).

Inlined, attention was compiled again into every architecture's layer, and was the largest
part of each: about 25 s of a first run on two cores. Called through a pointer of one
signature, it compiles (or loads from the cache) once per cache type, for every architecture
and head size, and a layer carries only the call.
Every argument is passed whatever the cache type: each reads the ones it needs.
"""
import numba as nb
import numpy as np
from numba import types
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads

from .attention import attention, attention_rows
from .attention_q import attention_quantized, hadamard_rotated, rotation_size
from .float_products import _caller, cfuncs_cached

_ROWS = types.float32[:, ::1]     # (T, H*D) queries, and the output
_INTS = types.int64[::1]          # (T,) positions, rows' sequences; (S,) each cell's position
_TABLES = types.int64[:, ::1]     # (n_seq, blocks) block tables
_INT, _F32 = types.int64, types.float32
# (q, q_pos, row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos, window, scale, softcap, n_heads,
#  head_dim, out): kcache/vcache (S, Hkv, row) uint16 for F16, uint8 blocks for q8_0/q4_0
_ARGS = (_ROWS, _INTS, _INTS, _TABLES, _INT, _INT, _INT)
_AFTER = (_INTS, _INT, _F32, _F32, _INT, _INT, _ROWS)
ATTEND_F16 = types.void(*_ARGS, types.uint16[:, :, ::1], types.uint16[:, :, ::1], *_AFTER)
ATTEND_Q = types.void(*_ARGS, types.uint8[:, :, ::1], types.uint8[:, :, ::1], *_AFTER)


def _attend_f16(q, q_pos, row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos, window, scale, softcap,
                n_heads, head_dim, out):
    """A sequence's own cache (row_seq empty) or the scheduler's pool (each row as if alone)."""
    if row_seq.shape[0] == 0:
        attention(q, q_pos, kcache, vcache, kv_pos, n_keep, window, scale, softcap, n_heads, out)
    else:
        attention_rows(q, q_pos, row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos, window, scale,
                       softcap, n_heads, out)


def _attend_quantized(q, q_pos, row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos, window, scale,
                      softcap, n_heads, head_dim, out):
    """Over q8_0/q4_0 blocks, in llama.cpp's Hadamard-rotated space (the keys were stored so)."""
    n_rot_k, n_rot_v = rotation_size(head_dim, True), rotation_size(head_dim, False)
    rotated = np.empty_like(out)
    own_slots = n_slots if row_seq.shape[0] else kcache.shape[0]
    attention_quantized(hadamard_rotated(q, n_rot_k), q_pos, row_seq, tables, shift, own_slots, n_keep, kcache,
                        vcache, kv_pos, window, scale, softcap, n_heads, head_dim, rotated)
    out[:] = hadamard_rotated(rotated, n_rot_v)


# the caches' dtype -> (signature, source)
_SOURCES = {np.dtype(np.uint16): (ATTEND_F16, _attend_f16), np.dtype(np.uint8): (ATTEND_Q, _attend_quantized)}
_compiled: dict = {}  # dtype -> its cfunc


def attention_fn(cache_dtype) -> int:
    """The address of the attention C function over caches of this dtype (uint16: F16, uint8:
    q8_0/q4_0 blocks), compiled (or loaded from the cache) on first request and kept for the
    life of the process."""
    dtype = np.dtype(cache_dtype)
    if dtype not in _compiled:
        _launch_threads()  # (its code runs parallel regions: quant_products._cfunc)
        sig, source = _SOURCES[dtype]
        _compiled[dtype] = nb.cfunc(sig, cache=True, nogil=True)(source)
    return _compiled[dtype].address


def attention_fn_cached(cache_dtype) -> bool:
    """Whether attention_fn(cache_dtype) loads its C function without compiling it."""
    dtype = np.dtype(cache_dtype)
    return cfuncs_cached((_SOURCES[dtype][1],), dtype in _compiled)


def _call_attention(typingctx, address, q, q_pos, row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos,
                    window, scale, softcap, n_heads, head_dim, out):
    sig = ATTEND_Q if kcache.dtype == types.uint8 else ATTEND_F16
    return _caller(sig)(typingctx, address, q, q_pos, row_seq, tables, shift, n_slots, n_keep, kcache, vcache, kv_pos,
                        window, scale, softcap, n_heads, head_dim, out)


call_attention = intrinsic(_call_attention)  # call_attention(address, *ATTEND_F16's or ATTEND_Q's arguments)
