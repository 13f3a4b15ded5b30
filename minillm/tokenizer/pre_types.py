"""Which regexes each `tokenizer.ggml.pre` name stands for (llama.cpp llama-vocab.cpp).

The regex strings are llama.cpp's, character for character (after C++ unescaping), because
`unicode_regex_split` gives them meaning on collapsed text; see pretokenize.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import MinillmError

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5's: letter runs take combining marks (\p{M}) too
QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-LLM's letter class, as hex ranges: written as characters, several of these (e.g.
# U+2126 OHM SIGN, U+212A KELVIN SIGN) are easily swapped for their canonical equivalents.
_DEEPSEEK_LETTER_RANGES = """
0041-005A 0061-007A 00B5 00C0-00D6 00D8-00F6 00F8-01BA 01BC-01BF 01C4-0293 0295-02AF 0370-0373
0376-0377 037B-037D 037F 0386 0388-038A 038C 038E-03A1 03A3-03F5 03F7-0481 048A-052F 0531-0556
10A0-10C5 13A0-13F5 13F8-13FD 1C90-1CBA 1CBD-1CBF 1D00-1D2B 1D6B-1D77 1D79-1D9A 1E00-1F15 1F18-1F1D
1F20-1F45 1F48-1F4D 1F50-1F57 1F59 1F5B 1F5D 1F5F-1F7D 1F80-1FB4 1FB6-1FBC 1FBE 1FC2-1FC4 1FC6-1FCC
1FD0-1FD3 1FD6-1FDB 1FE0-1FEC 1FF2-1FF4 1FF6-1FFC 2102 2107 210A-2113 2115 2119-211D 2124 2126 2128
212A-212D 212F-2134 2139 213C-213F 2145-2149 214E 2183-2184 2C00-2C7B 2C7E-2CE4 2CEB-2CEE 2CF2-2CF3
A640-A66D A680-A69B A722-A76F A771-A787 A78B-A78E AB70-ABBF FB00-FB06 FB13-FB17 FF21-FF3A FF41-FF5A
10400-1044F 104B0-104D3 104D8-104FB 10C80-10CB2 10CC0-10CF2 118A0-118DF 1E900-1E943
"""


def _char_class(hex_ranges: str) -> str:
    """'0041-005A 00B5' -> '[A-Zµ]'."""
    parts = []
    for item in hex_ranges.split():
        first, _, last = item.partition("-")
        parts.append(chr(int(first, 16)) + ("-" + chr(int(last, 16)) if last else ""))
    return "[" + "".join(parts) + "]"


_DEEPSEEK_LETTERS = r"\s?" + _char_class(_DEEPSEEK_LETTER_RANGES) + "+"
_CJK_RUN = "[一-龥ࠀ-一가-퟿]+"
_UPPER_LOWER = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+<C>"
                r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*<C>")
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"

_REGEXES: dict[str, list[str]] = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
    "gpt2": [GPT2],
    "starcoder": [r"\p{N}", GPT2],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"],
    "llama3": [LLAMA3],
    "qwen2": [QWEN2],
    "qwen35": [QWEN35],
    "deepseek-llm": ["[\r\n]", _DEEPSEEK_LETTERS, r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$",
                     _CJK_RUN, r"\p{N}+"],
    "deepseek-coder": ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_RUN, r"\p{N}"],
    "bloom": [_BLOOM],
    "viking": [_BLOOM, r"\p{N}"],
    "tekken": [_UPPER_LOWER.replace("<C>", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+"],
    "gpt-4o": [_UPPER_LOWER.replace("<C>", _CONTRACTIONS + "?") + r"|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
}


@dataclass(frozen=True)
class PreType:
    """How a BPE vocabulary pre-tokenizes: its regexes and llama.cpp's per-type switches."""

    name: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False   # a word that is itself a token is not merged (llama3)
    add_bos: bool = False         # default when tokenizer.ggml.add_bos_token is absent


def _family(regex_key: str, names: str, **flags) -> dict[str, PreType]:
    return {name: PreType(name, tuple(_REGEXES[regex_key]), **flags) for name in names.split()}


PRE_TYPES: dict[str, PreType] = {
    **_family("default", "default"),
    **_family("llama3", "llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2",
              ignore_merges=True, add_bos=True),
    **_family("llama3", "dbrx smaug-bpe"),
    **_family("deepseek-llm", "deepseek-llm"),
    **_family("deepseek-coder", "deepseek-coder"),
    **_family("falcon", "falcon"),
    **_family("starcoder", "starcoder refact command-r smollm codeshell exaone minerva-7b"),
    **_family("gpt2", "gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 "
                      "mellum jina-v1-en jina-v2-code roberta-bpe mpt olmo jais trillion "
                      "exaone4 granite-docling"),
    **_family("qwen2", "qwen2 deepseek-r1-qwen kormo stablelm2 megrez hunyuan grok-2"),
    **_family("qwen35", "qwen35"),
    **_family("bloom", "bloom poro-chat gpt3-finnish"),
    **_family("viking", "viking"),
    **_family("tekken", "tekken", ignore_merges=True, add_bos=True),
    **_family("gpt-4o", "gpt-4o llama4 minimax-m2"),
}


def pre_type(name: str) -> PreType:
    """The PreType for a `tokenizer.ggml.pre` value; MinillmError naming it when unknown."""
    try:
        return PRE_TYPES[name]
    except KeyError:
        raise MinillmError(
            f"unknown BPE pre-tokenizer {name!r} (tokenizer.ggml.pre); this tokenizer cannot "
            f"split text the way the model was trained. Known: {', '.join(sorted(PRE_TYPES))}"
        ) from None
