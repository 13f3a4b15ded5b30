"""Fused multiply-add for Numba CPU code: fma(a, b, c) = a * b + c with one rounding.

ggml's SIMD kernels accumulate with FMA instructions; reproducing their results bit for bit
needs the same single rounding, which plain Numba arithmetic (two roundings, or contraction
left to LLVM's choice under fastmath) does not promise. Calls vectorize (llvm.fma)."""
from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def fma(typingctx, a, b, c):
    """float32 fma; all three arguments float32."""
    if not all(t == types.float32 for t in (a, b, c)):
        return None
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen
