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
_DEEPSEEK_LETTERS = (
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗ"
    r"ὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗ"
    r"Ａ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+"
)
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
