"""Llama (Llama 2/3, Mistral, TinyLlama, SmolLM2): pre-norm, RoPE on pairs, SwiGLU FFN."""
from __future__ import annotations

import math

import numba as nb
import numpy as np

from ..kernels.cpu import layers as cpu_layers
from .base import Transformer


# The layer is written in the operations of a backend module, `ops`: compiled whole for the
# CPU (kernels/cpu/layers.py); base.with_ops runs the same code over kernels/cuda/layers.py.
ops = cpu_layers


def llama_layer_ops(x, w, positions, kv, out_from, rope_table, eps, n_head, n_head_kv, head_dim, rope_dims,
                    attn_scale):
    """x (T, E) -> (T - out_from, E): rows from out_from on (llama.cpp computes the last layer's
    feed-forward for the output rows only); w: the layer's tensors in Llama.layer_order."""
    attn_norm, wq, wk, wv, wo, ffn_norm, wg, wu, wd = w
    h = ops.norm(x, attn_norm, eps)
    q, k, v = ops.linear3(wq, wk, wv, h)
    attn = ops.rope_attend(q, k, v, positions, rope_table, kv, np.float32(1.0), 0, attn_scale, n_head,
                           n_head_kv, head_dim, rope_dims, False)
    x = ops.add(x[out_from:], ops.linear(wo, attn)[out_from:])
    h = ops.norm(x, ffn_norm, eps)
    gate, up = ops.linear2(wg, wu, h)
    return ops.add(x, ops.linear(wd, ops.swiglu(gate, up)))


llama_layer = nb.njit(cache=True, nogil=True)(llama_layer_ops)


class Llama(Transformer):
    name = "llama"
    rope_neox = False  # the converter permutes Q/K so that rotation is on adjacent pairs
    layer_function = staticmethod(llama_layer)

    def rope_tables(self, positions):
        return self.rope_table(positions, self.hp.rope_base)

    def layer_args(self, il, tables):
        hp = self.hp
        return (tables, np.float32(hp.rms_eps), hp.n_head, hp.n_head_kv, hp.head_dim, hp.rope_dims,
                np.float32(1.0 / math.sqrt(hp.head_dim)))
