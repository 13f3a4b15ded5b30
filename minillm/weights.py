"""Weight matrices ready for the kernels, built from the mapped GGUF tensors."""
from __future__ import annotations

import numpy as np

from .formats import Format
from .kernels.cpu import matmul as mm
from .kernels.cpu.f16 import f16_round  # noqa: F401  (re-exported for model code)
from .kernels.cpu.unpack import dequantize, unpack


class QMatrix:
    """A quantized weight matrix (n_rows outputs, n_cols inputs) in the tiled layout."""

    def __init__(self, name: str, fmt: Format, raw: np.ndarray, n_rows: int, n_cols: int):
        self.name, self.format = name, fmt
        self.n_rows, self.n_cols = n_rows, n_cols
        self.group = fmt.group
        self.kind = mm.KIND_IDS[fmt.activation]
        q, scale, bias = unpack(fmt, raw, n_cols)
        self.data, self.scale, self.bias = mm.repack(q, scale, bias)

    def __call__(self, act: "Activations") -> np.ndarray:
        """out (T, n_rows) = x @ W.T, with act holding x quantized for this matrix's kind."""
        xd, xs, xn = (act.d16, act.s16, act.n16) if self.group == 16 else (act.d32, act.s32, act.n32)
        out = np.empty((act.q.shape[0], self.n_rows), dtype=np.float32)
        mm.qmatmul_tiles(self.data, self.scale, self.bias, self.group, act.q.reshape(-1), xd, xs, xn, out)
        return out


class FMatrix:
    """A float weight matrix (F32, F16, BF16): x rounded to the weight type, f32 products."""

    kind = -1

    def __init__(self, name: str, fmt: Format, raw: np.ndarray, n_rows: int, n_cols: int):
        self.name, self.format = name, fmt
        self.n_rows, self.n_cols = n_rows, n_cols
        self.weight = np.ascontiguousarray(dequantize(fmt, raw, n_cols))  # (n_rows, n_cols)

    def __call__(self, act: "Activations") -> np.ndarray:
        x = act.x
        if self.format.name == "F16":
            x = x.astype(np.float16).astype(np.float32)
        elif self.format.name == "BF16":
            bits = x.view(np.uint32)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.view(np.float32)
        return x @ self.weight.T


class Activations:
    """x (T, K) and its int8 quantization for one activation kind (filled on demand)."""

    def __init__(self, x: np.ndarray):
        self.x = np.ascontiguousarray(x, dtype=np.float32)
        self.kind = None

    def for_matrix(self, w) -> "Activations":
        if w.kind >= 0 and w.kind != self.kind:
            T, K = self.x.shape
            self.q = np.empty((T, K), np.int8)
            self.d16 = np.empty((T, K // 16), np.float32)
            self.s16 = np.empty((T, K // 16), np.float32)
            self.n16 = np.empty((T, K // 16), np.int32)
            self.d32 = np.empty((T, K // 32), np.float32)
            self.s32 = np.empty((T, K // 32), np.float32)
            self.n32 = np.empty((T, K // 32), np.int32)
            mm.quantize_act(self.x, w.kind, self.q, self.d16, self.s16, self.n16, self.d32, self.s32, self.n32)
            self.kind = w.kind
        return self


def matmul(w, act: Activations) -> np.ndarray:
    return w(act.for_matrix(w))


def make_matrix(name: str, fmt: Format, raw: np.ndarray, n_rows: int, n_cols: int):
    cls = QMatrix if fmt.quantized else FMatrix
    return cls(name, fmt, raw, n_rows, n_cols)
