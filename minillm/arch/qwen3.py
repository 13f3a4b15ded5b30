"""Qwen3 (dense): the Llama layer with an RMS norm of each q and k head before RoPE, NEOX RoPE,
no biases."""
from __future__ import annotations

from .llama import Llama


class Qwen3(Llama):
    name = "qwen3"
    rope_neox = True
    # llama.cpp b11434's qwen2/qwen3 read no sliding-window keys: they attend to everything
    handled_keys = frozenset({"attention.sliding_window", "attention.sliding_window_pattern"})

    def rope_factor_names(self, kind):
        return ()

    def layer_tensors(self, il):
        shapes = super().layer_tensors(il)
        shapes.update({"attn_q_norm": (self.hp.head_dim,), "attn_k_norm": (self.hp.head_dim,)})
        return shapes

    def optional_layer_tensors(self, il):
        return {}
