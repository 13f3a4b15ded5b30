"""Gemma 3: QK-norm, pre- and post-norms, scaled embeddings, GELU-gated FFN, and local
sliding-window layers (every layer but each sixth) with their own RoPE base."""
from __future__ import annotations

import math

import numpy as np

from ..kernels.cpu import ops
from ..weights import Activations, matmul
from .base import HParams, Transformer

SWA_PATTERN = 6            # layers il with il % 6 == 5 are global, the others local
LOCAL_ROPE_BASE = 10000.0  # llama.cpp's rope_freq_base_train_swa for Gemma 3


class Gemma3(Transformer):
    name = "gemma3"
    rope_neox = True

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

    def layer_forward(self, il, w, x, positions, cache):
        hp = self.hp
        T, D = x.shape[0], hp.head_dim
        act = Activations(self.norm(x, w["attn_norm"]))
        q, k, v = matmul(w["attn_q"], act), matmul(w["attn_k"], act), matmul(w["attn_v"], act)
        q = self.norm(q.reshape(T * hp.n_head, D), w["attn_q_norm"]).reshape(T, -1)
        k = self.norm(k.reshape(T * hp.n_head_kv, D), w["attn_k_norm"]).reshape(T, -1)
        local = self.is_local(il)
        base = LOCAL_ROPE_BASE if local else hp.rope_base
        scale = 1.0 if local else self.rope_scale
        self.rope(q, hp.n_head, positions, base, scale)
        self.rope(k, hp.n_head_kv, positions, base, scale)
        q *= np.float32(self.attn_scale)
        attn = self.attend(il, q, k, v, positions, cache, 1.0, self.window if local else 0)
        x = x + self.norm(matmul(w["attn_output"], Activations(attn)), w["post_attention_norm"])

        act = Activations(self.norm(x, w["ffn_norm"]))
        gate, up = matmul(w["ffn_gate"], act), matmul(w["ffn_up"], act)
        h = np.empty_like(gate)
        ops.geglu(gate, up, h)
        return x + self.norm(matmul(w["ffn_down"], Activations(h)), w["post_ffw_norm"])

    def finish_logits(self, logits):
        if self.softcap > 0:
            c = np.float32(self.softcap)
            logits = np.tanh(logits / c) * c
        return logits
