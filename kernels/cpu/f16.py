"""Float16 rounding for Numba CPU code (which has no float16 scalars).

f16_round(x) returns the float32 value of float16(x), round to nearest (Veltkamp
splitting for normal numbers, fixed-point rounding for subnormals). Used where llama.cpp
stores or computes in F16: the KV cache, Q in flash attention, the GELU table.
Must not be compiled with fastmath (it relies on exact float operations).
"""
import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_F16_MAX = np.float32(65504.0)
_SUBNORMAL_LIMIT = np.float32(2.0 ** -14)
_SUBNORMAL_STEP = np.float32(2.0 ** -24)
_SPLIT = np.float32(8193.0)  # 2^(24-11) + 1: keeps 11 significant bits


@nb.njit(inline="always", cache=True)
def f16_round(x):
    ax = abs(x)
    if ax < _SUBNORMAL_LIMIT:
        return np.float32(np.rint(x / _SUBNORMAL_STEP)) * _SUBNORMAL_STEP
    if ax >= np.float32(65520.0):
        return np.float32(np.inf) if x > 0 else np.float32(-np.inf)
    c = _SPLIT * x
    return c - (c - x)


@nb.njit(inline="always", cache=True)
def f16_round_normal(x):
    """f16_round for values in float16's normal range (branch-free, so loops vectorize)."""
    c = _SPLIT * x
    return c - (c - x)


_SUBNORMAL_SHIFT = np.float32(0.75)  # x + 0.75 - 0.75 rounds x to a multiple of 2^-24


@nb.njit(inline="always", cache=True)
def f16_round_finite(x):
    """f16_round for values inside float16's range, normal or subnormal, without branches
    (so that loops vectorize): both roundings computed, the right one selected."""
    c = _SPLIT * x
    normal = c - (c - x)
    subnormal = (x + _SUBNORMAL_SHIFT) - _SUBNORMAL_SHIFT
    return subnormal if abs(x) < _SUBNORMAL_LIMIT else normal


@intrinsic
def float32_from_bits(typingctx, bits):
    """The float32 whose bits are the int32 `bits` (a bitcast)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@intrinsic
def float32_bits(typingctx, x):
    """The int32 bits of the float32 x (a bitcast)."""
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def f16_bits(typingctx, x):
    """The float16 bit pattern (uint16) of float16(x), rounded to nearest even: one vcvtps2ph.
    What the KV cache stores (f16_value(f16_bits(x)) == f16_round(x))."""
    sig = types.uint16(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return sig, codegen


@intrinsic
def f16_value(typingctx, bits):
    """The float32 value (exact) of the float16 bit pattern `bits` (uint16)."""
    sig = types.float32(types.uint16)

    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return sig, codegen
