"""Qwen3 MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (RMS norms of the q and k heads, NEOX
RoPE), then a mixture of experts in place of the FFN: a softmax router picks each token's
expert_used_count experts of expert_count, their weights renormalized to sum 1; each chosen
expert is a SwiGLU FFN of expert_feed_forward_length (kernels/cpu/layers.py moe_ffn)."""
from __future__ import annotations

import numba as nb
import numpy as np

from ..kernels.cpu import layers as cpu_layers
from .base import Experts, Transformer, inv_sqrt

ops = cpu_layers  # the backend operations the layer is written in (see llama.py)

EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def moe_layer_ops(x, w, positions, kv, out_from, rope_table, eps, n_head, n_head_kv, head_dim, rope_dims, kq_scale,
                  n_used, norm_w, w_scale):
    """x (T, E) -> (T - out_from, E); w: the layer's tensors in Qwen3Moe.layer_order (the
    experts' matrices stacked)."""
    attn_norm, wq, wk, wv, wo, q_norm, k_norm, ffn_norm, router, gate_exps, up_exps, down_exps = w
    q, k, v = ops.linear3(wq, wk, wv, ops.norm(x, attn_norm, eps))
    q = ops.head_norm(q, q_norm, eps, n_head, head_dim)
    k = ops.head_norm(k, k_norm, eps, n_head_kv, head_dim)
    attn = ops.rope_attend(q, k, v, positions, rope_table, kv, np.float32(1.0), 0, kq_scale, np.float32(0.0), n_head,
                           n_head_kv, head_dim, rope_dims, True)
    x = ops.add(x[out_from:], ops.linear(wo, attn)[out_from:])
    return ops.add(x, ops.moe_ffn(ops.norm(x, ffn_norm, eps), router, gate_exps, up_exps, down_exps, n_used, norm_w,
                                  w_scale))


moe_layer = nb.njit(cache=True, nogil=True)(moe_layer_ops)


class Qwen3Moe(Transformer):
    name = "qwen3moe"
    rope_neox = True
    layer_function = staticmethod(moe_layer)
    layer_order = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
                   "ffn_gate_inp") + EXPERT_TENSORS
    handled_keys = frozenset({"expert_count", "expert_used_count", "expert_feed_forward_length"})
    # the experts' products run inside the compiled FFN, where an importance matrix does not see them
    unsupported = {"imatrix": "an importance matrix"}

    def read_hparams(self):
        hp = super().read_hparams()
        m = self.meta
        self.n_expert = m.int("expert_count", 2, 512)
        self.n_expert_used = m.int("expert_used_count", 1, self.n_expert)
        self.n_ff_expert = m.int("expert_feed_forward_length", 1, 1 << 20, default=hp.n_ff // self.n_expert_used)
        return hp

    def layer_tensors(self, il):
        hp = self.hp
        E, F, X = hp.n_embd, self.n_ff_expert, self.n_expert
        q_dim, kv_dim, D = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim, hp.head_dim
        return {"attn_norm": (E,), "attn_q": (E, q_dim), "attn_k": (E, kv_dim), "attn_v": (E, kv_dim),
                "attn_output": (q_dim, E), "attn_q_norm": (D,), "attn_k_norm": (D,), "ffn_norm": (E,),
                "ffn_gate_inp": (E, X), "ffn_gate_exps": (E, F, X), "ffn_up_exps": (E, F, X),
                "ffn_down_exps": (F, E, X)}

    def layer_sources(self, il):
        return [Experts(f"blk.{il}.{name}.weight", self.n_expert) if name in EXPERT_TENSORS
                else (f"blk.{il}.{name}.weight", None) for name in self.layer_order]

    def cpu_only(self):
        return "a mixture of experts"

    def features(self):
        return super().features() + [f"mixture of experts: {self.n_expert_used} of {self.n_expert} experts of "
                                     f"{self.n_ff_expert} (softmax router, weights renormalized)"]

    def layer_args(self, il, tables):
        hp = self.hp
        return (tables, np.float32(hp.rms_eps), hp.n_head, hp.n_head_kv, hp.head_dim, hp.rope_dims,
                np.float32(inv_sqrt(hp.head_dim)), self.n_expert_used, True, np.float32(0.0))
