"""Qwen3.5 (dense): a hybrid of gated delta-net layers (linear attention: a state matrix per
head carried from token to token) and, every fourth layer, gated full attention.

Both kinds of layer run one compiled function: its tensors come in the same slots (the mixer's
five matrices and three vectors mean one thing in a recurrent layer, another in an attention
layer) and its memory is (KV view, conv states, state matrices, each row's sequence), empty
where the layer has none.

    recurrent:  qkv, z = attn_qkv x, attn_gate x      conv + SiLU over qkv (channels q|k|v)
                q, k L2-normed per head               beta = sigmoid(ssm_beta x)
                g = softplus(ssm_alpha x + ssm_dt) * ssm_a
                o = gated delta net(q, k, v, g, beta) RMS-normed per head * ssm_norm * SiLU(z)
                out = ssm_out o
    attention:  q|gate = attn_q x (per head: D values of q, then D of its gate), k, v
                RMS norms of q and k heads, RoPE (IMROPE: for text, NEOX on rope_dims), attention
                out = attn_output (attention * sigmoid(gate))
    then        x += FFN(post_attention_norm(x)) (SwiGLU)
"""
from __future__ import annotations

import numba as nb
import numpy as np

from ..errors import ModelError
from ..kernels.cpu import layers as cpu_layers
from .base import HParams, NO_MATRIX, Transformer, inv_sqrt

ops = cpu_layers  # the backend operations the layer is written in (see llama.py)


def hybrid_layer_ops(x, w, positions, kv, out_from, rope_table, eps, n_head, n_head_kv, head_dim, rope_dims,
                     kq_scale, recurrent, n_k_heads, state_size):
    """x (T, E) -> (T - out_from, E); w: the layer's tensors in Qwen35.layer_order; kv: (KV view,
    the sequences' conv states (n_seq, Kc-1, C) and state matrices (n_seq, Hv, S, S), each row's
    sequence (T,)). llama.cpp picks the output rows after the last layer, so every row goes
    through it."""
    attn_norm, post_norm, wg, wu, wd, m0, m1, m2, m3, m4, v0, v1, v2, conv_w = w
    kv_view, conv_states, ssm_states, row_seq = kv
    h = ops.norm(x, attn_norm, eps)
    if recurrent:  # m0..m4: attn_qkv, attn_gate, ssm_beta, ssm_alpha, ssm_out; v0..v2: ssm_dt, ssm_a, ssm_norm
        qkv, z = ops.linear2(m0, m1, h)
        beta, g = ops.linear2(m2, m3, h)
        ops.decay_and_beta(g, beta, v0, v1)
        mixed = ops.causal_conv(qkv, conv_states, conv_w, row_seq, True)
        key_dim = n_k_heads * state_size
        ops.l2_heads(mixed, 0, n_k_heads, state_size, eps)
        ops.l2_heads(mixed, key_dim, n_k_heads, state_size, eps)
        core = ops.gated_delta_net(mixed, 0, key_dim, 2 * key_dim, g, beta, ssm_states, row_seq, n_k_heads,
                                   state_size)
        out = ops.linear(m4, ops.gated_norm(core, v2, z, eps, ssm_states.shape[1], state_size))
    else:  # m0..m3: attn_q (with its gate), attn_k, attn_v, attn_output; v0, v1: attn_q_norm, attn_k_norm
        q_gate, k, v = ops.linear3(m0, m1, m2, h)
        q = ops.head_norm(ops.first_halves(q_gate, n_head, head_dim), v0, eps, n_head, head_dim)
        k = ops.head_norm(k, v1, eps, n_head_kv, head_dim)
        attn = ops.rope_attend(q, k, v, positions, rope_table, kv_view, np.float32(1.0), 0, kq_scale,
                               np.float32(0.0), n_head, n_head_kv, head_dim, rope_dims, True)
        out = ops.linear(m3, ops.sigmoid_gated(attn, q_gate, n_head, head_dim))
    x = ops.add(x, out)
    gate, up = ops.linear2(wg, wu, ops.norm(x, post_norm, eps))
    return ops.add(x, ops.linear(wd, ops.swiglu(gate, up)))[out_from:]


hybrid_layer = nb.njit(cache=True, nogil=True)(hybrid_layer_ops)

# each layer kind's tensors in the mixer's slots (m0..m4, v0..v2): None = the slot is unused
_RECURRENT_SLOTS = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out", "ssm_dt.bias", "ssm_a", "ssm_norm")
_ATTENTION_SLOTS = ("attn_q", "attn_k", "attn_v", "attn_output", None, "attn_q_norm", "attn_k_norm", None)
N_MATRICES = 5
MAX_SSM_HEADS = 1024


