"""llama-quantize's file types (the TYPE argument) and tensor type names.

A file type ("ftype", llama.h `llama_ftype`) names a whole-model recipe: a default tensor
type plus, for the K-quant mixtures, the rules in plan.py that give some tensors more bits.
Its numeric id is what general.file_type holds and what llama-quantize accepts in place of
the name.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import MinillmError
from ..formats import FORMATS_BY_NAME, Format


@dataclass(frozen=True)
class FileType:
    name: str          # llama-quantize's name, e.g. "Q4_K_M"
    ftype: int         # llama_ftype id, written to general.file_type
    default: str       # the tensor type most weights get (llama_ftype_get_default_type)
    description: str   # llama-quantize's note (size and perplexity on Llama-3-8B)

    @property
    def default_format(self) -> Format:
        return FORMATS_BY_NAME[self.default]


FILE_TYPES = [
    FileType("F32", 0, "F32", "26.00G              @ 7B"),
    FileType("F16", 1, "F16", "14.00G, +0.0020 ppl @ Mistral-7B"),
    FileType("BF16", 32, "BF16", "14.00G, -0.0050 ppl @ Mistral-7B"),
    FileType("Q8_0", 7, "Q8_0", " 7.96G, +0.0026 ppl @ Llama-3-8B"),
    FileType("Q4_0", 2, "Q4_0", " 4.34G, +0.4685 ppl @ Llama-3-8B"),
    FileType("Q4_1", 3, "Q4_1", " 4.78G, +0.4511 ppl @ Llama-3-8B"),
    FileType("Q5_0", 8, "Q5_0", " 5.21G, +0.1316 ppl @ Llama-3-8B"),
    FileType("Q5_1", 9, "Q5_1", " 5.65G, +0.1062 ppl @ Llama-3-8B"),
    FileType("Q2_K", 10, "Q2_K", " 2.96G, +3.5199 ppl @ Llama-3-8B"),
    FileType("Q3_K_S", 11, "Q3_K", " 3.41G, +1.6321 ppl @ Llama-3-8B"),
    FileType("Q3_K_M", 12, "Q3_K", " 3.74G, +0.6569 ppl @ Llama-3-8B"),
    FileType("Q3_K_L", 13, "Q3_K", " 4.03G, +0.5562 ppl @ Llama-3-8B"),
    FileType("Q4_K_S", 14, "Q4_K", " 4.37G, +0.2689 ppl @ Llama-3-8B"),
    FileType("Q4_K_M", 15, "Q4_K", " 4.58G, +0.1754 ppl @ Llama-3-8B"),
    FileType("Q5_K_S", 16, "Q5_K", " 5.21G, +0.1049 ppl @ Llama-3-8B"),
    FileType("Q5_K_M", 17, "Q5_K", " 5.33G, +0.0569 ppl @ Llama-3-8B"),
    FileType("Q6_K", 18, "Q6_K", " 6.14G, +0.0217 ppl @ Llama-3-8B"),
]
FILE_TYPES_BY_NAME = {t.name: t for t in FILE_TYPES}
FILE_TYPES_BY_ID = {t.ftype: t for t in FILE_TYPES}
# llama-quantize's aliases
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}

# tensor types a user may name (--output-tensor-type etc.): the formats we can write
TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def parse_file_type(text: str | int) -> FileType:
    """A TYPE argument (name, case-insensitive, an alias, or the numeric ftype id)."""
    key = str(text).strip().upper()
    key = ALIASES.get(key, key)
    if key in FILE_TYPES_BY_NAME:
        return FILE_TYPES_BY_NAME[key]
    if key.isdigit() and int(key) in FILE_TYPES_BY_ID:
        return FILE_TYPES_BY_ID[int(key)]
    raise MinillmError(f"unknown quantization type {text!r}; choose one of: "
                       + ", ".join(t.name for t in FILE_TYPES) + " (or its numeric id)")


def parse_tensor_type(text: str) -> Format:
    """A tensor type name (ggml's, case-insensitive), e.g. 'q8_0' -> the Q8_0 Format."""
    key = str(text).strip().upper()
    if key not in TENSOR_TYPES:
        raise MinillmError(f"unknown tensor type {text!r}; choose one of: {', '.join(TENSOR_TYPES)}")
    return FORMATS_BY_NAME[key]


def type_help() -> str:
    """The list of TYPE values with bits per weight, for --help."""
    lines = []
    for t in FILE_TYPES:
        alias = next((a for a, n in ALIASES.items() if n == t.name), None)
        name = f"{t.name} ({alias})" if alias else t.name
        lines.append(f"{t.ftype:>2}  {name:<15} {t.default_format.bits_per_weight:5.2f} bpw  {t.description}")
    return "\n".join(lines)
