"""Mistral 3 (Ministral 3, Mistral Small 3.x; dense): Llama's layer with YaRN read in full (its
beta keys and log multiplier) and Llama 4's attention temperature: after RoPE, q of the token
at position p is multiplied by log(floor(p / n) + 1) * temperature_scale + 1, n the YaRN
original context (attention.temperature_scale; absent: no temperature)."""
from __future__ import annotations

import numba as nb
import numpy as np

from ..kernels.cpu import layers as cpu_layers
from .base import Transformer
from .llama import Llama

ops = cpu_layers  # the backend operations the layer is written in (see llama.py)


def mistral3_layer_ops(x, w, positions, kv, out_from, rope_table, q_rows, eps, n_head, n_head_kv, head_dim,
                       rope_dims, kq_scale):
    """x (T, E) -> (T - out_from, E); w: the layer's tensors in Mistral3.layer_order; q_rows (T,):
    each row's attention temperature (empty: none)."""
    attn_norm, wq, wk, wv, wo, ffn_norm, wg, wu, wd, bo = w
    q, k, v = ops.linear3(wq, wk, wv, ops.norm(x, attn_norm, eps))
    attn = ops.rope_attend_rows(q, k, v, positions, rope_table, kv, q_rows, kq_scale, n_head, n_head_kv, head_dim,
                                rope_dims)
    x = ops.add(x[out_from:], ops.add_bias(ops.linear(wo, attn), bo)[out_from:])
    gate, up = ops.linear2(wg, wu, ops.norm(x, ffn_norm, eps))
    return ops.add(x, ops.linear(wd, ops.swiglu(gate, up)))


mistral3_layer = nb.njit(cache=True, nogil=True)(mistral3_layer_ops)


class Mistral3(Llama):
    name = "mistral3"
    layer_function = staticmethod(mistral3_layer)
    layer_order = Transformer.layer_order + ("attn_output.bias",)
    handled_keys = Llama.handled_keys | {"rope.scaling.yarn_log_multiplier", "attention.temperature_scale"}

    def read_hparams(self):
        hp = super().read_hparams()
        self.temperature_scale = self.meta.float("attention.temperature_scale", 0.0, 1e6, default=0.0)
        return hp

    def yarn_log_mul(self):
        return self.meta.float("rope.scaling.yarn_log_multiplier", 0.0, 1e6, default=0.0)

    def read_rope_scaling(self):
        rope = super().read_rope_scaling()
        rope.beta_fast = self.meta.float("rope.scaling.yarn_beta_fast", 0.0, 1e6, default=32.0)
        rope.beta_slow = self.meta.float("rope.scaling.yarn_beta_slow", 0.0, 1e6, default=1.0)
        return rope

    def optional_layer_tensors(self, il):
        return {"attn_output.bias": (self.hp.n_embd,)}

    def cpu_only(self):
        return "Llama 4's attention temperature" if self.temperature_scale else None

    def features(self):
        out = super().features()
        if self.temperature_scale:
            out.append(f"attention temperature {self.temperature_scale:g} per {self.rope.n_ctx_orig} positions")
        return out

    def rope_tables(self, positions, n_ctx):
        """(the rope tables, each row's q scale): log(floor(p / n) + 1) * scale + 1 as llama.cpp
        sets it (the division in float32, the rest in double, then float32)."""
        tables = super().rope_tables(positions, n_ctx)
        if not self.temperature_scale:
            return tables, np.zeros(0, np.float32)
        floors = np.floor(positions.astype(np.float32) / np.float32(self.rope.n_ctx_orig))
        scales = np.log(floors.astype(np.float64) + 1.0) * np.float64(np.float32(self.temperature_scale)) + 1.0
        return tables, scales.astype(np.float32)

    def layer_args(self, il, tables):
        hp = self.hp
        rope_table, q_rows = tables
        return (rope_table, q_rows, np.float32(hp.rms_eps), hp.n_head, hp.n_head_kv, hp.head_dim, hp.rope_dims,
                np.float32(self.attn_scale))
