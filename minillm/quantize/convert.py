"""One tensor from its type in the input file to its target type, via the Numba kernels.

Sources: F32 rows are read in place, F16/BF16 rows are decoded inside the kernel, quantized rows are dequantized first (bit-exact with ggml, as
llama-quantize does with --allow-requantize). The result is validated as ggml_validate_row_data
does: a block scale (or a float value) that is inf or NaN is an error.
"""
from __future__ import annotations

import numba
import numpy as np

from ..errors import MinillmError
from ..formats import Format
from ..gguf_file import GGUFFile
from ..kernels.cpu.quantize import SOURCE_KINDS, SRC_F32, quantize_rows
from ..kernels.cpu.unpack import dequantize
from .plan import TensorPlan

# byte offsets of the f16 fields (scales, mins) in one block (ggml-common.h)
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}
# float formats: (dtype of the bits, exponent mask): all exponent bits set is inf or NaN
FLOAT_MASKS = {"F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80), "F32": (np.uint32, 0x7F800000)}


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise MinillmError(f"threads must be at least 1, got {threads}", ("threads",))
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))


def source_rows(fmt: Format, raw: np.ndarray, n_cols: int):
    """(rows, row_bytes) raw bytes -> (src, kind) as quantize_rows takes them."""
    if fmt.name == "F32":
        return raw.view(np.float32), SRC_F32
    if fmt.name in SOURCE_KINDS:
        return raw.view(np.uint16), SOURCE_KINDS[fmt.name]
    return dequantize(fmt, raw, n_cols), SRC_F32


def invalid_values(fmt: Format, out: np.ndarray) -> bool:
    """True if any block scale (or float value) of the converted rows is inf or NaN."""
    if fmt.name in FLOAT_MASKS:
        dtype, mask = FLOAT_MASKS[fmt.name]
        bits = out.view(dtype)
        return bool(((bits & mask) == mask).any())
    blocks = out.reshape(-1, fmt.type_size)
    for off in F16_FIELDS[fmt.name]:
        bits = blocks[:, off].astype(np.uint16) | (blocks[:, off + 1].astype(np.uint16) << 8)
        if ((bits & 0x7C00) == 0x7C00).any():
            return True
    return False


class TensorConverter:
    """Converts the tensors of one file, one at a time, into a single reused output buffer
    (a fresh buffer per tensor would cost a page fault per 4 KiB written)."""

    def __init__(self, gf: GGUFFile, tensors: list[TensorPlan], imatrix: dict[str, np.ndarray] | None = None):
        self.gf = gf
        self.imatrix = imatrix or {}             # output tensor name -> column importances
        self.buffer = np.empty(max((t.dst_bytes for t in tensors if t.converts), default=0), np.uint8)

    def __call__(self, t: TensorPlan) -> np.ndarray:
        """The tensor's bytes in its target type, (rows, row_bytes) uint8; valid until the next call."""
        raw = self.gf.raw(t.source)
        if not t.converts:
            return raw
        src, kind = source_rows(t.src, raw, t.shape[0])
        out = quantize_rows(t.dst, src, kind, out=self.buffer[:t.dst_bytes].reshape(src.shape[0], -1),
                            imatrix=self.imatrix.get(t.name))
        if invalid_values(t.dst, out):
            raise MinillmError(f"tensor {t.name}: {t.dst.name} data has inf or NaN values "
                               "(the input holds non-finite or out-of-range numbers)")
        return out
