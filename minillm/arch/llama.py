"""Llama (Llama 2/3, Mistral, TinyLlama, SmolLM2): pre-norm, RoPE on pairs, SwiGLU FFN."""
from __future__ import annotations

import math

import numba as nb
import numpy as np

from ..kernels.cpu import layers, ops
from .base import Transformer


@nb.njit(cache=True, nogil=True)
def llama_layer(x, w, positions, cos, sin, kv, eps, n_head, n_head_kv, head_dim, rope_dims, attn_scale):
    """x (T, E) -> (T, E); w: the layer's tensors in Llama.layer_order."""
    attn_norm, wq, wk, wv, wo, ffn_norm, wg, wu, wd = w
    kc, vc, kv_pos, slots, n_used, n_keep, ring_start = kv
    h = layers.norm(x, attn_norm, eps)
    q, k, v = layers.linear3(wq, wk, wv, h)
    ops.rope(q, n_head, head_dim, rope_dims, cos, sin, False)
    ops.rope(k, n_head_kv, head_dim, rope_dims, cos, sin, False)
    attn = layers.attend(q, k, v, positions, kc, vc, kv_pos, slots, n_used, n_keep, ring_start, 0,
                         attn_scale, n_head, n_head_kv, head_dim)
    x = x + layers.linear(wo, attn)
    h = layers.norm(x, ffn_norm, eps)
    gate, up = layers.linear2(wg, wu, h)
    act = np.empty_like(gate)
    ops.swiglu(gate, up, act)
    return x + layers.linear(wd, act)


class Llama(Transformer):
    name = "llama"
    rope_neox = False  # the converter permutes Q/K so that rotation is on adjacent pairs
    layer_function = llama_layer

    def rope_tables(self, positions):
        return self.rope_table(positions, self.hp.rope_base)

    def layer_step(self, il, layer, x, positions, tables, kv):
        hp = self.hp
        cos, sin = tables
        return llama_layer(x, layer, positions, cos, sin, kv, np.float32(hp.rms_eps), hp.n_head, hp.n_head_kv,
                           hp.head_dim, hp.rope_dims, np.float32(1.0 / math.sqrt(hp.head_dim)))
