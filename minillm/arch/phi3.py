"""Phi-3 (Phi-3, Phi-3.5-mini, Phi-4-mini): the Llama layer with fused tensors (q/k/v in one
matrix, gate and up in one), NEOX RoPE on part of each head, q scaled before attention, and
LongRoPE frequency factors (short or long by the context) with their attention factor.

llama.cpp b11434 ignores Phi-3's sliding window (it attends to the whole context): so do we."""
from __future__ import annotations

from .base import inv_sqrt
from .llama import Llama


class Phi3(Llama):
    name = "phi3"
    rope_neox = True
    handled_keys = frozenset({"attention.sliding_window"})

    def read_hparams(self):
        hp = super(Llama, self).read_hparams()  # partial rotary dims are Phi-3's own
        # as llama.cpp's phi3: q scaled by 1/sqrt(head_dim) after RoPE, the scores by 1
        self.q_scale, self.attn_scale = inv_sqrt(hp.head_dim), 1.0
        return hp

    def rope_factor_names(self, kind):
        return ("rope_factors_long.weight", "rope_factors_short.weight")

    def _fused(self, il: int, part: str) -> str | None:
        name = f"blk.{il}.{part}.weight"
        return name if name in self.gguf.tensors else None

    def layer_tensors(self, il):
        hp = self.hp
        shapes = super().layer_tensors(il)
        if self._fused(il, "attn_qkv"):
            for part in ("attn_q", "attn_k", "attn_v"):
                del shapes[part]
            shapes["attn_qkv"] = (hp.n_embd, (hp.n_head + 2 * hp.n_head_kv) * hp.head_dim)
        del shapes["ffn_gate"]
        shapes["ffn_up"] = (hp.n_embd, 2 * hp.n_ff)  # gate rows, then up rows
        return shapes

    def optional_layer_tensors(self, il):
        return {}

    def layer_sources(self, il):
        """q, k, v as row ranges of the fused attn_qkv (when the file fuses them), gate and up
        as the two halves of ffn_up: each part's products are the fused matrix's rows."""
        hp = self.hp
        sources = super().layer_sources(il)
        order = self.layer_order
        qkv = self._fused(il, "attn_qkv")
        if qkv:
            q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
            bounds = {"attn_q": (0, q_dim), "attn_k": (q_dim, q_dim + kv_dim),
                      "attn_v": (q_dim + kv_dim, q_dim + 2 * kv_dim)}
            for part, rows in bounds.items():
                sources[order.index(part)] = (qkv, rows)
        up = f"blk.{il}.ffn_up.weight"
        sources[order.index("ffn_gate")] = (up, (0, hp.n_ff))
        sources[order.index("ffn_up")] = (up, (hp.n_ff, 2 * hp.n_ff))
        return sources
