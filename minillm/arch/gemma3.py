"""Gemma 3: QK-norm, pre- and post-norms, scaled embeddings, GELU-gated FFN, and local
sliding-window layers (every layer but each sixth) with their own RoPE base."""
from __future__ import annotations

import math

import numpy as np

import numba as nb

from ..kernels.cpu import layers as cpu_layers
from .base import HParams, Transformer

SWA_PATTERN = 6            # layers il with il % 6 == 5 are global, the others local
LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa for Gemma 3


ops = cpu_layers  # the backend operations the layer is written in (see llama.py)


def gemma3_layer_ops(x, w, positions, kv, out_from, rope_table, window, eps, n_head, n_head_kv, head_dim,
                     rope_dims, q_scale):
    """x (T, E) -> (T - out_from, E) (see llama_layer_ops); w: the layer's tensors in
    Gemma3.layer_order; window 0 = global."""
    attn_norm, wq, wk, wv, wo, ffn_norm, wg, wu, wd, q_norm, k_norm, post_attn_norm, post_ffw_norm = w
    h = ops.norm(x, attn_norm, eps)
    q, k, v = ops.linear3(wq, wk, wv, h)
    q = ops.head_norm(q, q_norm, eps, n_head, head_dim)
    k = ops.head_norm(k, k_norm, eps, n_head_kv, head_dim)
    # llama.cpp scales Q after RoPE, before attention (kq_scale 1)
    attn = ops.rope_attend(q, k, v, positions, rope_table, kv, q_scale, window, np.float32(1.0), n_head,
                           n_head_kv, head_dim, rope_dims, True)
    x = ops.add(x[out_from:], ops.norm(ops.linear(wo, attn), post_attn_norm, eps)[out_from:])
    h = ops.norm(x, ffn_norm, eps)
    gate, up = ops.linear2(wg, wu, h)
    return ops.add(x, ops.norm(ops.linear(wd, ops.geglu(gate, up)), post_ffw_norm, eps))


gemma3_layer = nb.njit(cache=True, nogil=True)(gemma3_layer_ops)


class Gemma3(Transformer):
    name = "gemma3"
    rope_neox = True
    layer_function = staticmethod(gemma3_layer)
    layer_order = Transformer.layer_order + ("attn_q_norm", "attn_k_norm", "post_attention_norm",
                                             "post_ffw_norm")

    def read_hparams(self) -> HParams:
        hp = super().read_hparams()
        hp.rope_base = self.meta.float("rope.freq_base", 1e-3, 1e12, default=1000000.0)
        self.window = self.meta.int("attention.sliding_window", 0, 1 << 24, default=0)
        factor = self.meta.float("rope.scaling.factor", 1e-6, 1e6, default=1.0)
        self.rope_scale = 1.0 / factor
        # llama.cpp: 1/sqrt(n_embd/n_head) for the 27B model (62 layers), else 1/sqrt(head_dim)
        width = hp.n_embd // hp.n_head if hp.n_layer == 62 else hp.head_dim
        self.attn_scale = 1.0 / math.sqrt(width)
        self.softcap = self.meta.float("final_logit_softcapping", 0.0, 1e6, default=0.0)
        return hp

    def is_local(self, il: int) -> bool:
        return self.window > 0 and il % SWA_PATTERN < SWA_PATTERN - 1

    def cache_layout(self, n_ctx, n_batch):
        """Local layers keep only their window (plus room for one batch) in a small ring."""
        layout = ["local" if self.is_local(il) else "global" for il in range(self.hp.n_layer)]
        sizes = {"global": n_ctx}
        if "local" in layout:
            sizes["local"] = min(n_ctx, self.window + n_batch)
        return sizes, layout

    def cache_windows(self):
        return {"local": self.window}

    def layer_tensors(self, il):
        hp = self.hp
        shapes = super().layer_tensors(il)
        shapes.update({
            "attn_q_norm": (hp.head_dim,), "attn_k_norm": (hp.head_dim,),
            "post_attention_norm": (hp.n_embd,), "post_ffw_norm": (hp.n_embd,),
        })
        return shapes

    def embed(self, ids):
        x = super().embed(ids)
        return x * np.float32(math.sqrt(self.hp.n_embd))

    def rope_tables(self, positions):
        return {"local": self.rope_table(positions, LOCAL_ROPE_BASE),
                "global": self.rope_table(positions, self.hp.rope_base, self.rope_scale)}

    def layer_args(self, il, tables):
        hp = self.hp
        local = self.is_local(il)
        return (tables["local" if local else "global"], self.window if local else 0, np.float32(hp.rms_eps),
                hp.n_head, hp.n_head_kv, hp.head_dim, hp.rope_dims, np.float32(self.attn_scale))

    def finish_logits(self, logits):
        if self.softcap > 0:
            c = np.float32(self.softcap)
            logits = np.tanh(logits / c) * c
        return logits
