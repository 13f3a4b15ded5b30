"""Gemma 2: the Gemma layer (gemma3.py) without QK-norms, with the attention scores and the
final logits soft-capped, and every other layer local (sliding window, 4096 by default)."""
from __future__ import annotations

from .gemma3 import Gemma3


class Gemma2(Gemma3):
    name = "gemma2"
    handled_keys = Gemma3.handled_keys | {"attn_logit_softcapping"}
    swa_pattern = 2
    default_window = 4096
    default_final_softcap = 30.0  # llama.cpp's defaults when the file has no key

    def read_hparams(self):
        hp = super().read_hparams()
        self.attn_softcap = self.meta.float("attn_logit_softcapping", 0.0, 1e6, default=50.0)
        return hp

    def default_local_rope_base(self, hp) -> float:
        return hp.rope_base

    @staticmethod
    def is_27b(hp) -> bool:
        return hp.n_layer == 46

    def local_freq_scale(self) -> float:
        return self.rope.freq_scale

    def layer_tensors(self, il):
        shapes = super().layer_tensors(il)
        del shapes["attn_q_norm"], shapes["attn_k_norm"]
        return shapes

    def attention_softcap(self) -> float:
        return self.attn_softcap
