"""minillm: run quantized GGUF language models locally."""
from .errors import GGUFError, MinillmError, ModelError
from .model import Model, load

__all__ = ["load", "Model", "MinillmError", "GGUFError", "ModelError"]
__version__ = "0.1.0"
