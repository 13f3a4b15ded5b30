"""Llama (Llama 2/3, Mistral, TinyLlama, SmolLM2): pre-norm, RoPE on pairs, SwiGLU FFN."""
from __future__ import annotations

import math

import numpy as np

from ..kernels.cpu import ops
from ..weights import Activations, matmul
from .base import Transformer


class Llama(Transformer):
    name = "llama"
    rope_neox = False  # the converter permutes Q/K so that rotation is on adjacent pairs

    def layer_forward(self, il, w, x, positions, cache):
        hp = self.hp
        act = Activations(self.norm(x, w["attn_norm"]))
        q, k, v = matmul(w["attn_q"], act), matmul(w["attn_k"], act), matmul(w["attn_v"], act)
        self.rope(q, hp.n_head, positions, hp.rope_base)
        self.rope(k, hp.n_head_kv, positions, hp.rope_base)
        attn = self.attend(il, q, k, v, positions, cache, 1.0 / math.sqrt(hp.head_dim))
        x = x + matmul(w["attn_output"], Activations(attn))

        act = Activations(self.norm(x, w["ffn_norm"]))
        gate, up = matmul(w["ffn_gate"], act), matmul(w["ffn_up"], act)
        h = np.empty_like(gate)
        ops.swiglu(gate, up, h)
        return x + matmul(w["ffn_down"], Activations(h))
