"""Model architectures, chosen by the GGUF key `general.architecture`.

Each architecture is one small module defining a subclass of `base.Transformer`.
"""
from __future__ import annotations

from ..errors import ModelError
from .gemma3 import Gemma3
from .llama import Llama

ARCHITECTURES = {cls.name: cls for cls in (Llama, Gemma3)}


def get_architecture(name: str | None):
    if name is None:
        raise ModelError("the file has no general.architecture key")
    try:
        return ARCHITECTURES[name]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ModelError(f"unsupported architecture '{name}' (supported: {supported})") from None
