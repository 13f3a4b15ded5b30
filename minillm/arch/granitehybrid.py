"""Granite 4.0-H (Micro, 1B, 350M; Tiny and Small with experts) and Bamba: Mamba2 layers beside
attention, with Granite's multipliers
(embeddings scaled, each residual branch scaled, an attention scale, logits divided).

Which layers attend: those whose attention.head_count_kv is not 0 (as LFM2's). Both kinds run
one compiled function, their tensors in the same slots:

    Mamba2:     z | xBC | dt = ssm_in h; xBC = SiLU(conv(xBC) + conv bias);
                y = scan(x, softplus(dt + dt bias), A, B, C) + x * D;
                out = ssm_out (group RMS norm(y * SiLU(z)) * ssm_norm)
    attention:  q, k, v (optional biases); RoPE (normal pairs) only where rope.scaling.finetuned
                is true (Bamba; Granite 4.0-H has none); out = attn_output (+ bias)
    each        x += out * residual scale; x += FFN(ffn_norm(x)) * residual scale (SwiGLU), or with
                experts (Tiny, Small): a softmax-routed mixture plus the shared expert's SwiGLU
"""
from __future__ import annotations

import numba as nb
import numpy as np

from ..errors import ModelError
from ..kernels.cpu import layers as cpu_layers
from .base import NO_EXPERTS, NO_MATRIX, Experts, inv_sqrt
from .lfm2 import Lfm2

ops = cpu_layers  # the backend operations the layer is written in (see llama.py)


def mamba_hybrid_layer_ops(x, w, positions, kv, out_from, rope_table, eps, n_head, n_head_kv, head_dim, rope_dims,
                           kq_scale, residual_scale, recurrent, n_group, state_size, n_used, has_ffn):
    """x (T, E) -> (T - out_from, E); w: the layer's tensors in GraniteHybrid.layer_order; kv:
    (KV view, the sequences' conv states (n_seq, Kc-1, C) and SSM states (n_seq, Hs, P, N), each
    row's sequence (T,)). n_used > 0: a mixture of experts (router, stacked experts) beside the
    FFN slots' shared expert (has_ffn: the file has one)."""
    attn_norm, ffn_norm, wg, wu, wd, m0, m1, m2, m3, v0, v1, v2, v3, a0, a1, a2, a3, router, ge, ue, de = w
    kv_view, conv_states, ssm_states, row_seq = kv
    h = ops.norm(x, attn_norm, eps)
    if recurrent:  # m0, m1: ssm_in, ssm_out; v0, v1: conv and dt biases; a0..a3: conv weights, A, D, norm
        y = ops.mamba2(ops.linear(m0, h), conv_states, a0, v0, v1, a1, a2, a3, ssm_states, row_seq, n_group,
                       state_size, eps)
        out = ops.linear(m1, y)
    else:  # m0..m3: attn_q, attn_k, attn_v, attn_output; v0..v3 their biases
        q, k, v = ops.linear3(m0, m1, m2, h)
        q, k, v = ops.add_bias(q, v0), ops.add_bias(k, v1), ops.add_bias(v, v2)
        attn = ops.rope_attend(q, k, v, positions, rope_table, kv_view, np.float32(1.0), 0, kq_scale,
                               np.float32(0.0), n_head, n_head_kv, head_dim, rope_dims, False)
        out = ops.add_bias(ops.linear(m3, attn), v3)
    x = ops.add(x[out_from:], ops.scaled(out, residual_scale)[out_from:])
    h = ops.norm(x, ffn_norm, eps)
    if n_used == 0:
        gate, up = ops.linear2(wg, wu, h)
        return ops.add(x, ops.scaled(ops.linear(wd, ops.swiglu(gate, up)), residual_scale))
    ffn = ops.moe_ffn(h, router, ge, ue, de, n_used, True, np.float32(0.0))
    if has_ffn:  # the shared expert, added after the experts
        gate, up = ops.linear2(wg, wu, h)
        ffn = ops.add(ffn, ops.linear(wd, ops.swiglu(gate, up)))
    return ops.add(x, ops.scaled(ffn, residual_scale))


mamba_hybrid_layer = nb.njit(cache=True, nogil=True)(mamba_hybrid_layer_ops)

# each layer kind's tensors in the mixer's slots (m0..m3, v0..v3, a0..a3): None = the slot is unused
_MAMBA_SLOTS = ("ssm_in.weight", "ssm_out.weight", None, None, "ssm_conv1d.bias", "ssm_dt.bias", None, None,
                "ssm_conv1d.weight", "ssm_a", "ssm_d", "ssm_norm.weight")
_ATTENTION_SLOTS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "attn_q.bias",
                    "attn_k.bias", "attn_v.bias", "attn_output.bias", None, None, None, None)
N_MATRICES = 4


