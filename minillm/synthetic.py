"""Tiny synthetic GGUF models of every architecture, written with gguf.GGUFWriter: random
weights of any format, with their float values kept. The tests check each architecture and
format against a NumPy reference on them (tests/synthetic.py); `minillm warm --all` compiles
each architecture's kernels on them; the GPU check measures model-sized ones."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize as ref_dequantize

# byte offsets of the f16 scale fields in one block, per format (ggml-common.h)
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}

# second f16 field relative to the first, to centre the weights: Q4_1/Q5_1 add a (negative)
# min; the K-quants subtract dmin times a 6-bit min whose mean roughly matches sc * mean(q)
CENTRE = {"Q4_1": -7.5, "Q5_1": -15.5, "Q2_K": 1.5, "Q4_K": 7.5, "Q5_K": 15.5}


def random_blocks(fmt: str, rows: int, cols: int, rng, std: float | None = 0.05) -> np.ndarray:
    """Random raw blocks of a quantized format with sane f16 scales: (rows, row_bytes) uint8,
    scaled so that the weights' standard deviation is about `std` (None: unscaled)."""
    qtype = gguf.GGMLQuantizationType[fmt]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    scale = 0.02
    if std is not None:
        probe = random_blocks(fmt, rows, cols, np.random.default_rng(0), None)
        scale *= std / float(ref_dequantize(probe, qtype).std())
    d = rng.random(n_blocks) * scale + scale / 4
    fields = F16_FIELDS[fmt]
    values = [d]
    if len(fields) == 2:  # the min: chosen so that weights are centred around zero
        values.append(d * CENTRE[fmt])
    for off, val in zip(fields, values):
        raw[:, off:off + 2] = val.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(rows, -1)


def float_tensor(fmt: str, rows: int, cols: int, rng, scale: float = 0.1) -> np.ndarray:
    x = (rng.standard_normal((rows, cols)) * scale).astype(np.float32)
    if fmt == "F16":
        return x.astype(np.float16)
    if fmt == "BF16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    return x


# per architecture: the layer tensors beyond Llama's (suffix -> shape rule) and the changes
FUSED_QKV, FUSED_UP = "fused_qkv", "fused_up"
ARCH_EXTRAS = {
    "llama": (),
    "smollm3": (),
    "mistral3": (),
    "qwen3moe": (),  # its own layers (SyntheticModel.add_moe_layer)
    "granite": (),
    "qwen2": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "qwen3": ("attn_q_norm", "attn_k_norm"),
    "phi3": (FUSED_QKV, FUSED_UP),
    "gemma2": ("post_attention_norm", "post_ffw_norm"),
    "gemma3": ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"),
    "qwen35": (),  # its own layers (SyntheticModel.add_qwen35_layer)
    "lfm2": (),    # its own layers (SyntheticModel.add_lfm2_layer)
    "granitehybrid": (),  # its own layers (SyntheticModel.add_mamba2_layer)
}
# Qwen3.5's gated delta net in the small models: Hk key heads and Hv value heads of S values,
# a convolution of Kc, attention every INTERVAL-th layer
QWEN35_SSM = dict(S=64, Hk=2, Hv=4, Kc=4, interval=4)
# a mixture of experts: X experts of F values, K used a token
MOE = dict(X=8, K=2, F=256, S=0)  # S: a shared expert's width (Granite 4.0-H; 0: none)
# Granite 4.0-H's Mamba2: Hs heads (of 2E/Hs values), G groups of N states, a convolution of Kc
MAMBA2_SSM = dict(N=64, G=2, Hs=8, Kc=4)
# LFM2's: a short convolution of LFM2_CONV; LFM2's and Granite 4.0-H's attention on the layers
# il % 3 == 2
LFM2_CONV = 3
HEAD_COUNT_KV_PER_LAYER = ("lfm2", "granitehybrid")


def lfm2_is_attention(il: int) -> bool:
    return il % 3 == 2


# the architectures whose layers SyntheticModel writes with a method of their own
OWN_LAYERS = {"qwen35": "add_qwen35_layer", "lfm2": "add_lfm2_layer", "granitehybrid": "add_mamba2_layer",
              "qwen3moe": "add_moe_layer"}


