"""What every decoder-only architecture shares: metadata checks, the tensors it needs, RoPE.

An architecture is declarative: its hyper-parameters, tensors (in the order its layer takes
them), RoPE tables and one layer function; a backend (minillm/backends) loads the weights and
runs the forward loop."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import ModelError, UnsupportedError
from ..gguf_file import GGUFFile
from ..kernels.cpu import ops
from ..kernels.cpu.unpack import dequantize
MAX_LAYERS = 512
NO_MATRIX = "no matrix"  # a layer_sources entry: a matrix slot this layer leaves empty (zero rows)


NO_EXPERTS = "no experts"  # a layer_sources entry: an expert slot this layer leaves empty


@dataclass(frozen=True)
class Experts:
    """A layer_sources entry: a 3-D tensor of n matrices, one per expert (stacked, kernels/cpu/moe.py)."""
    name: str
    n: int
MAX_WIDTH = 1 << 16
MAX_HEADS = 1024


# The keys of an architecture's namespace that every module reads (or knows to change nothing).
# A key outside these and the module's own `handled_keys` may change the arithmetic: refused.
COMMON_KEYS = frozenset({
    "context_length", "embedding_length", "block_count", "feed_forward_length", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.dimension_count", "rope.freq_base",
    "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear", "rope.scaling.original_context_length",
    "rope.scaling.attn_factor", "rope.scaling.finetuned",
    # written by llama.cpp's converter from YaRN configs; b11434 reads them for DeepSeek-style
    # models only, so these architectures compute without them, as it does
    "rope.scaling.yarn_ext_factor", "rope.scaling.yarn_attn_factor", "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
})
# keys that are harmless at these values (a mixture of experts, a non-causal encoder: refused)
NEUTRAL_VALUES = {"expert_count": 0, "expert_used_count": 0, "attention.causal": True, "pooling_type": 0}
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")


@dataclass
class RopeScaling:
    """llama.cpp's RoPE parameters for the file (ggml_rope_ext's freq_scale, ext_factor and
    attn_factor; the corr dims follow from each table's base) and its frequency factors."""
    kind: str = "linear"
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    n_ctx_orig: int = 0  # YaRN's correction dims and LongRoPE's choice are relative to it
    factors: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))  # (rope_dims/2,)
    factors_long: np.ndarray | None = None  # LongRoPE: instead of factors for contexts over n_ctx_orig
    beta_fast: float = 32.0  # YaRN's correction range (llama.cpp's defaults; mistral3 reads its keys)
    beta_slow: float = 1.0

    def factors_for(self, n_ctx: int) -> np.ndarray:
        """The frequency factors llama.cpp picks for a context of n_ctx positions a sequence."""
        if self.factors_long is not None and n_ctx > self.n_ctx_orig:
            return self.factors_long
        return self.factors


@dataclass
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dims: int


def inv_sqrt(n: float) -> float:
    """1.0f/sqrtf(n) in float32, as llama.cpp computes attention scales."""
    return float(np.float32(1.0) / np.sqrt(np.float32(n)))


class Metadata:
    """Typed, bounded access to an architecture's metadata keys."""

    def __init__(self, gguf: GGUFFile, arch: str):
        self.gguf, self.arch = gguf, arch

    def _get(self, key: str, default):
        full = f"{self.arch}.{key}"
        value = self.gguf.metadata.get(full, default)
        if value is None:
            raise ModelError(f"missing metadata key '{full}'")
        return full, value

    def int(self, key: str, lo: int, hi: int, default=None) -> int:
        full, value = self._get(key, default)
        if isinstance(value, np.ndarray):  # per-layer arrays: all layers must agree here
            if value.size == 0 or not np.all(value == value.flat[0]):
                raise ModelError(f"'{full}' varies per layer, which is not supported")
            value = value.flat[0].item()
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ModelError(f"metadata '{full}' = {value!r} is out of range [{lo}, {hi}]")
        return int(value)

    def float(self, key: str, lo: float, hi: float, default=None) -> float:
        full, value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise ModelError(f"metadata '{full}' = {value!r} is out of range [{lo}, {hi}]")
        return float(value)

    def str(self, key: str, choices: tuple[str, ...], default=None) -> str:
        full, value = self._get(key, default)
        if value not in choices:
            raise UnsupportedError(f"metadata '{full}' = {value!r} is not supported (supported: {', '.join(choices)})")
        return value

    def bool(self, key: str, default=None) -> bool:
        full, value = self._get(key, default)
        if not isinstance(value, bool):
            raise ModelError(f"metadata '{full}' = {value!r} is not true or false")
        return value

    def keys(self) -> list[str]:
        """The architecture's own keys present in the file, without the prefix."""
        prefix = self.arch + "."
        return [k[len(prefix):] for k in self.gguf.metadata if k.startswith(prefix)]


