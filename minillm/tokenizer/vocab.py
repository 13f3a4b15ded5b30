"""The vocabulary of a GGUF model: token texts, types, scores and special ids.

Mirrors what llama.cpp's `llama_vocab::impl::load` reads from `tokenizer.ggml.*`, including
its defaults and the tokens it finds by their text (end-of-turn markers and the like).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from ..errors import MinillmError
from ..gguf_file import StringArray
from .pre_types import pre_type
from .texts import TokenIndex, VocabTexts


class TokenType(IntEnum):
    """Values of `tokenizer.ggml.token_type` (llama.cpp `llama_token_type`)."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Tokens llama.cpp b11434 recognises by text (llama-vocab.cpp), whatever the file says of them:
# the first found names the special id when the file does not, and is made CONTROL.
EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
             "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
EOM_TEXTS = ("<|eom_id|>",)
FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
                 "<|code_prefix|>", "<|prefix|>")
FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
                 "<|code_suffix|>", "<|suffix|>")
FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
                 "<|code_middle|>", "<|middle|>")
FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_SEP_TEXTS = ("<|file_sep|>",)
# Every token with one of these texts ends generation, and is made CONTROL (so never matched in
# plain text): Gemma 3's "</s>", typed USER_DEFINED in its file, is one.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
             "<｜end▁of▁sentence｜>", "[e~[")
# gpt-oss: always rendered, as USER_DEFINED
ALWAYS_RENDERED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")

# Default special ids per tokenizer model, before the file's own keys override them.
_DEFAULT_IDS = {
    "llama": {"bos": 1, "eos": 2, "unk": 0},
    "gpt2": {"bos": 11, "eos": 11, "unk": None},
}
_SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",  # sic: the GGUF key is spelled this way
    "pad": "tokenizer.ggml.padding_token_id",
    "fim_pre": "tokenizer.ggml.fim_pre_token_id",
    "fim_suf": "tokenizer.ggml.fim_suf_token_id",
    "fim_mid": "tokenizer.ggml.fim_mid_token_id",
    "fim_pad": "tokenizer.ggml.fim_pad_token_id",
    "fim_rep": "tokenizer.ggml.fim_rep_token_id",
    "fim_sep": "tokenizer.ggml.fim_sep_token_id",
}


