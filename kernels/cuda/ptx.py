"""Instructions numba.cuda has no function for, as inline PTX: dp4a and the int8 tensor-core MMA.

    dp4a(a, b, c)           c + the dot product of the 4 signed bytes of a and of b (int32)
    mma_s8(a0..a3, b0, b1, scratch_a, scratch_b)
                            one warp's m16n8k32 int8 product with int32 sums: (d0, d1, d2, d3)

mma_s8 is a warp-collective instruction over fragments spread across the warp's 32 lanes
(PTX ISA, "Matrix Fragments for mma.m16n8k32"; gid = lane >> 2, tig = lane & 3):
    A (16 x 32, row-major) a0: row gid, k 4*tig..+3    a1: row gid + 8, same k
                           a2: row gid, k 16 + 4*tig..+3  a3: row gid + 8, same k
    B (32 x 8, column n)   b0: n gid, k 4*tig..+3      b1: n gid, k 16 + 4*tig..+3
    D (16 x 8)             d0, d1: row gid, n 2*tig, 2*tig + 1   d2, d3: row gid + 8, same n
each register 4 int8 values, the lowest k in the lowest byte. The sums are exact integers, so a
product through it equals one through dp4a bit for bit.

Under the CUDA simulator (no inline PTX) both run as Python: dp4a directly, mma_s8 through shared
scratch arrays (scratch_a (warps, 32, 4) and scratch_b (warps, 32, 2) int32, a row per warp
threadIdx.y) that every lane writes its fragments to and reads the whole tiles back from; every
thread of the block must call it, as with device.warp_sum.
"""
from __future__ import annotations

from llvmlite import ir
from numba import cuda, types
from numba.cuda.extending import intrinsic

from .device import SIMULATOR, dot4, signed_byte
from .registry import device

_I32 = ir.IntType(32)


@intrinsic
def _dp4a_asm(typingctx, a, b, c):
    def codegen(context, builder, sig, args):
        asm = ir.InlineAsm(ir.FunctionType(_I32, [_I32] * 3), "dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r")
        return builder.call(asm, args)

    return types.int32(types.int32, types.int32, types.int32), codegen


@intrinsic
def _mma_s8_asm(typingctx, a0, a1, a2, a3, b0, b1):
    result = types.UniTuple(types.int32, 4)

    def codegen(context, builder, sig, args):
        out = ir.LiteralStructType([_I32] * 4)
        asm = ir.InlineAsm(
            ir.FunctionType(out, [_I32] * 10),
            "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
            "{$10, $11, $12, $13};",
            "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r")
        zero = ir.Constant(_I32, 0)
        d = builder.call(asm, [*args, zero, zero, zero, zero])
        return context.make_tuple(builder, result, [builder.extract_value(d, i) for i in range(4)])

    return result(types.int32, types.int32, types.int32, types.int32, types.int32, types.int32), codegen


@device
def dp4a(a, b, c):
    """c + the dot product of the signed bytes of int32 words a and b (one dp4a instruction)."""
    if SIMULATOR:
        return c + dot4(a, b)
    return _dp4a_asm(a, b, c)


def _mma_s8_gpu(a0, a1, a2, a3, b0, b1, scratch_a, scratch_b):
    return _mma_s8_asm(a0, a1, a2, a3, b0, b1)


def _mma_s8_simulated(a0, a1, a2, a3, b0, b1, scratch_a, scratch_b):
    """mma_s8 as Python: the warp's fragments gathered through the scratch arrays."""
    lane = cuda.threadIdx.x
    w = cuda.threadIdx.y
    scratch_a[w, lane, 0], scratch_a[w, lane, 1], scratch_a[w, lane, 2], scratch_a[w, lane, 3] = a0, a1, a2, a3
    scratch_b[w, lane, 0], scratch_b[w, lane, 1] = b0, b1
    cuda.syncthreads()
    gid, tig = lane >> 2, lane & 3
    d = []
    for i in range(4):
        row, n = gid + 8 * (i >> 1), 2 * tig + (i & 1)
        total = 0
        for k in range(32):
            # A's (row, k) is in lane 4 * (row % 8) + (k % 16) // 4, register (row >= 8) + 2 * (k >= 16);
            # B's (k, n) in lane 4 * n + (k % 16) // 4, register k >= 16; byte k % 4 of each
            a = scratch_a[w, 4 * (row % 8) + (k % 16) // 4, row // 8 + 2 * (k // 16)]
            b = scratch_b[w, 4 * n + (k % 16) // 4, k // 16]
            total += signed_byte(a, k % 4) * signed_byte(b, k % 4)
        d.append(total)
    cuda.syncthreads()  # the scratch is rewritten by the next call
    return d[0], d[1], d[2], d[3]


# the warp's (16 x 32) A times (32 x 8) B, int8 with int32 sums (module doc): this lane's
# (d0, d1, d2, d3); scratch_a and scratch_b are read under the simulator only
mma_s8 = device(_mma_s8_simulated if SIMULATOR else _mma_s8_gpu)
