"""Which type each tensor gets: a port of llama.cpp's llama-quant.cpp selection rules.

* tensor_allows_quantization: only 2-D+ weight matrices, never norms, routers, position
  embeddings and a list of small special tensors;
* llama_tensor_get_type(_impl): the K-quant mixtures give more bits to attn_v, ffn_down
  (use_more_bits: the first and last eighth of the layers and every third in between),
  attn_output and the output / tied token embedding, depending on the file type;
* tensor_type_fallback: a row length that the chosen block size does not divide falls back
  to a 32-value type (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, Q2_K/Q3_K -> Q4_0), or F16.

Tensors are visited in llama.cpp's order (non-layer tensors first, then by layer number and
name), which matters: the attn_v / ffn_down counters depend on it, and the output file keeps it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import MinillmError
from ..formats import FORMATS_BY_NAME, Format
from ..gguf_file import GGUFFile, TensorInfo
from .ftypes import FileType

Q8_0, Q6_K, Q5_K, Q4_K, Q3_K = (FORMATS_BY_NAME[n] for n in ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K"))
Q4_1, Q5_1 = FORMATS_BY_NAME["Q4_1"], FORMATS_BY_NAME["Q5_1"]
F16 = FORMATS_BY_NAME["F16"]

# tensor_type_fallback: block-256 type -> 32-value replacement
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}

# name fragments of 2-D weights that llama.cpp never quantizes (tensor_allows_quantization)
NEVER_QUANTIZED = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
    "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight",
    "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight",
    "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
    "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd",
    "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook",
    "mm.a.code_embd",
)
NEVER_QUANTIZED_NAMES = ("position_embd.weight", "token_types.weight")

# tensor categories (tensor_get_category), first match wins
OUTPUT, TOKEN_EMBD, ATTN_QKV, ATTN_KV_B, ATTN_V, ATTN_K, ATTN_Q, ATTN_OUTPUT = range(8)
FFN_UP, FFN_GATE, FFN_DOWN, OTHER = range(8, 12)
_CATEGORY_FRAGMENTS = ((ATTN_QKV, "attn_qkv.weight"), (ATTN_KV_B, "attn_kv_b.weight"),
                       (ATTN_V, "attn_v.weight"), (ATTN_K, "attn_k.weight"), (ATTN_Q, "attn_q.weight"),
                       (ATTN_OUTPUT, "attn_output.weight"), (FFN_UP, "ffn_up"),
                       (FFN_GATE, "ffn_gate"), (FFN_DOWN, "ffn_down"))
ATTN_V_LIKE = (ATTN_V, ATTN_QKV, ATTN_KV_B)
_LAYER = re.compile(r"blk\.\s*([+-]?\d+)")
_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class PlanOptions:
    """llama-quantize's options that change the types (see the CLI for their meaning)."""
    pure: bool = False
    leave_output_tensor: bool = False
    output_tensor_type: Format | None = None
    token_embedding_type: Format | None = None
    tensor_types: tuple[tuple[re.Pattern, Format], ...] = ()
    prune_layers: tuple[int, ...] = ()          # sorted, unique
    has_imatrix: bool = False                   # quantizing with an importance matrix


@dataclass(frozen=True)
class ModelFacts:
    """The hyper-parameters the mixture rules look at."""
    arch: str
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        """llama.cpp's LLM_TYPE_70B (a llama with 80 layers and grouped-query attention)."""
        return self.arch == "llama" and self.n_layer == 80 and self.n_head != self.n_head_kv

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> "ModelFacts":
        arch = gf.architecture or ""

        def first(key: str) -> int:
            value = gf.metadata.get(f"{arch}.{key}", 0)
            if not isinstance(value, (int, float)):
                value = value[0] if len(value) else 0
            return int(value)
        return cls(arch, first("block_count"), first("attention.head_count"),
                   first("attention.head_count_kv"), first("expert_count"))


@dataclass
class TensorPlan:
    name: str                # in the output file (layers renumbered after pruning)
    shape: tuple[int, ...]   # GGUF order, trailing 1s dropped (ggml_n_dims)
    src: Format
    dst: Format
    n_elements: int
    source: str = ""         # in the input file, when it differs from name

    def __post_init__(self):
        self.source = self.source or self.name

    @property
    def converts(self) -> bool:
        return self.src is not self.dst

    @property
    def requantizes(self) -> bool:
        return self.converts and self.src.quantized

    @property
    def src_bytes(self) -> int:
        return self.n_elements // self.src.block_size * self.src.type_size

    @property
    def dst_bytes(self) -> int:
        return self.n_elements // self.dst.block_size * self.dst.type_size


@dataclass
class Plan:
    file_type: FileType
    tensors: list[TensorPlan]                  # in output order
    warnings: list[str] = field(default_factory=list)
    n_fallback: int = 0
    n_layer_kept: int | None = None            # block_count after --prune-layers


