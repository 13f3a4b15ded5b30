"""The float products (float_matmul, float_matvec3) as C functions whose addresses the compiled
layers call (layers.Weights.float_product, .float_rows3; call_product, call_rows3).

A layer that linked the float products in compiled them for every float format into every
layer, and again whenever a model's weights changed the layer's argument types. Called through
pointers of one signature, the layer code is the same for every model: a quantized model's
layers carry no float code and point at no-ops, and a float model compiles only its own
format's two products (cached on disk like every kernel), when its first matrix loads.
Weights arrive as the file's bits (uint16; F32 as pairs, viewed as uint32: F32's own code only)
and are read as their format here.
The addresses travel as plain integers, which Numba types at no cost on every call (a tuple
holding function objects made each call from Python pay microseconds per object).
"""
import numba as nb
import numpy as np
from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads

from .float_matmul import FLOAT_BF16, FLOAT_F16, FLOAT_F32, float_matmul, float_matvec3

_BITS = types.uint16[:, ::1]    # (N, K) the weights' bits; (N, 2K) for F32
_ROWS = types.float32[:, ::1]   # (T, K) activations, (T, N) outputs
PRODUCT = types.void(_BITS, _ROWS, types.int64, _ROWS)                           # (w, x, fmt, out)
ROWS3 = types.void(_BITS, _BITS, _BITS, types.int64, _ROWS, types.int64, _ROWS, _ROWS, _ROWS)  # (w1..3, n, x, fmt, o1..3)


def _product_f32(w, x, fmt, out):
    float_matmul(w.view(np.uint32), x, fmt, out)


def _product_f16(w, x, fmt, out):
    float_matmul(w, x, fmt, out)


def _product_bf16(w, x, fmt, out):
    float_matmul(w.view(np.int16), x, fmt, out)


def _rows3_f32(w1, w2, w3, n_mats, x, fmt, o1, o2, o3):
    float_matvec3(w1.view(np.uint32), w2.view(np.uint32), w3.view(np.uint32), n_mats, x, fmt, o1, o2, o3)


def _rows3_f16(w1, w2, w3, n_mats, x, fmt, o1, o2, o3):
    float_matvec3(w1, w2, w3, n_mats, x, fmt, o1, o2, o3)


def _rows3_bf16(w1, w2, w3, n_mats, x, fmt, o1, o2, o3):
    float_matvec3(w1.view(np.int16), w2.view(np.int16), w3.view(np.int16), n_mats, x, fmt, o1, o2, o3)


def _no_product(w, x, fmt, out):
    pass


def _no_rows3(w1, w2, w3, n_mats, x, fmt, o1, o2, o3):
    pass


_SOURCES = {None: (_no_product, _no_rows3), FLOAT_F32: (_product_f32, _rows3_f32),
            FLOAT_F16: (_product_f16, _rows3_f16), FLOAT_BF16: (_product_bf16, _rows3_bf16)}
_compiled: dict = {}


def products(fmt: int | None) -> tuple[int, int]:
    """The addresses of the (product, rows3) C functions for float format fmt (None: the no-ops
    of matrices without float weights), compiled (or loaded from the cache) on first request
    and kept for the life of the process."""
    if fmt not in _compiled:
        # the products run parallel regions: their code, loaded from the cache, links against
        # the threading layer's symbols, which exist once its threads are started
        _launch_threads()
        product, rows3 = _SOURCES[fmt]
        _compiled[fmt] = (nb.cfunc(PRODUCT, cache=True, nogil=True)(product),
                          nb.cfunc(ROWS3, cache=True, nogil=True)(rows3))
    return tuple(f.address for f in _compiled[fmt])


def products_cached(fmt: int | None) -> bool:
    """Whether products(fmt) loads its C functions without compiling them."""
    return cfuncs_cached(_SOURCES[fmt], _compiled.get(fmt) is not None)


def cfuncs_cached(sources, loaded: bool) -> bool:
    """Whether the C functions of these Python sources are loaded already or in Numba's on-disk
    cache for the current source (its index read as Numba reads it: CpuBackend.kernels_cached)."""
    from numba.core.caching import FunctionCache

    try:
        return loaded or all(FunctionCache(source)._cache_file._load_index() for source in sources)
    except (AttributeError, OSError):  # another Numba version: assume the worst, say we compile
        return False


def _caller(c_sig):
    """An intrinsic call(address, *args) of a C function of signature c_sig (a cfunc's: each
    argument by value as Numba's data model holds it), the arguments checked against it."""
    def typer(typingctx, address, *args):
        if not isinstance(address, types.Integer) or len(args) != len(c_sig.args) or any(
                a.dtype != c.dtype or a.ndim != c.ndim or a.layout != "C" if isinstance(c, types.Array) else a != c
                for a, c in zip(args, c_sig.args)):
            raise TypingError(f"expected (address, {', '.join(map(str, c_sig.args))}), got {address}, {args}")

        def codegen(context, builder, signature, llargs):
            fnty = ir.FunctionType(context.get_value_type(c_sig.return_type),
                                   [context.get_value_type(t) for t in c_sig.args])
            fn = builder.inttoptr(llargs[0], fnty.as_pointer())
            builder.call(fn, llargs[1:])
            return context.get_dummy_value()

        return types.void(address, *args), codegen

    return typer


def _call_product(typingctx, address, w, x, fmt, out):
    return _caller(PRODUCT)(typingctx, address, w, x, fmt, out)


def _call_rows3(typingctx, address, w1, w2, w3, n_mats, x, fmt, o1, o2, o3):
    return _caller(ROWS3)(typingctx, address, w1, w2, w3, n_mats, x, fmt, o1, o2, o3)


call_product = intrinsic(_call_product)   # call_product(address, w, x, fmt, out)
call_rows3 = intrinsic(_call_rows3)       # call_rows3(address, w1, w2, w3, n_mats, x, fmt, o1, o2, o3)
