"""Gemma 3: QK-norm, pre- and post-norms, scaled embeddings, GELU-gated FFN, and local
sliding-window layers (every layer but each sixth) with their own RoPE base.

Its layer is the Gemma family's: Gemma 2 (gemma2.py) runs it without the QK-norms and with
its attention scores soft-capped."""
from __future__ import annotations

import math

import numpy as np

import numba as nb

from ..errors import ModelError
from ..kernels.cpu import layers as cpu_layers
from .base import HParams, Transformer, inv_sqrt

ops = cpu_layers  # the backend operations the layer is written in (see llama.py)


def gemma_layer_ops(x, w, positions, kv, out_from, rope_table, window, eps, n_head, n_head_kv, head_dim,
                    rope_dims, q_scale, softcap):
    """x (T, E) -> (T - out_from, E) (see llama.decoder_layer_ops); w: the layer's tensors in
    Gemma3.layer_order (empty QK-norms: none); window 0 = global; softcap 0 = scores not capped."""
    attn_norm, wq, wk, wv, wo, ffn_norm, wg, wu, wd, q_norm, k_norm, post_attn_norm, post_ffw_norm = w
    h = ops.norm(x, attn_norm, eps)
    q, k, v = ops.linear3(wq, wk, wv, h)
    if q_norm.size:
        q = ops.head_norm(q, q_norm, eps, n_head, head_dim)
        k = ops.head_norm(k, k_norm, eps, n_head_kv, head_dim)
    # llama.cpp scales Q after RoPE, before attention (kq_scale 1)
    attn = ops.rope_attend(q, k, v, positions, rope_table, kv, q_scale, window, np.float32(1.0), softcap, n_head,
                           n_head_kv, head_dim, rope_dims, True)
    x = ops.add(x[out_from:], ops.norm(ops.linear(wo, attn), post_attn_norm, eps)[out_from:])
    h = ops.norm(x, ffn_norm, eps)
    gate, up = ops.linear2(wg, wu, h)
    return ops.add(x, ops.norm(ops.linear(wd, ops.geglu(gate, up)), post_ffw_norm, eps))


gemma_layer = nb.njit(cache=True, nogil=True)(gemma_layer_ops)


class Gemma3(Transformer):
    name = "gemma3"
    rope_neox = True
    layer_function = staticmethod(gemma_layer)
    layer_order = Transformer.layer_order + ("attn_q_norm", "attn_k_norm", "post_attention_norm",
                                             "post_ffw_norm")
    handled_keys = frozenset({"attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
                              "final_logit_softcapping"})
    swa_pattern = 6               # layers il with il % 6 < 5 are local (llama.cpp's default for Gemma 3)
    default_window = 0            # no attention.sliding_window key: every layer global
    default_final_softcap = 0.0

    def read_hparams(self) -> HParams:
        hp = super().read_hparams()
        m = self.meta
        self.window = m.int("attention.sliding_window", 0, 1 << 24, default=self.default_window)
        self.local = self.read_local_layers(hp.n_layer)
        self.local_rope_base = m.float("rope.freq_base_swa", 1e-3, 1e12, default=self.default_local_rope_base(hp))
        # llama.cpp: 1/sqrt(n_embd/n_head) for the 27B models, else 1/sqrt(head_dim)
        self.attn_scale = inv_sqrt(hp.n_embd // hp.n_head if self.is_27b(hp) else hp.head_dim)
        self.softcap = m.float("final_logit_softcapping", 0.0, 1e6, default=self.default_final_softcap)
        return hp

    def default_local_rope_base(self, hp) -> float:
        return 10000.0  # llama.cpp's rope_freq_base_train_swa default

    @staticmethod
    def is_27b(hp) -> bool:
        return hp.n_layer == 62

    def read_local_layers(self, n_layer: int) -> list[bool]:
        """Which layers use the sliding window: attention.sliding_window_pattern, a period (the
        last layer of each period global) or a flag per layer, else the module's period."""
        if self.window == 0:
            return [False] * n_layer
        key = f"{self.name}.attention.sliding_window_pattern"
        pattern = self.gguf.metadata.get(key, self.swa_pattern)
        if isinstance(pattern, np.ndarray):
            if pattern.shape != (n_layer,) or pattern.dtype != np.bool_:
                raise ModelError(f"metadata '{key}' must be {n_layer} true/false flags")
            return [bool(f) for f in pattern]
        period = self.meta.int("attention.sliding_window_pattern", 0, 1 << 16, default=self.swa_pattern)
        return [period == 0 or il % period < period - 1 for il in range(n_layer)]

    def features(self):
        out = super().features()
        if any(self.local):
            out.append(f"sliding window of {self.window} on {sum(self.local)} of {len(self.local)} layers")
        if self.attention_softcap():
            out.append(f"attention soft-capping at {self.attention_softcap():g}")
        if self.softcap:
            out.append(f"final logit soft-capping at {self.softcap:g}")
        return out

    def is_local(self, il: int) -> bool:
        return self.local[il]

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

    def local_freq_scale(self) -> float:
        return 1.0  # llama.cpp's rope_freq_scale_train_swa for Gemma 3

    def rope_tables(self, positions, n_ctx):
        return {"local": self.rope_table(positions, self.local_rope_base, n_ctx, self.local_freq_scale()),
                "global": self.rope_table(positions, self.hp.rope_base, n_ctx)}

    def attention_softcap(self) -> float:
        return 0.0

    def layer_args(self, il, tables):
        hp = self.hp
        local = self.is_local(il)
        return (tables["local" if local else "global"], self.window if local else 0, np.float32(hp.rms_eps),
                hp.n_head, hp.n_head_kv, hp.head_dim, hp.rope_dims, np.float32(self.attn_scale),
                np.float32(self.attention_softcap()))

    def finish_logits(self, logits):
        """Final logit soft-capping where the model has it, as ggml: scale by 1/cap, tanh, scale by cap."""
        if self.softcap > 0:
            cap = np.float32(self.softcap)
            logits = ops.tanh_capped(logits, np.float32(np.float32(1.0) / cap), cap)
        return logits
