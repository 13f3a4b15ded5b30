"""Llama (Llama 2/3, Mistral, TinyLlama, SmolLM2): pre-norm, RoPE on pairs, SwiGLU FFN."""
from __future__ import annotations

import math

import numba as nb
import numpy as np

from ..kernels.cpu import layers as cpu_layers
from .base import Transformer


def make_layer(ops):
    """The layer, written in the operations of a backend module (kernels/cpu/layers.py or
    kernels/cuda/layers.py): compiled whole for the CPU, run op by op on the GPU."""
    linear, linear3, norm, rope_attend, add, swiglu = (ops.linear, ops.linear3, ops.norm, ops.rope_attend,
                                                       ops.add, ops.swiglu)
    linear2 = ops.linear2

    def llama_layer(x, w, positions, kv, rope_table, eps, n_head, n_head_kv, head_dim, rope_dims, attn_scale):
        """x (T, E) -> (T, E); w: the layer's tensors in Llama.layer_order."""
        attn_norm, wq, wk, wv, wo, ffn_norm, wg, wu, wd = w
        h = norm(x, attn_norm, eps)
        q, k, v = linear3(wq, wk, wv, h)
        attn = rope_attend(q, k, v, positions, rope_table, kv, np.float32(1.0), 0, attn_scale, n_head,
                           n_head_kv, head_dim, rope_dims, False)
        x = add(x, linear(wo, attn))
        h = norm(x, ffn_norm, eps)
        gate, up = linear2(wg, wu, h)
        return add(x, linear(wd, swiglu(gate, up)))

    return llama_layer


llama_layer = nb.njit(cache=True, nogil=True)(make_layer(cpu_layers))


class Llama(Transformer):
    name = "llama"
    rope_neox = False  # the converter permutes Q/K so that rotation is on adjacent pairs
    make_layer = staticmethod(make_layer)
    layer_function = staticmethod(llama_layer)

    def rope_tables(self, positions):
        return self.rope_table(positions, self.hp.rope_base)

    def layer_args(self, il, tables):
        hp = self.hp
        return (tables, np.float32(hp.rms_eps), hp.n_head, hp.n_head_kv, hp.head_dim, hp.rope_dims,
                np.float32(1.0 / math.sqrt(hp.head_dim)))
