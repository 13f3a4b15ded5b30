"""Qwen2 (Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen): the Llama layer with biases on q, k and v,
and NEOX RoPE (rotation on the two halves of each head)."""
from __future__ import annotations

from .llama import Llama


class Qwen2(Llama):
    name = "qwen2"
    rope_neox = True
    # llama.cpp b11434's qwen2/qwen3 read no sliding-window keys: they attend to everything
    handled_keys = frozenset({"attention.sliding_window", "attention.sliding_window_pattern"})

    def rope_factor_names(self, kind):
        return ()

    def optional_layer_tensors(self, il):
        shapes = super().optional_layer_tensors(il)
        del shapes["attn_output.bias"]  # llama.cpp's qwen2 has none
        return shapes
