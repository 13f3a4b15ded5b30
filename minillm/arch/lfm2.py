"""LFM2 (Liquid AI): a hybrid of gated short-convolution layers and, on the layers whose
attention.head_count_kv is not 0, attention with per-head RMS norms of q and k.

Both kinds of layer run one compiled function, their tensors in the same slots (as Qwen3.5's):

    short conv:  b|c|x = shortconv.in_proj h       (T, 3E)
                 out = shortconv.out_proj (c * conv(b * x))   conv: causal, width l_cache, no SiLU
    attention:   q, k, v; RMS norms of q and k heads; NEOX RoPE; attention (a sliding window
                 where the file sets one); out = attn_output
    each         x += out; x += FFN(ffn_norm(x)) (SwiGLU)

The final norm's tensor is called token_embd_norm (llama.cpp's name for LFM2's).
"""
from __future__ import annotations

import numba as nb
import numpy as np

from ..errors import ModelError
from ..kernels.cpu import layers as cpu_layers
from .base import MAX_LAYERS, NO_MATRIX, Transformer, inv_sqrt

ops = cpu_layers  # the backend operations the layer is written in (see llama.py)


def lfm2_layer_ops(x, w, positions, kv, out_from, rope_table, eps, n_head, n_head_kv, head_dim, window, kq_scale,
                   recurrent):
    """x (T, E) -> (T - out_from, E); w: the layer's tensors in Lfm2.layer_order; kv: (KV view,
    the sequences' conv states (n_seq, Kc-1, E), unused state matrices, each row's sequence (T,))."""
    attn_norm, ffn_norm, wg, wu, wd, m0, m1, m2, m3, q_norm, k_norm, conv_w = w
    kv_view, conv_states, _, row_seq = kv
    h = ops.norm(x, attn_norm, eps)
    if recurrent:  # m0, m1: shortconv.in_proj, shortconv.out_proj
        out = ops.linear(m1, ops.short_conv(ops.linear(m0, h), conv_states, conv_w, row_seq))
    else:  # m0..m3: attn_q, attn_k, attn_v, attn_output
        q, k, v = ops.linear3(m0, m1, m2, h)
        q = ops.head_norm(q, q_norm, eps, n_head, head_dim)
        k = ops.head_norm(k, k_norm, eps, n_head_kv, head_dim)
        attn = ops.rope_attend(q, k, v, positions, rope_table, kv_view, np.float32(1.0), window, kq_scale,
                               np.float32(0.0), n_head, n_head_kv, head_dim, head_dim, True)
        out = ops.linear(m3, attn)
    x = ops.add(x[out_from:], out[out_from:])  # llama.cpp picks the output rows before this add
    gate, up = ops.linear2(wg, wu, ops.norm(x, ffn_norm, eps))
    return ops.add(x, ops.linear(wd, ops.swiglu(gate, up)))


lfm2_layer = nb.njit(cache=True, nogil=True)(lfm2_layer_ops)

# each layer kind's tensors in the mixer's slots (m0..m3, q/k norms): None = the slot is unused
_CONV_SLOTS = ("shortconv.in_proj", "shortconv.out_proj", None, None, None, None)
_ATTENTION_SLOTS = ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm")
N_MATRICES = 4


