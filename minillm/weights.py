"""Weight matrices ready for the kernels, built from the mapped GGUF tensors."""
from __future__ import annotations

import subprocess
import sys
import time
from contextlib import nullcontext

import numpy as np

from .formats import REPACK_ROWS, Format
from .kernels.cpu import lanes
from .kernels.cpu import layers
from .kernels.cpu.attention_fns import attention_fn, attention_fn_cached
from .kernels.cpu.float_products import products, products_cached
from .kernels.cpu.quant_products import qproducts, qproducts_cached
from .kernels.cpu import matmul as mm
from .kernels.cpu.ops import GGML_AVX512
from .kernels.cpu.unpack import dequantize, superblocks, unpack

_FLOAT_FORMATS = {"F32": layers.FLOAT_F32, "F16": layers.FLOAT_F16, "BF16": layers.FLOAT_BF16}
_NO_BYTES = np.zeros(0, np.uint8)
_NO_SCALES = np.zeros((0, 0, mm.R), np.float32)
_NO_FLOATS = np.zeros((0, 0), np.uint16)  # no float weights (and no-op float products)


def row_by_row(packed: tuple) -> tuple:
    """The same weights (shared arrays; a Weights or its plain tuple) with every batch row
    multiplied as if alone, where the arithmetic otherwise follows the batch size
    (kernels/cpu/matmul.py BATCH_DEPENDENT): a plain tuple, as compiled calls take it."""
    w = layers.Weights(*packed)
    return layers.plain(w._replace(row_by_row=True) if w.product in mm.BATCH_DEPENDENT else w)


def product_id(fmt: Format, n_rows: int) -> int:
    """How llama.cpp's x86 backend sums a quantized matrix of n_rows rows (matmul.PRODUCT_*):
    its format's product, or the repacked one where llama.cpp repacks the matrix."""
    repacked = fmt.repacked_product and n_rows % REPACK_ROWS == 0 and (GGML_AVX512 or not fmt.repacked_on_avx512_only)
    return mm.PRODUCT_IDS[fmt.repacked_product if repacked else fmt.product]


def product_kinds(shapes) -> tuple[set, set]:
    """(the quantized product ids, the float formats, None included) of matrices of these
    (format, rows): whose C functions a model's matrices call."""
    float_formats = {_FLOAT_FORMATS[fmt.name] for fmt, _ in shapes if not fmt.quantized} | {None}
    return {product_id(fmt, rows) for fmt, rows in shapes if fmt.quantized}, float_formats


def products_ready(quantized, float_formats) -> bool:
    """Whether these products' C functions load without compiling (see product_kinds)."""
    return all(map(qproducts_cached, quantized)) and all(map(products_cached, float_formats))


def compile_products(quantized, float_formats, cache_dtype=None) -> None:
    """Compile (or load) these products' C functions (see product_kinds), and the attention
    over caches of cache_dtype's (kernels/cpu/attention_fns.py) where one is given."""
    if cache_dtype is not None:
        attention_fn(cache_dtype)
    for fmt in float_formats:
        products(fmt)
    for product in quantized:
        qproducts(product)


def prepare_products(shapes, on_compile=None) -> None:
    """Compile (or load) the products' C functions for matrices of these (format, rows) before
    they are packed: inside on_compile() when any must compile (a first run), so that a caller
    can show it."""
    kinds = product_kinds(shapes)
    with nullcontext() if on_compile is None or products_ready(*kinds) else on_compile():
        compile_products(*kinds)


class ProductsElsewhere:
    """A first run's products and attention compiled in another process (compile_products),
    while this one compiles the layer: two cores, two compilers. `join` waits for it; whatever
    it did not finish (it failed, or was killed) compiles here when its matrices get their
    addresses. It ends with this process (Linux's parent-death signal).
    siblings=True: other processes compile the quantized products and attention already
    (`warm --all`'s tasks); `join` waits until they are in the cache (at most SIBLINGS_SECONDS).
    The float products (a Qwen3 MoE router's F32), which no sibling compiles, compile here."""

    SIBLINGS_SECONDS = 300

    def __init__(self, shapes, cache_dtype, siblings: bool = False):
        quantized, float_formats = product_kinds(shapes)
        self.process = None
        if siblings:
            self.ready = lambda: products_ready(quantized, float_formats & {None}) and attention_fn_cached(cache_dtype)
            return
        code = ("import ctypes, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); "  # PR_SET_PDEATHSIG
                "from minillm.weights import compile_products; "
                "compile_products({int(a) for a in sys.argv[1].split()}, "
                "{None if a == '-' else int(a) for a in sys.argv[2].split()}, sys.argv[3])")
        self.process = subprocess.Popen(
            [sys.executable, "-c", code, " ".join(map(str, quantized)),
             " ".join("-" if f is None else str(f) for f in float_formats), np.dtype(cache_dtype).name],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def join(self) -> None:
        if self.process is not None:
            self.process.wait()
            return
        deadline = time.monotonic() + self.SIBLINGS_SECONDS
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.25)


def with_products(packed: tuple) -> tuple:
    """A matrix's plain Weights with the addresses of its products' C functions (compiled or
    loaded now): for matrices packed while they compiled elsewhere (Matrix(addresses=False))."""
    w = layers.Weights(*packed)
    product_fn, rows3_fn = products(w.float_format) if w.kind < 0 else qproducts(w.product)
    return layers.plain(w._replace(product_fn=product_fn, rows3_fn=rows3_fn))


def with_product(packed: layers.Weights, product: int) -> layers.Weights:
    """Quantized weights summed by another product (matmul.PRODUCT_*) of the same layout."""
    return layers.Weights(*with_products(packed._replace(product=product)))