class GraniteHybrid(Lfm2):
    name = "granitehybrid"
    rope_neox = False
    layer_function = staticmethod(mamba_hybrid_layer)
    output_norm = "output_norm.weight"
    # their values as they are (flattened), not packed for products
    array_tensors = ("ssm_conv1d.weight", "ssm_a", "ssm_d", "ssm_norm.weight")
    layer_order = ("attn_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "m0", "m1", "m2", "m3",
                   "v0", "v1", "v2", "v3", "a0", "a1", "a2", "a3", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                   "ffn_down_exps")
    handled_keys = frozenset({
        "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
        "attention.scale", "embedding_scale", "residual_scale", "logit_scale",
        # experts (Granite 4.0-H Tiny, Small) and the shared expert's width; with no experts
        # (expert_count 0) the shared MLP is the FFN
        "expert_count", "expert_used_count", "expert_shared_feed_forward_length"})

    def read_hparams(self):
        hp = super(Lfm2, self).read_hparams()
        m = self.meta
        self.window = 0
        self.conv_kernel = m.int("ssm.conv_kernel", 2, 64)
        self.state_size = m.int("ssm.state_size", 1, 1024)
        self.n_group = m.int("ssm.group_count", 1, 1024)
        self.n_ssm_heads = m.int("ssm.time_step_rank", 1, 1 << 16)
        self.d_inner = m.int("ssm.inner_size", 1, 1 << 20)
        if self.d_inner != 2 * hp.n_embd:
            raise ModelError(f"'{self.name}.ssm.inner_size' {self.d_inner} is not twice the embedding width "
                             f"{hp.n_embd} (the only expansion llama.cpp runs)")
        if self.d_inner % self.n_ssm_heads or self.n_ssm_heads % self.n_group:
            raise ModelError(f"'{self.name}.ssm.time_step_rank' {self.n_ssm_heads} (SSM heads) must divide "
                             f"ssm.inner_size {self.d_inner} and be a multiple of ssm.group_count {self.n_group}")
        self.use_rope = m.bool("rope.scaling.finetuned", default=True)  # llama.cpp: false = no RoPE
        self.attn_scale = m.float("attention.scale", 0.0, 1e6, default=0.0) or inv_sqrt(hp.head_dim)
        self.logit_scale = m.float("logit_scale", 0.0, 1e6, default=0.0)
        self.residual_scale = m.float("residual_scale", 0.0, 1e6, default=0.0) or 1.0
        self.embedding_scale = m.float("embedding_scale", 0.0, 1e6, default=0.0)
        self.n_expert = m.int("expert_count", 0, 512, default=0)
        self.n_expert_used = m.int("expert_used_count", 1 if self.n_expert else 0, self.n_expert, default=0)
        self.n_ff_shared = m.int("expert_shared_feed_forward_length", 0, 1 << 20, default=0) if self.n_expert else 0
        return hp

    def rope_factor_names(self, kind):
        return ("rope_freqs.weight",)

    # -- tensors ---------------------------------------------------------------------
    def layer_tensors(self, il):
        hp = self.hp
        E, F, X, S = hp.n_embd, hp.n_ff, self.n_expert, self.n_ff_shared
        shapes = {"attn_norm": (E,), "ffn_norm": (E,)}
        if not X:
            shapes.update({"ffn_gate": (E, F), "ffn_up": (E, F), "ffn_down": (F, E)})
        else:  # the experts are feed_forward_length wide
            shapes.update({"ffn_gate_inp": (E, X), "ffn_gate_exps": (E, F, X), "ffn_up_exps": (E, F, X),
                           "ffn_down_exps": (F, E, X)})
            if S:
                shapes.update({"ffn_gate_shexp": (E, S), "ffn_up_shexp": (E, S), "ffn_down_shexp": (S, E)})
        if self.recurrent[il]:
            G, N, Hs, d_inner = self.n_group, self.state_size, self.n_ssm_heads, self.d_inner
            shapes.update({"ssm_in": (E, 2 * d_inner + 2 * G * N + Hs), "ssm_out": (d_inner, E),
                           "ssm_conv1d": (self.conv_kernel, d_inner + 2 * G * N), "ssm_norm": self.norm_shape(il)})
        else:
            q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
            shapes.update({"attn_q": (E, q_dim), "attn_k": (E, kv_dim), "attn_v": (E, kv_dim),
                           "attn_output": (q_dim, E)})
        return shapes

    def norm_shape(self, il: int) -> tuple:
        """ssm_norm's shape: (d_inner / G, G), or with one group as the converter writes it,
        (d_inner,) (llama.cpp takes either)."""
        info = self.gguf.tensors.get(f"blk.{il}.ssm_norm.weight")
        if self.n_group == 1 and info is not None and len(info.shape) == 1:
            return (self.d_inner,)
        return (self.d_inner // self.n_group, self.n_group)

    def optional_layer_tensors(self, il):
        """Names after 'blk.N.': the Mamba2 layers' vectors (checked present in check_tensors:
        llama.cpp needs each), the attention layers' optional biases."""
        hp = self.hp
        if self.recurrent[il]:
            Hs = self.n_ssm_heads
            return {"ssm_conv1d.bias": (self.d_inner + 2 * self.n_group * self.state_size,),
                    "ssm_dt.bias": (Hs,), "ssm_a": (1, Hs), "ssm_d": (1, Hs)}
        q_dim, kv_dim = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        return {"attn_q.bias": (q_dim,), "attn_k.bias": (kv_dim,), "attn_v.bias": (kv_dim,),
                "attn_output.bias": (hp.n_embd,)}

    def check_tensors(self):
        super(Lfm2, self).check_tensors()
        tensors = self.gguf.tensors
        for il in range(self.hp.n_layer):
            if not self.recurrent[il]:
                continue
            for suffix in self.optional_layer_tensors(il):
                if f"blk.{il}.{suffix}" not in tensors:
                    raise ModelError(f"missing tensor 'blk.{il}.{suffix}' (layer {il} is a Mamba2 layer)")
            for suffix in ("ssm_conv1d.weight", "ssm_norm.weight", "ssm_a", "ssm_d"):
                if tensors[f"blk.{il}.{suffix}"].format.name != "F32":
                    raise ModelError(f"tensor 'blk.{il}.{suffix}' must be F32")

    def layer_sources(self, il):
        """Per layer_order entry: the FFN's tensors, then the kind's own in the mixer's slots
        (NO_MATRIX / None: a slot this kind leaves empty, or an optional bias the file lacks)."""
        ffn = ("ffn_gate", "ffn_up", "ffn_down") if not self.n_expert else ("ffn_gate_shexp", "ffn_up_shexp",
                                                                             "ffn_down_shexp")
        common = [(f"blk.{il}.{name}.weight", None) for name in ("attn_norm", "ffn_norm")]
        common += [(f"blk.{il}.{name}.weight", None) if not self.n_expert or self.n_ff_shared else NO_MATRIX
                   for name in ffn]
        slots = _MAMBA_SLOTS if self.recurrent[il] else _ATTENTION_SLOTS
        mixer = []
        for at, entry in enumerate(slots):
            name = entry and f"blk.{il}.{entry}"
            if name in self.gguf.tensors:
                mixer.append((name, None))
            else:
                mixer.append(NO_MATRIX if at < N_MATRICES else None)
        if not self.n_expert:
            return common + mixer + [NO_MATRIX] + [NO_EXPERTS] * 3
        return common + mixer + [(f"blk.{il}.ffn_gate_inp.weight", None)] + [
            Experts(f"blk.{il}.{name}.weight", self.n_expert) for name in ("ffn_gate_exps", "ffn_up_exps",
                                                                           "ffn_down_exps")]

    def features(self):
        out = super(Lfm2, self).features()
        out.append(f"Mamba2 on {sum(self.recurrent)} of {len(self.recurrent)} layers ({self.n_ssm_heads} heads, "
                   f"{self.n_group} group(s) of {self.state_size} states, convolution of {self.conv_kernel})")
        out.append(f"multipliers: embedding {self.embedding_scale or 1:g}, residual {self.residual_scale:g}, "
                   f"attention {self.attn_scale:g}, logits 1/{self.logit_scale or 1:g}")
        if not self.use_rope:
            out.append("no RoPE")
        if self.n_expert:
            out.append(f"mixture of experts: {self.n_expert_used} of {self.n_expert} experts"
                       + (f", a shared expert of {self.n_ff_shared}" if self.n_ff_shared else ""))
        return out

    def cpu_only(self):
        return "recurrent layers beside attention"

    # -- the forward loop's questions ----------------------------------------------
    def recurrent_shapes(self):
        """(the Mamba2 layers, a conv state's shape (Kc-1, C), an SSM state's (Hs, P, N))."""
        layers = [il for il, rec in enumerate(self.recurrent) if rec]
        channels = self.d_inner + 2 * self.n_group * self.state_size
        Hs = self.n_ssm_heads
        return layers, (self.conv_kernel - 1, channels), (Hs, self.d_inner // Hs, self.state_size)

    def embed(self, ids):
        x = super().embed(ids)
        return x * np.float32(self.embedding_scale) if self.embedding_scale else x

    def finish_logits(self, logits):
        return logits * (np.float32(1.0) / np.float32(self.logit_scale)) if self.logit_scale else logits

    def layer_args(self, il, tables):
        hp = self.hp
        return (tables, np.float32(hp.rms_eps), hp.n_head, hp.n_head_kv, hp.head_dim,
                hp.rope_dims if self.use_rope else 0, np.float32(self.attn_scale), np.float32(self.residual_scale),
                self.recurrent[il], self.n_group, self.state_size, self.n_expert_used,
                not self.n_expert or self.n_ff_shared > 0)
