"""Llama (Llama 2/3.x, Mistral, TinyLlama, SmolLM2): pre-norm, RoPE on pairs, SwiGLU FFN.

Its layer is the decoder layer of the Llama family: qwen2, qwen3, granite and phi3 run the same
compiled layer with their own tensors and arguments (an absent optional vector is empty):
biases on q/k/v/o, per-head RMS norms of q and k, a scale on each residual branch, q scaled
before attention or the scores after it."""
from __future__ import annotations

import numba as nb
import numpy as np

from ..kernels.cpu import layers as cpu_layers
from ..errors import ModelError
from .base import Transformer, inv_sqrt


# The layer is written in the operations of a backend module, `ops`: compiled whole for the
# CPU (kernels/cpu/layers.py); base.with_ops runs the same code over kernels/cuda/layers.py.
ops = cpu_layers


def decoder_layer_ops(x, w, positions, kv, out_from, rope_table, eps, n_head, n_head_kv, head_dim, rope_dims,
                      neox, q_scale, kq_scale, residual_scale):
    """x (T, E) -> (T - out_from, E): rows from out_from on (llama.cpp computes the last layer's
    feed-forward for the output rows only); w: the layer's tensors in Llama.layer_order."""
    attn_norm, wq, wk, wv, wo, ffn_norm, wg, wu, wd, bq, bk, bv, bo, q_norm, k_norm = w
    h = ops.norm(x, attn_norm, eps)
    q, k, v = ops.linear3(wq, wk, wv, h)
    q, k, v = ops.add_bias(q, bq), ops.add_bias(k, bk), ops.add_bias(v, bv)
    if q_norm.size:
        q = ops.head_norm(q, q_norm, eps, n_head, head_dim)
        k = ops.head_norm(k, k_norm, eps, n_head_kv, head_dim)
    attn = ops.rope_attend(q, k, v, positions, rope_table, kv, q_scale, 0, kq_scale, np.float32(0.0), n_head,
                           n_head_kv, head_dim, rope_dims, neox)
    attn_out = ops.scaled(ops.add_bias(ops.linear(wo, attn), bo), residual_scale)
    x = ops.add(x[out_from:], attn_out[out_from:])
    h = ops.norm(x, ffn_norm, eps)
    gate, up = ops.linear2(wg, wu, h)
    return ops.add(x, ops.scaled(ops.linear(wd, ops.swiglu(gate, up)), residual_scale))


decoder_layer = nb.njit(cache=True, nogil=True)(decoder_layer_ops)


class Llama(Transformer):
    name = "llama"
    rope_neox = False  # the converter permutes Q/K so that rotation is on adjacent pairs
    layer_function = staticmethod(decoder_layer)
    layer_order = Transformer.layer_order + ("attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias",
                                             "attn_q_norm", "attn_k_norm")
    # a sliding window is read by llama.cpp for other architectures only: it attends to everything
    handled_keys = frozenset({"attention.scale", "attention.sliding_window"})
    # the layer's scales: q before attention, the scores, each residual branch (set by read_hparams)
    q_scale = attn_scale = residual_scale = 1.0

    def read_hparams(self):
        hp = super().read_hparams()
        if hp.rope_dims != hp.head_dim:
            raise ModelError(f"rope.dimension_count {hp.rope_dims} differs from the head size {hp.head_dim}")
        # llama.cpp: attention.scale replaces 1/sqrt(head_dim) where set (0: not set)
        self.attn_scale = self.meta.float("attention.scale", 0.0, 1e6, default=0.0) or inv_sqrt(hp.head_dim)
        return hp

    def rope_factor_names(self, kind):
        if kind == "longrope":
            return ("rope_factors_long.weight", "rope_factors_short.weight")
        return ("rope_freqs.weight",)  # Llama 3.1/3.2's llama3 frequency factors

    def optional_layer_tensors(self, il):
        hp = self.hp
        q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        return {"attn_q.bias": (q_dim,), "attn_k.bias": (kv_dim,), "attn_v.bias": (kv_dim,),
                "attn_output.bias": (hp.n_embd,)}

    def layer_args(self, il, tables):
        """rope table, eps, heads, dims, neox, q_scale, kq_scale, residual_scale."""
        hp = self.hp
        return (tables, np.float32(hp.rms_eps), hp.n_head, hp.n_head_kv, hp.head_dim, hp.rope_dims, self.rope_neox,
                np.float32(self.q_scale), np.float32(self.attn_scale), np.float32(self.residual_scale))
