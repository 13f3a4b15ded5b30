"""`minillm quantize`: llama-quantize-compatible model quantization, bit-identical to llama.cpp.

    import minillm
    summary = minillm.quantize("model-f16.gguf", "model-q4_k_m.gguf", "Q4_K_M")
    print(summary.size_lines())

(the package itself is callable: minillm.quantize(...) is minillm.quantize.quantize(...))

Modules: ftypes (TYPE names and ids), plan (llama.cpp's per-tensor type rules), convert (one
tensor through the Numba kernels), writer (GGUF header, crash-safe output file), run (the driver).
The heavy modules load on first use, so importing this package (the CLI does) stays cheap.
"""
import sys
import types

from .ftypes import FILE_TYPES, TENSOR_TYPES, FileType, parse_file_type, parse_tensor_type

__all__ = ["quantize", "QuantizeSummary", "FileType", "FILE_TYPES", "TENSOR_TYPES",
           "parse_file_type", "parse_tensor_type"]


class _CallableModule(types.ModuleType):
    """Lets `minillm.quantize(...)` call the quantizer while `minillm.quantize` stays a package."""

    def __call__(self, *args, **kwargs):
        return self.quantize(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule


def __getattr__(name):
    if name in ("quantize", "QuantizeSummary"):
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module 'minillm.quantize' has no attribute '{name}'")