def layer_index(name: str) -> int:
    """sscanf(name, "blk.%d.") or -1."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def llama_order(names) -> list[str]:
    """llama.cpp's weights_map order: by layer (-1 for non-layer tensors), then by name."""
    return sorted(names, key=lambda n: (layer_index(n), n.encode("utf-8", "surrogateescape")))


def category(name: str) -> int:
    if name == "output.weight":
        return OUTPUT
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return TOKEN_EMBD
    return next((cat for cat, frag in _CATEGORY_FRAGMENTS if frag in name), OTHER)


def allows_quantization(name: str, n_dims: int, opts: PlanOptions) -> bool:
    """llama.cpp's tensor_allows_quantization."""
    if n_dims < 2 or not name.endswith("weight"):
        return False
    if opts.leave_output_tensor and name == "output.weight":
        return False
    if name in NEVER_QUANTIZED_NAMES:
        return False
    return not any(frag in name for frag in NEVER_QUANTIZED)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """The layers a mixture favours: first and last eighth, and every third in between."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)   # left side >= 0 here, so C's % agrees


def ggml_shape(shape) -> tuple[int, ...]:
    """The shape llama.cpp writes: trailing dimensions of 1 dropped (ggml_n_dims), at least 1."""
    dims = list(shape)
    while len(dims) > 1 and dims[-1] == 1:
        dims.pop()
    return tuple(dims)


class _Planner:
    """llama_tensor_get_type with its state (quantize_state_impl): call target() once per
    tensor, in llama.cpp's order."""

    def __init__(self, gf: GGUFFile, file_type: FileType, opts: PlanOptions, names: list[str]):
        self.facts = ModelFacts.from_gguf(gf)
        self.ftype = file_type.name
        self.default = file_type.default_format
        self.opts = opts
        self.tied_embeddings = "output.weight" not in names
        self.n_attention_wv = sum(category(n) in ATTN_V_LIKE for n in names)
        self.n_layer = self.facts.n_layer            # n_ffn_down = n_ffn_gate = n_ffn_up, unpruned
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0
        self.n_fallback = 0
        self.warnings: list[str] = []

    def target(self, name: str, shape: tuple[int, ...], src: Format) -> Format:
        opts, cat = self.opts, category(name)
        if not allows_quantization(name, len(shape), opts):
            return src
        if opts.token_embedding_type is not None and cat == TOKEN_EMBD:
            return opts.token_embedding_type
        if opts.output_tensor_type is not None and cat == OUTPUT:
            return opts.output_tensor_type
        new = self.default
        if not new.quantized:
            return new
        manual = next((fmt for pattern, fmt in opts.tensor_types if pattern.search(name)), None)
        if manual is not None:
            new = manual
        elif not opts.pure:
            new = self._mixture(name, shape, new, cat)
        return self._fallback(name, shape[0], new)

    # -- llama_tensor_get_type_impl (branches for file types we do not offer are left out) --
    def _mixture(self, name: str, shape, new: Format, cat: int) -> Format:
        ft, facts = self.ftype, self.facts
        falcon = facts.arch == "falcon"
        if cat == OUTPUT or (self.tied_embeddings and cat == TOKEN_EMBD):
            if self.opts.output_tensor_type is not None:
                return self.opts.output_tensor_type
            if falcon or shape[0] % new.block_size:
                return Q8_0
            return new if new is Q8_0 else Q6_K
        if cat == TOKEN_EMBD:
            return new
        if cat in ATTN_V_LIKE:
            return self._attn_v(new)
        if cat == ATTN_K:
            return Q8_0 if facts.n_expert == 8 else new
        if cat == FFN_DOWN:
            i_layer, n_layer = self._layer_info(self.i_ffn_down, name)
            self.i_ffn_down += 1
            return self._ffn_down(new, i_layer, n_layer, falcon)
        if cat == ATTN_OUTPUT:
            if falcon:
                return Q4_K if ft == "Q3_K_L" else new
            if facts.n_expert == 8:
                return Q5_K if ft in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M") else new
            return {"Q2_K": Q3_K, "Q3_K_M": Q4_K, "Q3_K_L": Q5_K}.get(ft, new)
        if cat == FFN_GATE:
            self._layer_info(self.i_ffn_gate, name)
            self.i_ffn_gate += 1
        elif cat == FFN_UP:
            self._layer_info(self.i_ffn_up, name)
            self.i_ffn_up += 1
        return new

    def _attn_v(self, new: Format) -> Format:
        ft, facts, i = self.ftype, self.facts, self.i_attention_wv
        if ft == "Q2_K":
            new = Q4_K if facts.n_gqa >= 4 else Q3_K
        elif ft == "Q3_K_M":
            new = Q5_K if i < 2 else Q4_K
        elif ft == "Q3_K_L":
            new = Q5_K
        elif ft in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, self.n_attention_wv):
            new = Q6_K
        elif ft == "Q4_K_S" and i < 4:
            new = Q5_K
        if facts.is_70b and new in (Q3_K, Q4_K):
            new = Q5_K
        if facts.n_expert == 8:
            new = Q8_0
        self.i_attention_wv += 1
        return new

    def _ffn_down(self, new: Format, i_layer: int, n_layer: int, falcon: bool) -> Format:
        ft = self.ftype
        more = use_more_bits(i_layer, n_layer)
        if ft == "Q2_K":
            return Q3_K
        if ft == "Q3_K_M":
            return Q5_K if i_layer < n_layer // 16 else Q4_K if (not falcon or more) else Q3_K
        if ft == "Q3_K_L":
            return Q4_K if falcon else Q5_K
        if ft == "Q4_K_M":
            if falcon:
                return Q6_K if i_layer < n_layer // 16 else Q5_K if more else Q4_K
            return Q6_K if more else new
        if ft == "Q5_K_M" and more:
            return Q6_K
        if ft == "Q4_K_S" and not falcon and i_layer < n_layer // 8:
            return Q5_K
        if ft in ("Q4_0", "Q5_0") and self.opts.has_imatrix and i_layer < n_layer // 8:
            return Q4_1 if ft == "Q4_0" else Q5_1   # llama.cpp's guard for the first ffn_down layers
        return new

    def _layer_info(self, i_layer: int, name: str) -> tuple[int, int]:
        """(layer, n_layer): the running count, or for MoE models the number in the name."""
        if self.facts.n_expert > 1:
            i_layer = layer_index(name)
            if not 0 <= i_layer < self.n_layer:
                raise MinillmError(f"cannot determine the layer of tensor {name} (n_layer {self.n_layer})")
        return i_layer, self.n_layer

    def _fallback(self, name: str, ncols: int, fmt: Format) -> Format:
        """tensor_type_fallback."""
        if ncols % fmt.block_size == 0:
            return fmt
        self.n_fallback += 1
        if fmt.name not in FALLBACK:
            raise MinillmError(f"tensor {name}: {ncols} columns are not a multiple of {fmt.name}'s "
                               f"block size {fmt.block_size}, and no fallback is defined for {fmt.name}")
        new = FORMATS_BY_NAME[FALLBACK[fmt.name]]
        if ncols % new.block_size:
            new = F16
        self.warnings.append(f"{name}: {ncols} columns not divisible by {fmt.block_size} "
                             f"(required for {fmt.name}), falling back to {new.name}")
        return new


