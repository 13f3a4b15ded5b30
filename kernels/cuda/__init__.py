"""numba.cuda kernels for NVIDIA GPUs (the optional `cuda` extra: numba-cuda).

Importing this package imports numba.cuda; the CPU path never does. The same code runs on a
real GPU and under NVIDIA's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set before numba is
imported, or followed by numba.core.config.reload_config()), which is how the tests check it
against the CPU kernels on machines without a GPU; `python -m minillm.kernels.cuda.ptx_check`
compiles every kernel to real PTX without a GPU.

Modules:
    registry    KERNELS: every kernel with the signatures it is checked for
    device      device helpers (f16 rounding, int8 dot products, block reductions)
    norm_quant  rmsnorm, activation quantization, each fused after rmsnorm or a GLU
    blocks      GGUF's quantized blocks decoded in registers (codes, group scales)
    ptx         inline PTX: dp4a and the tensor cores' int8 mma (with simulator twins)
    matmul      quantized and float matrix products, the device weight layouts
    launch      every launch, recorded and replayed (decode steps)
    ops         RoPE + KV store, SwiGLU, GeGLU, residual add
    attention   attention over the f16 KV cache
"""
import numpy as _np

# numba-cuda 0.30 registers an overload for np.row_stack, which numpy 2.5 removed: every kernel
# compile then fails with "module 'numpy' has no attribute 'row_stack'". row_stack was an alias
# of vstack, so the alias is put back where it is missing, before numba-cuda first compiles.
if not hasattr(_np, "row_stack"):
    _np.row_stack = _np.vstack

from .attention import attention, attention_rows  # noqa: E402 (after the numpy alias)
from .matmul import (
    FWeights, QWeights, fmatmul, qmatmul, round_activations, upload_blocks, upload_float_matrix,
)
from .norm_quant import GLU_GELU, GLU_SILU, QActivations, glu_quantize, quantize, rmsnorm, rmsnorm_quantize
from .ops import add_inplace, geglu, rope_store_kv, store_kv, swiglu
from .registry import KERNELS

__all__ = [
    "GLU_GELU", "GLU_SILU", "KERNELS", "FWeights", "QActivations", "QWeights", "add_inplace", "attention",
    "attention_rows", "fmatmul", "geglu", "glu_quantize", "qmatmul", "quantize", "rmsnorm", "rmsnorm_quantize",
    "rope_store_kv", "round_activations", "store_kv", "swiglu", "upload_blocks", "upload_float_matrix",
]
