"""The quantized products (lanes, Q4_K, Q6_K, the K-quant lanes) as C functions whose addresses
the compiled layers call (layers.Weights.product_fn, .rows3_fn; call_qproduct, call_lanes3), as
float_products.py does for the float formats.

A layer that linked every product in compiled all of them into every architecture's layer
(and again into `linear`): two thirds of a first run's compile for formats the model does not
have. Called through pointers of one signature, the layer code carries none of them, and each
product compiles (or loads from the cache) once, when a model that has it loads.
All of a product's arguments travel in one signature: each product reads the ones it needs.
"""
import numba as nb
import numpy as np
from numba import types
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads

from .float_products import _caller, cfuncs_cached
from .k_quants import qmatmul_k_lanes
from .lanes import qmatmul_lanes, qmatmul_lanes3
from .matmul import (PRODUCT_K_LANES, PRODUCT_K_LANES_8X8, PRODUCT_LANES, PRODUCT_LANES_BLOCKS, PRODUCT_Q4_K,
                     PRODUCT_Q6_K, qmatmul_q4_k, qmatmul_q6_k)

_BYTES = types.uint8[::1]            # the tiles' codes (and a lanes format's scales)
_SCALES = types.float32[:, :, ::1]   # (NT, K/G, R): the K-quants' int8 scales in their bytes; sb
_CODES = types.int8[::1]             # (T*K,) the activations' codes
_FLOATS = types.float32[:, ::1]      # (T, K/32) activation scales and sums; (T, N) outputs
_SUMS = types.int32[:, ::1]          # (T, K/4), (T, K/16), (T, K/32) sums of activation codes
_INT = types.int64
# (data, scale, bias, sb, offset, bits, has_min, row_by_row, xq, xd32, xs32, xn4, xn16, xn32, out)
QPRODUCT = types.void(_BYTES, _SCALES, _SCALES, _SCALES, _INT, _INT, _INT, _INT, _CODES, _FLOATS, _FLOATS, _SUMS,
                      _SUMS, _SUMS, _FLOATS)
# (data1, data2, data3, bits, has_min, offset, xq, xd32, xs32, xn4, out1, out2, out3)
LANES3 = types.void(_BYTES, _BYTES, _BYTES, _INT, _INT, _INT, _CODES, _FLOATS, _FLOATS, _SUMS, _FLOATS, _FLOATS,
                    _FLOATS)


def _lanes(data, scale, bias, sb, offset, bits, has_min, row_by_row, xq, xd32, xs32, xn4, xn16, xn32, out):
    qmatmul_lanes(data, bits, has_min != 0, offset, False, xq, xd32, xs32, xn4, out)


def _lanes_blocks(data, scale, bias, sb, offset, bits, has_min, row_by_row, xq, xd32, xs32, xn4, xn16, xn32, out):
    qmatmul_lanes(data, bits, has_min != 0, offset, True, xq, xd32, xs32, xn4, out)


def _q4_k(data, scale, bias, sb, offset, bits, has_min, row_by_row, xq, xd32, xs32, xn4, xn16, xn32, out):
    qmatmul_q4_k(data, scale.view(np.int8), bias.view(np.int8), sb, xq, xd32, xn32, row_by_row != 0, out)


def _q6_k(data, scale, bias, sb, offset, bits, has_min, row_by_row, xq, xd32, xs32, xn4, xn16, xn32, out):
    qmatmul_q6_k(data, scale.view(np.int8), sb, xq, xd32, xn4, xn16, row_by_row != 0, out)


def _k_lanes(data, scale, bias, sb, offset, bits, has_min, row_by_row, xq, xd32, xs32, xn4, xn16, xn32, out):
    qmatmul_k_lanes(data, scale.view(np.int8), bias.view(np.int8), sb, bits == 4, offset, xq, xd32, xn4, xn16,
                    row_by_row != 0, False, out)


def _k_lanes_8x8(data, scale, bias, sb, offset, bits, has_min, row_by_row, xq, xd32, xs32, xn4, xn16, xn32, out):
    qmatmul_k_lanes(data, scale.view(np.int8), bias.view(np.int8), sb, bits == 4, offset, xq, xd32, xn4, xn16,
                    row_by_row != 0, True, out)


def _lanes3(data1, data2, data3, bits, has_min, offset, xq, xd32, xs32, xn4, out1, out2, out3):
    qmatmul_lanes3(data1, data2, data3, bits, has_min != 0, offset, False, xq, xd32, xs32, xn4, out1, out2, out3)


def _lanes3_blocks(data1, data2, data3, bits, has_min, offset, xq, xd32, xs32, xn4, out1, out2, out3):
    qmatmul_lanes3(data1, data2, data3, bits, has_min != 0, offset, True, xq, xd32, xs32, xn4, out1, out2, out3)


def _no_lanes3(data1, data2, data3, bits, has_min, offset, xq, xd32, xs32, xn4, out1, out2, out3):
    pass


# product id -> (its product, its three-matrix product: the lanes formats only)
_SOURCES = {PRODUCT_LANES: (_lanes, _lanes3), PRODUCT_LANES_BLOCKS: (_lanes_blocks, _lanes3_blocks),
            PRODUCT_Q4_K: (_q4_k, _no_lanes3), PRODUCT_Q6_K: (_q6_k, _no_lanes3),
            PRODUCT_K_LANES: (_k_lanes, _no_lanes3), PRODUCT_K_LANES_8X8: (_k_lanes_8x8, _no_lanes3)}
_compiled: dict = {}  # source function -> its cfunc


def _cfunc(sig, source):
    if source not in _compiled:
        _launch_threads()  # (their code links against the threading layer's symbols: float_products.products)
        _compiled[source] = nb.cfunc(sig, cache=True, nogil=True)(source)
    return _compiled[source]


def qproducts(product: int) -> tuple[int, int]:
    """The addresses of the (product, three-matrix product) C functions of a product id
    (matmul.PRODUCT_*), compiled (or loaded from the cache) on first request and kept for the
    life of the process."""
    product_source, lanes3_source = _SOURCES[product]
    return _cfunc(QPRODUCT, product_source).address, _cfunc(LANES3, lanes3_source).address


def qproducts_cached(product: int) -> bool:
    """Whether qproducts(product) loads its C functions without compiling them."""
    sources = _SOURCES[product]
    return cfuncs_cached(sources, all(source in _compiled for source in sources))


def _call_qproduct(typingctx, address, data, scale, bias, sb, offset, bits, has_min, row_by_row, xq, xd32, xs32,
                   xn4, xn16, xn32, out):
    return _caller(QPRODUCT)(typingctx, address, data, scale, bias, sb, offset, bits, has_min, row_by_row, xq, xd32,
                             xs32, xn4, xn16, xn32, out)


def _call_lanes3(typingctx, address, data1, data2, data3, bits, has_min, offset, xq, xd32, xs32, xn4, out1, out2,
                 out3):
    return _caller(LANES3)(typingctx, address, data1, data2, data3, bits, has_min, offset, xq, xd32, xs32, xn4, out1,
                           out2, out3)


call_qproduct = intrinsic(_call_qproduct)  # call_qproduct(address, *QPRODUCT's arguments)
call_lanes3 = intrinsic(_call_lanes3)      # call_lanes3(address, *LANES3's arguments)