class Lfm2(Transformer):
    name = "lfm2"
    rope_neox = True
    layer_function = staticmethod(lfm2_layer)
    output_norm = "token_embd_norm.weight"
    array_tensors = ("shortconv.conv.weight",)  # its values as they are (E*Kc,), not packed for products
    layer_order = ("attn_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
                   "m0", "m1", "m2", "m3", "v0", "v1", "shortconv.conv")
    handled_keys = frozenset({"shortconv.l_cache", "attention.sliding_window"})
    unsupported = {"imatrix": "an importance matrix"}

    def read_head_count_kv(self, n_head: int) -> int:
        """attention.head_count_kv: a count per layer, 0 on the short-convolution layers (or one
        for all); the attention layers' counts must agree."""
        key = f"{self.name}.attention.head_count_kv"
        n_layer = self.meta.int("block_count", 1, MAX_LAYERS)
        counts = self.gguf.metadata.get(key)
        if isinstance(counts, np.ndarray):
            if counts.shape != (n_layer,) or not np.issubdtype(counts.dtype, np.integer):
                raise ModelError(f"metadata '{key}' must be {n_layer} integers, one per block")
            counts = [int(c) for c in counts]
        elif isinstance(counts, int) and not isinstance(counts, bool):
            counts = [counts] * n_layer
        else:
            raise ModelError(f"missing metadata key '{key}' (or it is not a count per block)")
        if any(not 0 <= c <= n_head for c in counts):
            raise ModelError(f"metadata '{key}' = {counts} is out of range [0, {n_head}]")
        self.recurrent = [c == 0 for c in counts]
        attention = sorted({c for c in counts if c})
        if len(attention) > 1:
            raise ModelError(f"metadata '{key}' = {counts}: attention layers with different key/value head "
                             f"counts are not supported")
        return attention[0] if attention else n_head

    def read_hparams(self):
        hp = super().read_hparams()
        self.conv_kernel = self.meta.int("shortconv.l_cache", 2, 64)
        self.window = self.meta.int("attention.sliding_window", 0, 1 << 24, default=0)
        if hp.rope_dims != hp.head_dim:
            raise ModelError(f"rope.dimension_count {hp.rope_dims} differs from the head size {hp.head_dim}")
        return hp

    # -- tensors ---------------------------------------------------------------------
    def layer_tensors(self, il):
        hp = self.hp
        E, F = hp.n_embd, hp.n_ff
        shapes = {"attn_norm": (E,), "ffn_norm": (E,), "ffn_gate": (E, F), "ffn_up": (E, F), "ffn_down": (F, E)}
        if self.recurrent[il]:
            shapes.update({"shortconv.in_proj": (E, 3 * E), "shortconv.out_proj": (E, E),
                           "shortconv.conv": (self.conv_kernel, E)})
        else:
            D, q_dim, kv_dim = hp.head_dim, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
            shapes.update({"attn_q": (E, q_dim), "attn_k": (E, kv_dim), "attn_v": (E, kv_dim),
                           "attn_output": (q_dim, E), "attn_q_norm": (D,), "attn_k_norm": (D,)})
        return shapes

    def check_tensors(self):
        super().check_tensors()
        for il in range(self.hp.n_layer):
            name = f"blk.{il}.shortconv.conv.weight"
            if self.recurrent[il] and self.gguf.tensors[name].format.name != "F32":
                raise ModelError(f"tensor '{name}' must be F32")

    def layer_sources(self, il):
        """Per layer_order entry: the FFN's tensors, then the kind's own in the mixer's slots
        (NO_MATRIX / None: a slot this kind leaves empty), the conv weights last."""
        common = [(f"blk.{il}.{name}.weight", None) for name in self.layer_order[:5]]
        slots = _CONV_SLOTS if self.recurrent[il] else _ATTENTION_SLOTS
        mixer = [(f"blk.{il}.{entry}.weight", None) if entry else (NO_MATRIX if at < N_MATRICES else None)
                 for at, entry in enumerate(slots)]
        conv = (f"blk.{il}.shortconv.conv.weight", None) if self.recurrent[il] else None
        return common + mixer + [conv]

    def features(self):
        out = super().features()
        out.append(f"short convolution (width {self.conv_kernel}) on {sum(self.recurrent)} of "
                   f"{len(self.recurrent)} layers")
        if self.window:
            out.append(f"sliding window of {self.window} on the attention layers")
        return out

    # -- the forward loop's questions ----------------------------------------------
    def cache_layout(self, n_ctx, n_batch):
        """The attention layers' KV, in a window-sized ring where the file sets a window (the
        global group then holds no layer's, only the context's length); the short-convolution
        layers keep none."""
        sizes, group = {"global": n_ctx}, "global"
        if self.window:
            sizes["local"], group = min(n_ctx, self.window + n_batch), "local"
        return sizes, [None if rec else group for rec in self.recurrent]

    def cache_windows(self):
        return {"local": self.window} if self.window else {}

    def recurrent_shapes(self):
        """(the short-convolution layers, a conv state's shape (Kc-1, E), no state matrices)."""
        layers = [il for il, rec in enumerate(self.recurrent) if rec]
        return layers, (self.conv_kernel - 1, self.hp.n_embd), (0, 0, 0)

    def layer_args(self, il, tables):
        hp = self.hp
        return (tables, np.float32(hp.rms_eps), hp.n_head, hp.n_head_kv, hp.head_dim, self.window,
                np.float32(inv_sqrt(hp.head_dim)), self.recurrent[il])
