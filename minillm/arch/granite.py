"""Granite 3.x (dense): the Llama layer with Granite's multipliers: the embeddings scaled, each
residual branch scaled, an attention scale of its own, the logits divided by a logit scale."""
from __future__ import annotations

import numpy as np

from ..errors import UnsupportedError
from .llama import Llama


class Granite(Llama):
    name = "granite"
    handled_keys = Llama.handled_keys | {"logit_scale", "residual_scale", "embedding_scale"}

    def read_hparams(self):
        hp = super().read_hparams()
        m = self.meta
        self.logit_scale = m.float("logit_scale", 1e-6, 1e6)
        self.residual_scale = m.float("residual_scale", 0.0, 1e6, default=0.0) or 1.0
        self.embedding_scale = m.float("embedding_scale", 0.0, 1e6, default=0.0) or 1.0
        if not m.bool("rope.scaling.finetuned", default=True):  # llama.cpp: no RoPE at all
            raise UnsupportedError(f"metadata '{self.name}.rope.scaling.finetuned' = false (a Granite without "
                             "RoPE) is not supported")
        return hp

    def features(self):
        return super().features() + [f"multipliers: embedding {self.embedding_scale:g}, residual "
                                     f"{self.residual_scale:g}, attention {self.attn_scale:g}, logits 1/{self.logit_scale:g}"]

    def embed(self, ids):
        return super().embed(ids) * np.float32(self.embedding_scale)

    def finish_logits(self, logits):
        return logits * (np.float32(1.0) / np.float32(self.logit_scale))