class Qwen35(Transformer):
    name = "qwen35"
    rope_neox = True
    layer_function = staticmethod(hybrid_layer)
    array_tensors = ("ssm_conv1d.weight",)  # its values as they are (C*Kc,), not packed for products
    layer_order = ("attn_norm", "post_attention_norm", "ffn_gate", "ffn_up", "ffn_down",
                   "m0", "m1", "m2", "m3", "m4", "v0", "v1", "v2", "ssm_conv1d")
    handled_keys = frozenset({
        "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size", "ssm.time_step_rank", "ssm.group_count",
        "full_attention_interval", "attention.recurrent_layers", "rope.dimension_sections",
        "nextn_predict_layers", "attention.scale"})
    # what the recurrent layers' state does not do yet: feature -> what it is (Backend.check_supports)
    unsupported = {"imatrix": "an importance matrix"}

    def read_hparams(self) -> HParams:
        m = self.meta
        n_mtp = m.int("nextn_predict_layers", 0, 16, default=0)
        self.n_layer_all = m.int("block_count", 1, 512)
        if n_mtp >= self.n_layer_all:
            raise ModelError(f"'{self.name}.nextn_predict_layers' = {n_mtp} leaves no layers of the "
                             f"{self.n_layer_all} in '{self.name}.block_count'")
        hp = super().read_hparams()
        hp.n_layer = self.n_layer_all - n_mtp  # the MTP (next-token prediction) blocks are not run
        self.conv_kernel = m.int("ssm.conv_kernel", 2, 64)
        self.state_size = m.int("ssm.state_size", 1, 1024)
        self.n_k_heads = m.int("ssm.group_count", 1, MAX_SSM_HEADS)
        self.n_v_heads = m.int("ssm.time_step_rank", 1, MAX_SSM_HEADS)
        inner = m.int("ssm.inner_size", 1, 1 << 20)
        if self.n_v_heads % self.n_k_heads:
            raise ModelError(f"'{self.name}.ssm.time_step_rank' {self.n_v_heads} (value heads) is not a multiple "
                             f"of '{self.name}.ssm.group_count' {self.n_k_heads} (key heads)")
        if inner != self.n_v_heads * self.state_size:
            raise ModelError(f"'{self.name}.ssm.inner_size' {inner} is not ssm.time_step_rank x ssm.state_size "
                             f"({self.n_v_heads} x {self.state_size})")
        self.recurrent = self.read_recurrent_layers(hp.n_layer)
        self.sections = self.read_sections(hp.rope_dims)
        self.attn_scale = m.float("attention.scale", 0.0, 1e6, default=0.0) or inv_sqrt(hp.head_dim)
        return hp

    def read_recurrent_layers(self, n_layer: int) -> list[bool]:
        """attention.recurrent_layers (a flag per block), else every full_attention_interval-th
        layer is attention (llama.cpp's default 4)."""
        key = f"{self.name}.attention.recurrent_layers"
        flags = self.gguf.metadata.get(key)
        if flags is not None:
            if not isinstance(flags, np.ndarray) or flags.shape != (self.n_layer_all,):
                raise ModelError(f"metadata '{key}' must be {self.n_layer_all} flags, one per block")
            return [bool(f) for f in flags[:n_layer]]
        interval = self.meta.int("full_attention_interval", 1, 1 << 16, default=4)
        return [(il + 1) % interval != 0 for il in range(n_layer)]

    def read_sections(self, rope_dims: int) -> np.ndarray:
        """rope.dimension_sections (4): the IMROPE sections of the rotated pairs."""
        key = f"{self.name}.rope.dimension_sections"
        sections = self.gguf.metadata.get(key)
        if not isinstance(sections, np.ndarray) or sections.shape != (4,) or np.any(sections < 0):
            raise ModelError(f"metadata '{key}' must be 4 section sizes")
        if not 0 < sections.sum() <= rope_dims // 2 or sections[:3].sum() == 0:
            raise ModelError(f"metadata '{key}' = {sections.tolist()} does not fit {rope_dims} rotated dims")
        return sections.astype(np.int64)

    # -- tensors ---------------------------------------------------------------------
    def layer_tensors(self, il):
        hp = self.hp
        E, F = hp.n_embd, hp.n_ff
        shapes = {"attn_norm": (E,), "post_attention_norm": (E,), "ffn_gate": (E, F), "ffn_up": (E, F),
                  "ffn_down": (F, E)}
        if self.recurrent[il]:
            S, Hk, Hv = self.state_size, self.n_k_heads, self.n_v_heads
            channels = 2 * Hk * S + Hv * S
            shapes.update({"attn_qkv": (E, channels), "attn_gate": (E, Hv * S), "ssm_conv1d": (self.conv_kernel, channels),
                           "ssm_beta": (E, Hv), "ssm_alpha": (E, Hv), "ssm_norm": (S,), "ssm_out": (Hv * S, E)})
        else:
            D, q_dim, kv_dim = hp.head_dim, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
            shapes.update({"attn_q": (E, 2 * q_dim), "attn_k": (E, kv_dim), "attn_v": (E, kv_dim),
                           "attn_output": (q_dim, E), "attn_q_norm": (D,), "attn_k_norm": (D,)})
        return shapes

    def optional_layer_tensors(self, il):
        if self.recurrent[il]:  # names without '.weight'
            return {"ssm_dt.bias": (self.n_v_heads,), "ssm_a": (self.n_v_heads,)}
        return {}

    def ignored_tensor(self, name):
        return _block(name) >= self.hp.n_layer  # the MTP blocks' tensors

    def check_tensors(self):
        """Transformer's checks, and the recurrent layers' own: two vectors without '.weight',
        F32 convolution weights."""
        super().check_tensors()
        tensors = self.gguf.tensors
        for il in range(self.hp.n_layer):
            for suffix in self.optional_layer_tensors(il):
                if f"blk.{il}.{suffix}" not in tensors:
                    raise ModelError(f"missing tensor 'blk.{il}.{suffix}' (layer {il} is a recurrent layer)")
            if self.recurrent[il] and tensors[f"blk.{il}.ssm_conv1d.weight"].format.name != "F32":
                raise ModelError(f"tensor 'blk.{il}.ssm_conv1d.weight' must be F32")

    def layer_sources(self, il):
        """Per layer_order entry: the FFN's tensors, then the kind's own in the mixer's slots
        (NO_MATRIX / None: a slot this kind leaves empty), the conv weights last."""
        common = [(f"blk.{il}.{name}.weight", None) for name in self.layer_order[:5]]
        slots = _RECURRENT_SLOTS if self.recurrent[il] else _ATTENTION_SLOTS
        mixer = []
        for at, entry in enumerate(slots):
            if entry is None:
                mixer.append(NO_MATRIX if at < N_MATRICES else None)
            else:
                mixer.append((f"blk.{il}.{entry}" if "." in entry or entry == "ssm_a" else f"blk.{il}.{entry}.weight",
                              None))
        conv = (f"blk.{il}.ssm_conv1d.weight", None) if self.recurrent[il] else None
        return common + mixer + [conv]

    def features(self):
        out = super().features()
        n_rec = sum(self.recurrent)
        out.append(f"gated delta net on {n_rec} of {len(self.recurrent)} layers "
                   f"({self.n_v_heads} heads of {self.state_size}, convolution of {self.conv_kernel})")
        if self.n_layer_all > self.hp.n_layer:
            out.append(f"{self.n_layer_all - self.hp.n_layer} MTP block(s) not run")
        return out

    # -- the forward loop's questions ----------------------------------------------
    def cache_layout(self, n_ctx, n_batch):
        """The attention layers' KV in one context-sized group; the recurrent layers keep none."""
        return {"global": n_ctx}, [None if rec else "global" for rec in self.recurrent]

    def recurrent_shapes(self) -> tuple[list[int], tuple, tuple]:
        """(the recurrent layers, a conv state's shape (Kc-1, C), a state matrices' (Hv, S, S))."""
        S, Hk, Hv = self.state_size, self.n_k_heads, self.n_v_heads
        layers = [il for il, rec in enumerate(self.recurrent) if rec]
        return layers, (self.conv_kernel - 1, 2 * Hk * S + Hv * S), (Hv, S, S)

    def rope_tables(self, positions, n_ctx):
        """NEOX tables of the rotated dims; a text token's IMROPE position is (p, p, p, 0), so the
        pairs of the fourth section turn by position 0 (cos = the attention factor, sin = 0)."""
        cos_t, sin_t = self.rope_table(positions, self.hp.rope_base, n_ctx)
        fourth = [pair for pair in range(cos_t.shape[1]) if _imrope_section(pair, self.sections) == 3]
        if fourth:
            cos_0, sin_0 = self.rope_table(np.zeros(1, np.int64), self.hp.rope_base, n_ctx)
            cos_t[:, fourth], sin_t[:, fourth] = cos_0[0, fourth], sin_0[0, fourth]
        return cos_t, sin_t

    def layer_args(self, il, tables):
        hp = self.hp
        return (tables, np.float32(hp.rms_eps), hp.n_head, hp.n_head_kv, hp.head_dim, hp.rope_dims,
                np.float32(self.attn_scale), self.recurrent[il], self.n_k_heads, self.state_size)


def _block(name: str) -> int:
    """The block number of 'blk.N.…' (-1 for a tensor outside the blocks)."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() else -1


def _imrope_section(pair: int, sections: np.ndarray) -> int:
    """Which of the four positions ggml's interleaved M-RoPE turns rotated pair `pair` by."""
    sector = pair % int(sections.sum())
    for index in (1, 2, 0):
        if sector % 3 == index and sector < 3 * sections[index]:
            return index
    return 3