@dataclass
class Vocab:
    """Token texts and attributes plus the special ids a tokenizer needs."""

    model: str                        # tokenizer.ggml.model: "gpt2" (BPE) or "llama" (SPM)
    pre: str                          # tokenizer.ggml.pre ("default" when absent)
    texts: VocabTexts                 # id -> token text as stored in the file
    types: array                      # id -> TokenType (after llama.cpp's by-text overrides), int32
    scores: array                     # id -> SPM merge score (0.0 when the file has none), float32
    merges: StringArray               # BPE merges "left right", rank = position
    token_to_id: TokenIndex           # text -> id
    special_ids: dict[str, int | None]
    eog_ids: set[int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None = None

    @property
    def n_vocab(self) -> int:
        return len(self.texts)


def load_vocab(metadata: dict[str, Any]) -> Vocab:
    """Build a Vocab from GGUF metadata, raising MinillmError for anything unusable."""
    model = metadata.get("tokenizer.ggml.model")
    if model not in _DEFAULT_IDS:
        raise MinillmError(f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                           f"supported: {', '.join(sorted(_DEFAULT_IDS))}")
    texts = _read_token_texts(metadata)
    n_vocab = len(texts)
    types = _read_array(metadata, "tokenizer.ggml.token_type", n_vocab, TokenType.NORMAL, np.int64)
    types = _compact(np.where((types >= 0) & (types <= 6), types, TokenType.UNDEFINED), "i")
    scores = _compact(_read_array(metadata, "tokenizer.ggml.scores", n_vocab, 0.0, np.float64), "f")
    merges = metadata.get("tokenizer.ggml.merges", [])
    if model == "gpt2" and not merges:
        raise MinillmError("BPE tokenizer without tokenizer.ggml.merges")
    if not _is_strings(merges) and not (isinstance(merges, list) and not merges):
        raise MinillmError("tokenizer.ggml.merges must be an array of strings")
    merges = _as_string_array(merges)

    token_to_id = TokenIndex(texts)
    special_ids = _read_special_ids(metadata, model, n_vocab)
    eog_ids = _detect_by_text(token_to_id, types, special_ids)
    is_spm = model == "llama"
    pre = str(metadata.get("tokenizer.ggml.pre") or "default")
    default_bos = True if is_spm else pre_type(pre).add_bos
    add_bos = _read_bool(metadata, "tokenizer.ggml.add_bos_token", default_bos)
    add_eos = _read_bool(metadata, "tokenizer.ggml.add_eos_token", False)
    add_space_prefix = _read_bool(metadata, "tokenizer.ggml.add_space_prefix", is_spm)
    template = metadata.get("tokenizer.chat_template")
    return Vocab(
        model=model, pre=pre, texts=texts,
        types=types, scores=scores, merges=merges, token_to_id=token_to_id,
        special_ids=special_ids, eog_ids=eog_ids, add_bos=add_bos, add_eos=add_eos,
        add_space_prefix=add_space_prefix,
        chat_template=template if isinstance(template, str) else None,
    )


def _read_token_texts(metadata: dict[str, Any]) -> VocabTexts:
    texts = metadata.get("tokenizer.ggml.tokens")
    if not _is_strings(texts):
        raise MinillmError("the model has no tokenizer vocabulary (tokenizer.ggml.tokens)")
    return VocabTexts(_as_string_array(texts))


def _as_string_array(strings) -> StringArray:
    return strings if isinstance(strings, StringArray) else StringArray.from_strings(strings)


def _is_strings(value) -> bool:
    """A non-empty array of strings: a list, or the loader's lazily decoded StringArray."""
    return isinstance(value, (list, StringArray)) and len(value) > 0 and isinstance(value[0], str)


def _read_array(metadata, key: str, n: int, default, dtype) -> np.ndarray:
    """A numeric per-token array, or `default` for all when the file has none."""
    values = metadata.get(key)
    if values is None:
        return np.full(n, default, dtype)
    if len(values) != n:
        raise MinillmError(f"{key} has {len(values)} entries but the vocabulary has {n} tokens")
    try:
        return np.asarray(values, dtype=dtype)
    except (TypeError, ValueError):
        raise MinillmError(f"{key} must be an array of numbers") from None


def _compact(values: np.ndarray, typecode: str) -> array:
    """An array.array ("i": int32, "f": float32, as llama.cpp holds them): indexed as fast as a
    list, without a Python object per token (a 262,144-token vocabulary's scores took 8 MiB as
    a list of floats)."""
    return array(typecode, values.astype(np.int32 if typecode == "i" else np.float32).tobytes())


def _read_bool(metadata, key: str, default: bool) -> bool:
    value = metadata.get(key)
    return bool(value) if value is not None else default


def _read_special_ids(metadata, model: str, n_vocab: int) -> dict[str, int | None]:
    ids: dict[str, int | None] = {name: None for name in _SPECIAL_ID_KEYS}
    ids.update(_DEFAULT_IDS[model])
    for name, key in _SPECIAL_ID_KEYS.items():
        value = metadata.get(key)
        # llama.cpp keeps the default when the file names an id outside the vocabulary.
        if isinstance(value, (int, np.integer)) and 0 <= int(value) < n_vocab:
            ids[name] = int(value)
    for name, value in ids.items():
        if value is not None and not 0 <= value < n_vocab:
            ids[name] = None
    return ids


def _detect_by_text(token_to_id: TokenIndex, types: array,
                    special_ids: dict[str, int | None]) -> set[int]:
    """llama.cpp's fix-ups by token text: special ids the file does not name, tokens re-typed
    CONTROL, the end-of-generation set. Returns the EOG set."""
    for name, candidates in (("eot", EOT_TEXTS), ("eom", EOM_TEXTS), ("fim_pre", FIM_PRE_TEXTS),
                             ("fim_suf", FIM_SUF_TEXTS), ("fim_mid", FIM_MID_TEXTS), ("fim_pad", FIM_PAD_TEXTS),
                             ("fim_rep", FIM_REP_TEXTS), ("fim_sep", FIM_SEP_TEXTS)):
        if special_ids.get(name) is None:
            # llama.cpp takes the first its hash map yields; the lowest id here (one, in practice)
            found = sorted(token_to_id[t] for t in candidates if t in token_to_id)
            if found:
                special_ids[name] = found[0]
                types[found[0]] = TokenType.CONTROL
    eog = {special_ids[n] for n in ("fim_pad", "fim_rep", "fim_sep") if special_ids[n] is not None}
    for text in EOG_TEXTS:
        token_id = token_to_id.get(text)
        if token_id is not None:
            eog.add(token_id)
            types[token_id] = TokenType.CONTROL
    for text in ALWAYS_RENDERED_TEXTS:
        if text in token_to_id:
            types[token_to_id[text]] = TokenType.USER_DEFINED
    eog.update(special_ids[n] for n in ("eos", "eot", "eom") if special_ids[n] is not None)
    _drop_harmony_end(eog, token_to_id, types)
    _keep_plain_s_marker(eog, token_to_id, types)
    return eog


def _drop_harmony_end(eog: set[int], token_to_id: TokenIndex, types: array) -> None:
    """o200k_harmony (<|return|>, <|call|>) and solar-open (<|calls|>, <|flush|>): <|end|> does
    not end generation."""
    present = {t for t in ("<|return|>", "<|call|>", "<|calls|>", "<|flush|>", "<|end|>")
               if token_to_id.get(t) in eog}
    has_call = bool(present & {"<|call|>", "<|calls|>"})
    if "<|end|>" in present and has_call and ({"<|return|>", "<|flush|>"} & present):
        end = token_to_id["<|end|>"]
        eog.discard(end)
        types[end] = TokenType.USER_DEFINED


def _keep_plain_s_marker(eog: set[int], token_to_id: TokenIndex, types: array) -> None:
    """Gemma 4 and PLaMo (<|tool_response>, <|plamo:eos|>) have a plain </s>: not EOG, NORMAL."""
    s_id = token_to_id.get("</s>")
    markers = (token_to_id.get(t) for t in ("<|tool_response>", "<|plamo:eos|>"))
    if s_id in eog and any(m is not None and m in eog for m in markers):
        eog.discard(s_id)
        types[s_id] = TokenType.NORMAL