# the repacked products whose batch kernel (gemm) sums otherwise than their gemv
REPACKED_BATCH_DEPENDENT = (mm.PRODUCT_Q4_K, mm.PRODUCT_K_LANES_8X8)


def stack_experts(experts: list) -> tuple:
    """The plain Weights of each expert of a tensor, stacked (kernels/cpu/moe.py): every array
    with a leading expert axis (the codes page-aligned), the scalars the first expert's (the
    same for all). llama.cpp's mul_mat_id multiplies a repacked expert one token at a time (its
    gemv: row_by_row), the others as a product of the rows routed to the expert (the tiled
    K-quant kernel from 8 of them on), as our batch kernels do."""
    first = layers.Weights(*experts[0])
    fields = list(first)
    for name in ("data", "scale", "bias", "fweight", "sb"):
        at = layers.Weights._fields.index(name)
        parts = [w[at] for w in experts]
        if name == "data":
            stacked = lanes.aligned_zeros(len(parts) * parts[0].size).reshape(len(parts), parts[0].size)
            for e, part in enumerate(parts):
                stacked[e] = part
        else:
            stacked = np.stack(parts)
        fields[at] = stacked
    fields[layers.Weights._fields.index("row_by_row")] = first.kind >= 0 and first.product in REPACKED_BATCH_DEPENDENT
    return tuple(fields)


class Matrix:
    """A weight matrix (n_rows outputs, n_cols inputs). `packed` is the Weights named tuple
    the compiled layers take (kernels/cpu/layers.py):
    32-block formats -> lanes tiles: codes at their width and float16 scales (kernels/cpu/lanes.py);
    K-quants -> codes tiled for the integer kernels, with their integer sub-block scales and
    mins as int8, and super-block scales `sb`;
    F32, F16, BF16 -> the file's bits as uint16 (n_rows, n_cols or 2 * n_cols for F32)."""

    def __init__(self, name: str, fmt: Format, raw: np.ndarray, n_rows: int, n_cols: int, release=None,
                 addresses: bool = True):
        """raw (n_rows, row_bytes) uint8; release(r0, r1), if given, is told when rows r0..r1 of
        raw have been read (the loader drops their mapped pages). addresses=False: the products'
        addresses left 0, for with_products to fill in once they are compiled."""
        self.name, self.format = name, fmt
        self.n_rows, self.n_cols = n_rows, n_cols
        if not fmt.quantized:  # the file's bits, as uint16 for every float format (layers.Weights.fweight)
            weight = np.ascontiguousarray(raw).view(np.uint16).copy()
            float_format = _FLOAT_FORMATS[fmt.name]
            self.packed = layers.Weights(_NO_BYTES, _NO_SCALES, _NO_SCALES, 0, 0, weight, n_rows, 0, -1,
                                         float_format, _NO_SCALES, 0, False,
                                         *(products(float_format) if addresses else (0, 0)))
            return
        pack = self._pack_lanes if fmt.product == "lanes" else self._pack_tiles
        data, scale, bias, offset, bits, sb = pack(fmt, raw, n_rows, n_cols, release or (lambda r0, r1: None))
        product = product_id(fmt, n_rows)
        self.packed = layers.Weights(data, scale, bias, offset, bits, _NO_FLOATS, n_rows, fmt.group,
                                     mm.KIND_IDS[fmt.activation], 0, sb, product, False,
                                     *(qproducts(product) if addresses else (0, 0)))

    @staticmethod
    def _chunks(fmt, raw, n_rows, n_cols, release):
        """(row0, raw rows, q, scale, bias) a chunk of rows at a time: no full transient copy."""
        for row0 in range(0, n_rows, mm.CHUNK_ROWS):
            chunk = raw[row0:row0 + mm.CHUNK_ROWS]
            yield (row0, chunk, *unpack(fmt, chunk, n_cols))
            release(row0, row0 + mm.CHUNK_ROWS)

    def _pack_lanes(self, fmt, raw, n_rows, n_cols, release):
        data = lanes.empty_lanes(n_rows, n_cols, fmt.code_bits, fmt.has_bias)
        for row0 in range(0, n_rows, mm.CHUNK_ROWS):
            lanes.fill_lanes(data, row0, raw[row0:row0 + mm.CHUNK_ROWS], fmt)
            release(row0, row0 + mm.CHUNK_ROWS)
        return data, _NO_SCALES, _NO_SCALES, fmt.code_offset, fmt.code_bits, _NO_SCALES

    def _pack_tiles(self, fmt, raw, n_rows, n_cols, release):
        """The K-quants: codes in tiles, the format's integer sub-block scales and mins (int8)
        and each super-block's d and dmin (sb)."""
        tiles = mm.empty_tiles(n_rows, n_cols, n_cols // fmt.group, n_cols // fmt.group if fmt.has_bias else 0,
                               fmt.nibble_offset)
        sb = np.zeros(((n_rows + mm.R - 1) // mm.R, 2 * (n_cols // 256), mm.R), np.float32)
        for row0, chunk, q, _, _ in self._chunks(fmt, raw, n_rows, n_cols, release):
            scale, bias, chunk_sb = superblocks(fmt, chunk, n_cols)
            mm.tile_floats(chunk_sb, row0, sb)
            mm.fill_tiles(tiles, row0, q, scale, bias)
        data, scale_t, bias_t, offset, nibbles = tiles
        # the tuple's scale slots are float32 3-D for all formats: the int8 bytes in them
        return data, scale_t.view(np.float32), bias_t.view(np.float32), offset, 4 if nibbles else 8, sb

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """(T, n_rows) = x (T, n_cols) @ W.T."""
        return layers.linear(self.packed, np.ascontiguousarray(x, dtype=np.float32))
