"""SmolLM3: Llama's layer, with no RoPE on every fourth layer (llama.cpp's fixed
n_no_rope_layer_step of 4: layers 3, 7, 11, ... attend without positions)."""
from __future__ import annotations

from .llama import Llama

NO_ROPE_STEP = 4


class SmolLM3(Llama):
    name = "smollm3"
    # llama.cpp b11434's smollm3 reads no sliding-window keys and applies no frequency factors
    handled_keys = frozenset({"attention.scale"})

    def rope_factor_names(self, kind):
        return ()

    def uses_rope(self, il: int) -> bool:
        return (il + 1) % NO_ROPE_STEP != 0

    def features(self):
        return super().features() + [f"no RoPE on every {NO_ROPE_STEP}th layer"]

    def layer_args(self, il, tables):
        """Llama's, with 0 rotated dims on the layers without RoPE."""
        tables, eps, n_head, n_head_kv, head_dim, rope_dims, *rest = super().layer_args(il, tables)
        return (tables, eps, n_head, n_head_kv, head_dim, rope_dims if self.uses_rope(il) else 0, *rest)