def make_plan(gf: GGUFFile, file_type: FileType, opts: PlanOptions) -> Plan:
    """Every tensor's source and target type, in the order the output file will hold them."""
    renamed, n_kept = prune_layers(llama_order(gf.tensors), opts.prune_layers, ModelFacts.from_gguf(gf).n_layer)
    planner = _Planner(gf, file_type, opts, [new for _, new in renamed])
    tensors = []
    for source, name in renamed:
        info: TensorInfo = gf.tensors[source]
        shape = ggml_shape(info.shape)
        dst = planner.target(name, shape, info.format)
        if shape[0] % dst.block_size:
            raise MinillmError(f"tensor {name}: {shape[0]} columns are not a multiple of "
                               f"{dst.name}'s block size {dst.block_size}")
        tensors.append(TensorPlan(name, shape, info.format, dst, info.n_elements, source))
    return Plan(file_type, tensors, planner.warnings, planner.n_fallback, n_kept)


def prune_layers(names: list[str], prune: tuple[int, ...], n_layer: int):
    """([(input name, output name)] without the pruned layers' tensors, the layers kept or None
    when nothing is pruned). The kept layers are renumbered 0, 1, ... in order, as llama-quantize
    --prune-layers does (its remap_layer over names in llama.cpp's order)."""
    if not prune:
        return [(n, n) for n in names], None
    bad = [i for i in prune if not 0 <= i < n_layer]
    if bad:
        raise MinillmError(f"prune_layers: the model has layers 0-{n_layer - 1}; no layer {bad[0]}",
                           ("prune_layers",))
    if len(prune) >= n_layer:
        raise MinillmError(f"prune_layers would remove all {n_layer} layers", ("prune_layers",))
    new_index = {}
    for old in range(n_layer):
        if old not in prune:
            new_index[old] = len(new_index)
    renamed = []
    for name in names:
        m = _BLOCK.match(name)
        if m is None:
            renamed.append((name, name))
        elif int(m.group(1)) in new_index:
            renamed.append((name, f"blk.{new_index[int(m.group(1))]}.{name[m.end():]}"))
    return renamed, len(new_index)
