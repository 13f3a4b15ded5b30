"""Model architectures, chosen by the GGUF key `general.architecture`.

Each architecture is one small module defining a subclass of `base.Transformer`.
"""
from __future__ import annotations

from ..errors import ModelError
from .gemma2 import Gemma2
from .gemma3 import Gemma3
from .granite import Granite
from .granitehybrid import GraniteHybrid
from .lfm2 import Lfm2
from .llama import Llama
from .mistral3 import Mistral3
from .phi3 import Phi3
from .qwen2 import Qwen2
from .qwen3 import Qwen3
from .qwen35 import Qwen35
from .qwen3moe import Qwen3Moe
from .smollm3 import SmolLM3

ARCHITECTURES = {cls.name: cls for cls in (Llama, Qwen2, Qwen3, Qwen35, Lfm2, Phi3, Granite, GraniteHybrid, Gemma2, Gemma3, SmolLM3, Mistral3, Qwen3Moe)}


def get_architecture(name: str | None):
    if name is None:
        raise ModelError("the file has no general.architecture key")
    try:
        return ARCHITECTURES[name]
    except KeyError:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ModelError(f"unsupported architecture '{name}' (supported: {supported})") from None