class SyntheticModel:
    """Writes a tiny model and keeps every tensor's float values for the reference.

    formats: a format per tensor suffix (attn_q, ffn_up, ...), the others in fmt; keys: extra
    metadata ({arch}.KEY -> value); extra_tensors: more F32 vectors by full name; vocab: write a
    small SentencePiece vocabulary (llama.cpp needs one to load the file)."""

    def __init__(self, arch: str, fmt: str, seed: int = 0, n_layer: int = 2, n_embd: int = 256,
                 n_head: int = 4, n_head_kv: int = 2, head_dim: int = 64, n_ff: int = 512,
                 n_vocab: int = 300, window: int = 8, formats: dict | None = None, keys: dict | None = None,
                 rope_dims: int | None = None, extra_tensors: dict | None = None, vocab: bool = False,
                 ssm: dict | None = None, moe: dict | None = None):
        self.arch, self.fmt = arch, fmt
        self.n_layer, self.n_embd, self.n_head, self.n_head_kv = n_layer, n_embd, n_head, n_head_kv
        self.head_dim, self.n_ff, self.n_vocab, self.window = head_dim, n_ff, n_vocab, window
        self.formats, self.keys = formats or {}, keys or {}
        self.rope_dims, self.extra_tensors, self.vocab = rope_dims, extra_tensors or {}, vocab
        self.ssm = dict(MAMBA2_SSM if arch == "granitehybrid" else QWEN35_SSM, **(ssm or {}))
        self.moe = dict(MOE, **(moe or {}))
        self.has_experts = arch == "qwen3moe" or moe is not None
        self.rng = np.random.default_rng(seed)
        self.tensors: dict[str, tuple[np.ndarray, str, tuple]] = {}
        self.values: dict[str, np.ndarray] = {}

    def add(self, name: str, rows: int, cols: int, fmt: str | None = None) -> None:
        fmt = self.formats.get(name.split(".")[-2], fmt or self.fmt)  # blk.0.attn_q.weight -> attn_q
        if fmt in F16_FIELDS:
            raw = random_blocks(fmt, rows, cols, self.rng)
            qtype = gguf.GGMLQuantizationType[fmt]
            values = ref_dequantize(raw, qtype).reshape(rows, cols)
        else:
            raw = float_tensor(fmt, rows, cols, self.rng)
            values = ref_dequantize(raw.view(np.uint8) if fmt == "BF16" else raw,
                                    gguf.GGMLQuantizationType[fmt]).reshape(rows, cols)
        self.tensors[name] = (raw, fmt, (rows, cols))
        self.values[name] = values.astype(np.float32)

    def add_norm(self, name: str, width: int) -> None:
        w = (1.0 + 0.1 * self.rng.standard_normal(width)).astype(np.float32)
        self.tensors[name] = (w, "F32", (width,))
        self.values[name] = w

    def add_bias(self, name: str, width: int) -> None:
        b = (0.5 * self.rng.standard_normal(width)).astype(np.float32)
        self.tensors[name] = (b, "F32", (width,))
        self.values[name] = b

    def build(self) -> "SyntheticModel":
        E, F, D = self.n_embd, self.n_ff, self.head_dim
        q_dim, kv_dim = self.n_head * D, self.n_head_kv * D
        extras = ARCH_EXTRAS[self.arch]
        self.add("token_embd.weight", self.n_vocab, E, "Q8_0" if self.fmt in F16_FIELDS else self.fmt)
        self.add_norm("token_embd_norm.weight" if self.arch == "lfm2" else "output_norm.weight", E)
        for name, values in self.extra_tensors.items():
            self.tensors[name] = (np.asarray(values, np.float32), "F32", (len(values),))
        for il in range(self.n_layer):
            p = f"blk.{il}."
            if self.arch in OWN_LAYERS:
                getattr(self, OWN_LAYERS[self.arch])(il)
                continue
            self.add_norm(p + "attn_norm.weight", E)
            if FUSED_QKV in extras:
                self.add(p + "attn_qkv.weight", q_dim + 2 * kv_dim, E)
            else:
                self.add(p + "attn_q.weight", q_dim, E)
                self.add(p + "attn_k.weight", kv_dim, E)
                self.add(p + "attn_v.weight", kv_dim, E)
            self.add(p + "attn_output.weight", E, q_dim)
            self.add_norm(p + "ffn_norm.weight", E)
            if FUSED_UP in extras:
                self.add(p + "ffn_up.weight", 2 * F, E)
            else:
                self.add(p + "ffn_gate.weight", F, E)
                self.add(p + "ffn_up.weight", F, E)
            self.add(p + "ffn_down.weight", E, F)
            for extra in extras:
                if extra.endswith(".bias"):
                    self.add_bias(p + extra, q_dim if extra.startswith("attn_q") else kv_dim)
                elif extra.endswith("_norm"):
                    self.add_norm(p + extra + ".weight", D if extra.startswith(("attn_q", "attn_k")) else E)
        return self

    def add_attention(self, p: str, q_rows: int, qk_norms: bool) -> None:
        """Layer p's q (q_rows), k, v and output matrices, then its q/k head norms where qk_norms."""
        E, D = self.n_embd, self.head_dim
        self.add(p + "attn_q.weight", q_rows, E)
        self.add(p + "attn_k.weight", self.n_head_kv * D, E)
        self.add(p + "attn_v.weight", self.n_head_kv * D, E)
        self.add(p + "attn_output.weight", E, self.n_head * D)
        if qk_norms:
            self.add_norm(p + "attn_q_norm.weight", D)
            self.add_norm(p + "attn_k_norm.weight", D)

    def add_qwen35_layer(self, il: int) -> None:
        """A gated delta-net layer, or every INTERVAL-th a gated attention layer; SwiGLU FFN."""
        E, F, D = self.n_embd, self.n_ff, self.head_dim
        ssm, p = self.ssm, f"blk.{il}."
        S, Hk, Hv, Kc = ssm["S"], ssm["Hk"], ssm["Hv"], ssm["Kc"]
        self.add_norm(p + "attn_norm.weight", E)
        if (il + 1) % ssm["interval"]:
            channels = 2 * Hk * S + Hv * S
            self.add(p + "attn_qkv.weight", channels, E)
            self.add(p + "attn_gate.weight", Hv * S, E)
            self.add(p + "ssm_beta.weight", Hv, E)
            self.add(p + "ssm_alpha.weight", Hv, E)
            self.add(p + "ssm_out.weight", E, Hv * S)
            conv = (0.3 * self.rng.standard_normal((channels, Kc))).astype(np.float32)
            self.tensors[p + "ssm_conv1d.weight"] = (conv, "F32", (channels, Kc))
            self.values[p + "ssm_conv1d.weight"] = conv
            self.add_bias(p + "ssm_dt.bias", Hv)
            a = -(0.5 + 1.5 * self.rng.random(Hv)).astype(np.float32)
            self.tensors[p + "ssm_a"], self.values[p + "ssm_a"] = (a, "F32", (Hv,)), a
            self.add_norm(p + "ssm_norm.weight", S)
        else:
            self.add_attention(p, 2 * self.n_head * D, qk_norms=True)
        self.add_norm(p + "post_attention_norm.weight", E)
        self.add(p + "ffn_gate.weight", F, E)
        self.add(p + "ffn_up.weight", F, E)
        self.add(p + "ffn_down.weight", E, F)

    def add_lfm2_layer(self, il: int) -> None:
        """A gated short-convolution layer, or attention with q/k norms; SwiGLU FFN."""
        E, F, D, p = self.n_embd, self.n_ff, self.head_dim, f"blk.{il}."
        self.add_norm(p + "attn_norm.weight", E)
        if lfm2_is_attention(il):
            self.add_attention(p, self.n_head * D, qk_norms=True)
        else:
            self.add(p + "shortconv.in_proj.weight", 3 * E, E)
            self.add(p + "shortconv.out_proj.weight", E, E)
            conv = (0.5 * self.rng.standard_normal((E, LFM2_CONV))).astype(np.float32)
            self.tensors[p + "shortconv.conv.weight"] = (conv, "F32", (E, LFM2_CONV))
            self.values[p + "shortconv.conv.weight"] = conv
        self.add_norm(p + "ffn_norm.weight", E)
        self.add(p + "ffn_gate.weight", F, E)
        self.add(p + "ffn_up.weight", F, E)
        self.add(p + "ffn_down.weight", E, F)

    def add_experts(self, name: str, n_experts: int, rows: int, cols: int) -> None:
        """A 3-D tensor of n_experts (rows, cols) matrices (GGUF dims cols, rows, n_experts)."""
        self.add(name, n_experts * rows, cols)
        raw, fmt, _ = self.tensors[name]
        self.tensors[name] = (raw.reshape(n_experts, rows, -1), fmt, (n_experts, rows, cols))
        self.values[name] = self.values[name].reshape(n_experts, rows, cols)

    def add_moe_layer(self, il: int) -> None:
        """Qwen3's attention (q/k norms), then a softmax-routed mixture of SwiGLU experts."""
        E, D, p = self.n_embd, self.head_dim, f"blk.{il}."
        X, F = self.moe["X"], self.moe["F"]
        self.add_norm(p + "attn_norm.weight", E)
        self.add_attention(p, self.n_head * D, qk_norms=True)
        self.add_norm(p + "ffn_norm.weight", E)
        self.add(p + "ffn_gate_inp.weight", X, E, "F32")
        self.add_experts(p + "ffn_gate_exps.weight", X, F, E)
        self.add_experts(p + "ffn_up_exps.weight", X, F, E)
        self.add_experts(p + "ffn_down_exps.weight", X, E, F)

    def add_mamba2_layer(self, il: int) -> None:
        """A Mamba2 layer, or attention (no biases); SwiGLU FFN."""
        E, F, D, p = self.n_embd, self.n_ff, self.head_dim, f"blk.{il}."
        N, G, Hs, Kc = self.ssm["N"], self.ssm["G"], self.ssm["Hs"], self.ssm["Kc"]
        d_inner = 2 * E
        self.add_norm(p + "attn_norm.weight", E)
        if lfm2_is_attention(il):
            self.add_attention(p, self.n_head * D, qk_norms=False)
        else:
            channels = d_inner + 2 * G * N
            self.add(p + "ssm_in.weight", 2 * d_inner + 2 * G * N + Hs, E)
            self.add(p + "ssm_out.weight", E, d_inner)
            for name, shape, values in (
                    ("ssm_conv1d.weight", (channels, Kc), 0.3 * self.rng.standard_normal((channels, Kc))),
                    ("ssm_a", (Hs, 1), -(0.5 + 1.5 * self.rng.random((Hs, 1)))),
                    ("ssm_d", (Hs, 1), 1.0 + 0.1 * self.rng.standard_normal((Hs, 1))),
                    ("ssm_norm.weight", (G, d_inner // G), 1.0 + 0.1 * self.rng.standard_normal((G, d_inner // G)))):
                if G == 1 and name == "ssm_norm.weight":  # one group: a vector, as the converter writes it
                    shape, values = (d_inner,), values.reshape(d_inner)
                values = values.astype(np.float32)
                self.tensors[p + name], self.values[p + name] = (values, "F32", shape), values
            self.add_bias(p + "ssm_conv1d.bias", channels)
            self.add_bias(p + "ssm_dt.bias", Hs)
        self.add_norm(p + "ffn_norm.weight", E)
        if not self.has_experts:
            self.add(p + "ffn_gate.weight", F, E)
            self.add(p + "ffn_up.weight", F, E)
            self.add(p + "ffn_down.weight", E, F)
            return
        X, S = self.moe["X"], self.moe["S"]  # experts n_ff wide, and a shared expert
        self.add(p + "ffn_gate_inp.weight", X, E, "F32")
        self.add_experts(p + "ffn_gate_exps.weight", X, F, E)
        self.add_experts(p + "ffn_up_exps.weight", X, F, E)
        self.add_experts(p + "ffn_down_exps.weight", X, E, F)
        if S:
            self.add(p + "ffn_gate_shexp.weight", S, E)
            self.add(p + "ffn_up_shexp.weight", S, E)
            self.add(p + "ffn_down_shexp.weight", E, S)

    def write(self, path: Path) -> Path:
        w = gguf.GGUFWriter(str(path), self.arch)
        a = self.arch
        w.add_uint32(f"{a}.block_count", self.n_layer)
        w.add_uint32(f"{a}.context_length", 4096)
        w.add_uint32(f"{a}.embedding_length", self.n_embd)
        w.add_uint32(f"{a}.feed_forward_length", self.n_ff)
        w.add_uint32(f"{a}.attention.head_count", self.n_head)
        if a in HEAD_COUNT_KV_PER_LAYER:  # a count per layer: 0 on the recurrent layers (keys: another value, None)
            defaults = {"attention.head_count_kv": [self.n_head_kv if lfm2_is_attention(il) else 0
                                                    for il in range(self.n_layer)]}
            if a == "lfm2":
                defaults["shortconv.l_cache"] = LFM2_CONV
            else:
                ssm = self.ssm
                defaults.update({"ssm.conv_kernel": ssm["Kc"], "ssm.state_size": ssm["N"], "ssm.group_count": ssm["G"],
                                 "ssm.inner_size": 2 * self.n_embd, "ssm.time_step_rank": ssm["Hs"],
                                 "rope.scaling.finetuned": False})
            for key, value in defaults.items():
                if key not in self.keys:
                    add = w.add_array if isinstance(value, list) else w.add_bool if isinstance(value, bool) else w.add_uint32
                    add(f"{a}.{key}", value)
        else:
            w.add_uint32(f"{a}.attention.head_count_kv", self.n_head_kv)
        w.add_uint32(f"{a}.attention.key_length", self.head_dim)
        w.add_uint32(f"{a}.attention.value_length", self.head_dim)
        w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
        w.add_float32(f"{a}.rope.freq_base", 10000.0 if a == "llama" else 1000000.0)
        if self.rope_dims:
            w.add_uint32(f"{a}.rope.dimension_count", self.rope_dims)
        if a in ("gemma3", "gemma2"):
            w.add_uint32(f"{a}.attention.sliding_window", self.window)
        if a == "qwen3moe" or (a == "granitehybrid" and self.has_experts):
            moe = {"expert_count": self.moe["X"], "expert_used_count": self.moe["K"]}
            if a == "qwen3moe":
                moe["expert_feed_forward_length"] = self.moe["F"]
            elif self.moe["S"]:
                moe["expert_shared_feed_forward_length"] = self.moe["S"]
            for key, value in moe.items():
                if key not in self.keys:  # keys: another value, or None for none
                    w.add_uint32(f"{a}.{key}", value)
        if a == "qwen35":
            ssm = self.ssm
            for key, value in (("conv_kernel", ssm["Kc"]), ("state_size", ssm["S"]), ("group_count", ssm["Hk"]),
                               ("time_step_rank", ssm["Hv"]), ("inner_size", ssm["Hv"] * ssm["S"])):
                if f"ssm.{key}" not in self.keys:  # keys: another value, or None for none
                    w.add_uint32(f"{a}.ssm.{key}", value)
            w.add_uint32(f"{a}.full_attention_interval", ssm["interval"])
        for key, value in self.keys.items():
            if value is None:
                continue
            if isinstance(value, bool):
                w.add_bool(f"{a}.{key}", value)
            elif isinstance(value, int):
                w.add_uint32(f"{a}.{key}", value)
            elif isinstance(value, float):
                w.add_float32(f"{a}.{key}", value)
            elif isinstance(value, list):
                w.add_array(f"{a}.{key}", value)
            else:
                w.add_string(f"{a}.{key}", value)
        if self.vocab:
            write_vocab(w, self.n_vocab)
        for name, (raw, fmt, shape) in self.tensors.items():
            if fmt in ("F32", "F16"):
                w.add_tensor(name, raw)
            else:
                w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[fmt])
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path


def write_vocab(w: "gguf.GGUFWriter", n_vocab: int) -> None:
    """A SentencePiece vocabulary of n_vocab tokens: <unk>, <s>, </s>, the 256 byte tokens,
    then plain pieces."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(n_vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (n_vocab - 259)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens[:n_vocab])
    w.add_token_scores([0.0] * n_vocab)
    w.add_token_types(types[:n_vocab])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
