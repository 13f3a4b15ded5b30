"""minillm: run quantized GGUF language models locally.

    import minillm
    model = minillm.load("models/SmolLM2-135M-Instruct.Q4_1.gguf")
    logits = model.logits([1, 2, 3])   # (3, n_vocab) float32

The engine (and Numba) is imported on first use, so the CLI starts fast.
"""
from .errors import GGUFError, MinillmError, ModelError

__all__ = ["load", "Model", "Request", "quantize", "MinillmError", "GGUFError", "ModelError"]
__version__ = "0.1.0"


def __getattr__(name):
    if name in ("load", "Model"):
        from . import model

        return getattr(model, name)
    if name == "Request":  # a request for Model.scheduler(): prompt, max_tokens, sampling, stop, priority
        from .serving.scheduler import Request

        return Request
    if name == "quantize":  # a callable package: minillm.quantize(IN, OUT, TYPE, ...)
        import importlib

        return importlib.import_module(".quantize", __name__)
    raise AttributeError(f"module 'minillm' has no attribute '{name}'")