class Transformer:
    """A decoder-only transformer; subclasses define the hyper-parameters and one layer."""

    name = ""
    rope_neox = False
    # the layer tensors, in the order the compiled layer function unpacks them
    layer_order = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
                   "ffn_up", "ffn_down")

    # the module's own keys beyond COMMON_KEYS
    handled_keys: frozenset = frozenset()
    # 2-D F32 layer tensors the layer reads as their values (array()) rather than as a product's
    array_tensors: tuple = ()
    # what this architecture does not run yet: feature -> what it is (Backend.check_supports)
    unsupported: dict = {}
    output_norm = "output_norm.weight"  # the final norm's tensor

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf
        self.meta = Metadata(gguf, self.name)
        self.check_keys()
        self.hp = self.read_hparams()
        self.rope = self.read_rope_scaling()
        self.check_tensors()

    # -- hyper-parameters and tensors ------------------------------------------------
    def read_hparams(self) -> HParams:
        m = self.meta
        n_embd = m.int("embedding_length", 1, MAX_WIDTH)
        n_head = m.int("attention.head_count", 1, MAX_HEADS)
        n_head_kv = self.read_head_count_kv(n_head)
        if n_head % n_head_kv:
            raise ModelError(f"head count {n_head} is not a multiple of the key/value head count {n_head_kv}")
        head_dim = m.int("attention.key_length", 1, MAX_WIDTH, default=n_embd // n_head)
        if m.int("attention.value_length", 1, MAX_WIDTH, default=head_dim) != head_dim:
            raise ModelError("key and value head sizes differ, which is not supported")
        emb = self.gguf.tensors.get("token_embd.weight")
        if emb is None or len(emb.shape) != 2:
            raise ModelError("missing tensor 'token_embd.weight' (or it is not a matrix)")
        return HParams(
            n_vocab=emb.shape[1],
            n_embd=n_embd,
            n_layer=m.int("block_count", 1, MAX_LAYERS),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=m.int("feed_forward_length", 1, 1 << 20),
            n_ctx_train=m.int("context_length", 1, 1 << 24),
            rms_eps=m.float("attention.layer_norm_rms_epsilon", 0.0, 1.0),
            rope_base=m.float("rope.freq_base", 1e-3, 1e12, default=10000.0),
            rope_dims=m.int("rope.dimension_count", 2, head_dim, default=head_dim),
        )

    def read_head_count_kv(self, n_head: int) -> int:
        """attention.head_count_kv: one value for every layer."""
        return self.meta.int("attention.head_count_kv", 1, n_head, default=n_head)

    def check_keys(self) -> None:
        """Refuse a key of the architecture's namespace that this module does not compute."""
        for key in self.meta.keys():
            if key in COMMON_KEYS or key in self.handled_keys:
                continue
            if key in NEUTRAL_VALUES and self.gguf.metadata[f"{self.name}.{key}"] == NEUTRAL_VALUES[key]:
                continue
            raise UnsupportedError(f"metadata '{self.name}.{key}' asks for arithmetic that minillm's "
                                   f"{self.name} module does not implement: refusing rather than "
                                   f"computing something else")

    def read_rope_scaling(self) -> RopeScaling:
        """The rope scaling keys and factor tensors, as llama.cpp b11434 turns them into
        ggml_rope_ext's parameters (llama_context's yarn_attn_factor included)."""
        m, hp = self.meta, self.hp
        kind = m.str("rope.scaling.type", ROPE_SCALING_TYPES, default="linear")
        factor = m.float("rope.scaling.factor", 0.0, 1e6, default=m.float("rope.scale_linear", 0.0, 1e6, default=0.0))
        freq_scale = 1.0 if factor == 0 or kind == "none" else float(np.float32(1.0) / np.float32(factor))
        n_ctx_orig = m.int("rope.scaling.original_context_length", 1, 1 << 24, default=hp.n_ctx_train)
        rope = RopeScaling(kind, freq_scale, 1.0 if kind == "yarn" else 0.0, 1.0, n_ctx_orig)
        if rope.ext_factor:
            rope.attn_factor = float(ops.yarn_attn_factor(np.float32(freq_scale), np.float32(self.yarn_log_mul())))
        rope.attn_factor = float(np.float32(rope.attn_factor) * np.float32(
            m.float("rope.scaling.attn_factor", 0.0, 1e6, default=1.0)))
        self.rope_factor_tensors = self.rope_factor_names(kind)
        present = [name for name in self.rope_factor_tensors if name in self.gguf.tensors]
        if "rope_freqs.weight" in present:
            rope.factors = self.factor_vector("rope_freqs.weight")
        elif present:  # LongRoPE: both sets
            rope.factors = self.factor_vector("rope_factors_short.weight")
            rope.factors_long = self.factor_vector("rope_factors_long.weight")
        return rope

    def yarn_log_mul(self) -> float:
        """rope.scaling.yarn_log_multiplier where the module reads it (0: none)."""
        return 0.0

    def rope_factor_names(self, kind: str) -> tuple[str, ...]:
        """The frequency-factor tensors the module applies for this rope scaling type (others
        in the file are refused by check_tensors)."""
        return ()

    def factor_vector(self, name: str) -> np.ndarray:
        """A (rope_dims/2,) float32 vector of rope frequency factors, checked."""
        info = self.gguf.tensors.get(name)
        half = self.hp.rope_dims // 2
        if info is None:
            raise ModelError(f"missing tensor '{name}' (the file has the other LongRoPE factors)")
        if info.shape != (half,) or info.format.name != "F32":
            raise ModelError(f"tensor '{name}' must be F32 of shape [{half}], not {info.format.name} "
                             f"{list(info.shape)}")
        factors = self.vector(name).copy()
        if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
            raise ModelError(f"tensor '{name}' holds factors that are not positive numbers")
        return factors

    def layer_tensors(self, il: int) -> dict[str, tuple[int, ...]]:
        """Tensor name suffix -> expected GGUF shape for layer il."""
        hp = self.hp
        E, F, q_dim, kv_dim = hp.n_embd, hp.n_ff, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        return {
            "attn_norm": (E,), "attn_q": (E, q_dim), "attn_k": (E, kv_dim), "attn_v": (E, kv_dim),
            "attn_output": (q_dim, E), "ffn_norm": (E,), "ffn_gate": (E, F), "ffn_up": (E, F),
            "ffn_down": (F, E),
        }

    def optional_layer_tensors(self, il: int) -> dict[str, tuple[int, ...]]:
        """Tensors a layer may have (full names after 'blk.N.', e.g. 'attn_q.bias') -> shape."""
        return {}

    def global_tensors(self) -> dict[str, tuple[int, ...]]:
        """Tensors outside the layers that the file may have -> shape."""
        hp = self.hp
        shapes = {"token_embd.weight": (hp.n_embd, hp.n_vocab), self.output_norm: (hp.n_embd,),
                  "output.weight": (hp.n_embd, hp.n_vocab)}
        shapes.update({name: (hp.rope_dims // 2,) for name in self.rope_factor_tensors})
        return shapes

    def check_tensors(self) -> None:
        """Every tensor the module needs is there with its shape; every tensor there is one it
        computes with (an unknown one would change the arithmetic: refused)."""
        hp = self.hp
        required = {"token_embd.weight", self.output_norm}
        expected = self.global_tensors()
        for il in range(hp.n_layer):
            for suffix, shape in self.layer_tensors(il).items():
                expected[f"blk.{il}.{suffix}.weight"] = shape
                required.add(f"blk.{il}.{suffix}.weight")
            for suffix, shape in self.optional_layer_tensors(il).items():
                expected[f"blk.{il}.{suffix}"] = shape
        for name in self.gguf.tensors:
            if name not in expected and not self.ignored_tensor(name):
                raise UnsupportedError(f"tensor '{name}' is not one minillm's {self.name} module computes with: "
                                 f"refusing rather than ignoring it")
        for name, shape in expected.items():
            info = self.gguf.tensors.get(name)
            if info is None:
                if name in required:
                    raise ModelError(f"missing tensor '{name}' (the metadata says {hp.n_layer} layers)")
                continue
            if info.shape != shape:
                raise ModelError(f"tensor '{name}' has shape {list(info.shape)}, "
                                 f"but the metadata implies {list(shape)}")
            if len(shape) == 2 and info.format.quantized and shape[0] % 32:
                raise ModelError(f"tensor '{name}': row length {shape[0]} is not a multiple of 32")
            if len(shape) == 1 and info.format.name != "F32":
                raise ModelError(f"tensor '{name}' must be F32, not {info.format.name}")

    def ignored_tensor(self, name: str) -> bool:
        """A tensor the file may hold that the module knowingly leaves unread."""
        return False

    def features(self) -> list[str]:
        """What the file asks of the arithmetic beyond the plain architecture (minillm info)."""
        rope, hp, out = self.rope, self.hp, []
        if rope.ext_factor:
            out.append(f"YaRN RoPE scaling x{1 / rope.freq_scale:g} from {rope.n_ctx_orig} positions")
        elif rope.freq_scale != 1:
            out.append(f"linear RoPE scaling x{1 / rope.freq_scale:g}")
        if rope.factors_long is not None:
            out.append(f"LongRoPE factors (long ones past {rope.n_ctx_orig} positions)")
        elif rope.factors.size:
            out.append("RoPE frequency factors")
        if rope.attn_factor != 1:
            out.append(f"RoPE attention factor {rope.attn_factor:.4g}")
        if hp.rope_dims < hp.head_dim:
            out.append(f"RoPE on {hp.rope_dims} of {hp.head_dim} head dims")
        layer0 = [name[len("blk.0."):] for name in self.gguf.tensors if name.startswith("blk.0.")]
        if any(name.endswith(".bias") for name in layer0):
            out.append("biases: " + ", ".join(sorted(n[:-len(".bias")] for n in layer0 if n.endswith(".bias"))))
        if "attn_q_norm.weight" in layer0:
            out.append("per-head q/k norms")
        if "attn_qkv.weight" in layer0:
            out.append("fused q/k/v")
        return out

    # -- tensors -----------------------------------------------------------------------
    def vector(self, name: str) -> np.ndarray:
        return self.gguf.read_rows(name, [0]).view(np.float32).reshape(-1)  # a 1-D tensor is one row

    def layer_sources(self, il: int) -> list:
        """Where each entry of layer_order comes from: (tensor name, row range or None), or
        None for an optional vector the file lacks (the layer gets an empty one). An entry is a
        tensor name after 'blk.N.', '.weight' understood unless it names its own suffix."""
        sources = []
        for entry in self.layer_order:
            name = f"blk.{il}.{entry}" if "." in entry else f"blk.{il}.{entry}.weight"
            sources.append((name, None) if name in self.gguf.tensors else None)
        return sources

    def array(self, name: str) -> np.ndarray:
        """A 2-D F32 tensor's values, row after row (rows * row length,) float32 (its layer
        reshapes it: the slot is a vector where the layer has no such tensor)."""
        rows = self.gguf.tensors[name].shape[1]
        return self.gguf.read_rows(name, np.arange(rows)).view(np.float32).reshape(-1).copy()

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """(T, E) float32 rows of token_embd, dequantized exactly as ggml_get_rows."""
        info = self.gguf.tensors["token_embd.weight"]
        rows = self.gguf.read_rows("token_embd.weight", ids)
        return dequantize(info.format, rows, info.shape[0])

    # -- what the forward loop asks of the architecture (minillm/backends/base.py) ---------
    def cache_layout(self, n_ctx: int, n_batch: int) -> tuple[dict[str, int], list[str]]:
        """Cache group sizes and each layer's group: by default one context-sized group."""
        return {"global": n_ctx}, ["global"] * self.hp.n_layer

    def recurrent_shapes(self):
        """(the recurrent layers, a conv state's shape, a state matrices' shape), or None: a
        model whose every layer keeps a KV cache."""
        return None

    def cpu_only(self) -> str | None:
        """What in the file the CUDA path does not compute yet (None: nothing)."""
        return "recurrent layers beside attention" if self.recurrent_shapes() is not None else None

    def cache_windows(self) -> dict[str, int]:
        """The sliding window of each cache group's layers (absent: none)."""
        return {}

    def finish_logits(self, logits: np.ndarray) -> np.ndarray:
        """The output product's logits (T, V) as the model gives them (Gemma: capped)."""
        return logits

    layer_function = None  # the architecture's compiled layer, written over its module's `ops`

    def layer_args(self, il, tables) -> tuple:
        """The layer function's arguments after (x, w, positions, kv): the rope table, ..."""
        raise NotImplementedError

    def rope_tables(self, positions: np.ndarray, n_ctx: int):
        """The rope tables layer_args hands the layers, for a context of n_ctx positions."""
        return self.rope_table(positions, self.hp.rope_base, n_ctx)

    def rope_table(self, positions: np.ndarray, base: float, n_ctx: int, freq_scale: float | None = None):
        """(cos, sin) (T, rope_dims/2) for the batch, as ggml's rope cache computes them with the
        file's scaling (freq_scale: the file's unless given)."""
        rope, dims = self.rope, self.hp.rope_dims
        scale = np.float32(rope.freq_scale if freq_scale is None else freq_scale)
        low = high = np.float32(0.0)
        if rope.ext_factor:
            low, high = ops.yarn_corr_dims(dims, rope.n_ctx_orig, np.float32(base), rope.beta_fast, rope.beta_slow)
        cos_t = np.empty((len(positions), dims // 2), np.float32)
        sin_t = np.empty((len(positions), dims // 2), np.float32)
        ops.rope_angles(positions, dims, np.float32(base), scale, rope.factors_for(n_ctx), np.float32(rope.ext_factor),
                        low, high, np.float32(rope.attn_factor), cos_t, sin_t)
        return cos_t, sin_t
