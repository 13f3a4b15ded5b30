"""The Tokenizer: text <-> token ids, matching llama.cpp's llama_tokenize / token_to_piece.

Tokenizing (llama.cpp `llama_vocab::impl::tokenize`):
1. Special-token partition: the text is cut at occurrences of special tokens, longest token
   first, each token's occurrences found left to right. USER_DEFINED tokens are always cut
   out; CONTROL and UNKNOWN tokens only when `special=True`.
2. The remaining text pieces go to the model's encoder (BPE or SPM). SPM adds a leading space
   to a piece that starts the text or follows a special token, when add_space_prefix is set.
3. BOS in front (model default `tokenizer.ggml.add_bos_token`); EOS at the end only when the
   model asks for it (`tokenizer.ggml.add_eos_token`) and the caller left add_bos/add_eos unset.

Detokenizing joins the bytes of each token's piece: BPE pieces through GPT-2's byte table,
SPM pieces with "▁" as space and `<0xNN>` as one byte; USER_DEFINED tokens as their text;
CONTROL and UNKNOWN tokens as nothing unless render_special. With add_space_prefix, the space
the tokenizer added in front of the first piece is removed again (after a leading BOS too,
unlike llama.cpp, so that detokenize(tokenize(text)) gives back text). llama.cpp's optional
"clean_spaces" post-processing is not applied. Invalid UTF-8 becomes U+FFFD.
"""
from __future__ import annotations

import codecs
import operator
import re
from typing import Iterable

import numpy as np

from ..errors import MinillmError
from .bpe import BpeEncoder, byte_decode
from .spm import SPACE_MARK, SpmEncoder
from .vocab import TokenType, Vocab, load_vocab

_SPECIAL_TYPES = frozenset((TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN))
_SILENT_TYPES = frozenset((TokenType.CONTROL, TokenType.UNKNOWN))
_SURROGATES = re.compile("[\ud800-\udfff]")


class SpecialTokenSplitter:
    """Cuts text at special tokens the way llama.cpp's tokenizer_st_partition does."""

    _BIG_GROUP = 64          # tokens sharing a first character; looked up through windows
    _MAX_WINDOWS = 20_000    # occurrences of that character beyond which plain search is used

    def __init__(self, vocab: Vocab):
        texts = vocab.texts
        types = np.frombuffer(vocab.types, np.int32)
        ids = np.flatnonzero(np.isin(types, list(_SPECIAL_TYPES))).tolist()
        ids.sort(key=lambda i: -len(texts[i].encode("utf-8", "surrogateescape")))  # stable
        self._all = [(texts[i], i) for i in ids]
        self._always = [(texts[i], i) for i in ids if vocab.types[i] == TokenType.USER_DEFINED]
        lengths_by_first: dict[str, list[int]] = {}
        for text, _ in self._all:
            lengths_by_first.setdefault(text[0], []).append(len(text))
        self._big_groups = {first: sorted(set(lengths))
                            for first, lengths in lengths_by_first.items()
                            if len(lengths) >= self._BIG_GROUP}

    def split(self, text: str, parse_special: bool) -> list[str | int]:
        """Text pieces (str) and special token ids (int), in order."""
        fragments: list[str | int] = [text] if text else []
        candidates = self._all if parse_special else self._always
        for token_text, token_id in self._present(text, candidates):
            fragments = _cut_at(fragments, token_text, token_id)
        return fragments

    def _present(self, text: str, specials: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """The special tokens that occur in `text`, in processing order."""
        present_chars = set(text)
        windows: dict[str, set[str] | None] = {}
        found = []
        for token_text, token_id in specials:
            first = token_text[0]
            if first not in present_chars:
                continue
            if first in self._big_groups and first not in windows:
                windows[first] = self._window_prefixes(text, first)
            prefixes = windows.get(first)
            occurs = token_text in prefixes if prefixes is not None else token_text in text
            if occurs:
                found.append((token_text, token_id))
        return found

    def _window_prefixes(self, text: str, first: str) -> set[str] | None:
        """Every substring of text that starts with `first` and has the length of a token of
        that group: token in the set <=> token in text. None when `first` is too frequent."""
        if text.count(first) > self._MAX_WINDOWS:
            return None
        lengths = self._big_groups[first]
        prefixes = set()
        pos = text.find(first)
        while pos >= 0:
            prefixes.update(text[pos:pos + n] for n in lengths)
            pos = text.find(first, pos + 1)
        return prefixes


def _cut_at(fragments: list[str | int], token_text: str, token_id: int) -> list[str | int]:
    result: list[str | int] = []
    for fragment in fragments:
        if isinstance(fragment, int) or token_text not in fragment:
            result.append(fragment)
            continue
        for k, part in enumerate(fragment.split(token_text)):
            if k:
                result.append(token_id)
            if part:
                result.append(part)
    return result


class Tokenizer:
    """A GGUF model's tokenizer. Build it with Tokenizer.from_gguf(GGUFFile(path))."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._is_spm = vocab.model == "llama"
        self._encoder = SpmEncoder(vocab) if self._is_spm else BpeEncoder(vocab)
        self._splitter = SpecialTokenSplitter(vocab)
        self._pieces: dict[int, bytes] = {}  # id -> token_piece, filled as ids are seen

    @classmethod
    def from_gguf(cls, gguf) -> "Tokenizer":
        """Build from an open GGUFFile (only its metadata is read)."""
        return cls(load_vocab(gguf.metadata))

    # --- facts about the vocabulary ---------------------------------------------------------
    @property
    def n_vocab(self) -> int:
        return self.vocab.n_vocab

    @property
    def bos_id(self) -> int | None:
        return self.vocab.special_ids["bos"]

    @property
    def eos_id(self) -> int | None:
        return self.vocab.special_ids["eos"]

    @property
    def eot_id(self) -> int | None:
        return self.vocab.special_ids["eot"]

    @property
    def pad_id(self) -> int | None:
        return self.vocab.special_ids["pad"]

    @property
    def eog_ids(self) -> set[int]:
        """Ids that end generation (EOS, EOT and llama.cpp's by-text list)."""
        return set(self.vocab.eog_ids)

    @property
    def add_bos(self) -> bool:
        """Whether tokenize() adds BOS by default."""
        return self.vocab.add_bos

    @property
    def chat_template(self) -> str | None:
        return self.vocab.chat_template

    def is_eog(self, token_id: int) -> bool:
        return token_id in self.vocab.eog_ids

    def token_text(self, token_id: int) -> str:
        """The token's text exactly as stored in the vocabulary."""
        return self.vocab.texts[self._check_id(token_id)]

    def token_type(self, token_id: int) -> TokenType:
        return TokenType(self.vocab.types[self._check_id(token_id)])

    # --- text -> ids ------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool | None = None, special: bool = False,
                 add_eos: bool | None = None) -> list[int]:
        """Token ids of `text`.

        add_bos: None = the model's default. special: parse special-token text (e.g.
        "<|im_start|>") as those tokens; otherwise it is plain text. add_eos: None = the
        model's default when add_bos is also None, else no EOS.
        """
        if not isinstance(text, str):
            raise TypeError(f"tokenize() needs a str, not {type(text).__name__}")
        text = _SURROGATES.sub("\ufffd", text)
        use_defaults = add_bos is None
        add_bos = self.vocab.add_bos if add_bos is None else add_bos
        add_eos = (self.vocab.add_eos and use_defaults) if add_eos is None else add_eos
        output: list[int] = []
        if add_bos:
            output.append(self._required_id("bos"))
        self._encode_fragments(self._splitter.split(text, special), output)
        if add_eos:
            output.append(self._required_id("eos"))
        return output

    def _encode_fragments(self, fragments: list[str | int], output: list[int]) -> None:
        # SPM with add_space_prefix: a space goes in front of text that starts the input or
        # follows a special token (llama.cpp's is_prev_special).
        space_prefix = self._is_spm and self.vocab.add_space_prefix
        after_special = True
        for fragment in fragments:
            if isinstance(fragment, int):
                output.append(fragment)
                after_special = True
            else:
                self._encoder.encode(" " + fragment if space_prefix and after_special else fragment,
                                     output)
                after_special = False

    def _required_id(self, name: str) -> int:
        token_id = self.vocab.special_ids.get(name)
        if token_id is None:
            raise MinillmError(f"the model has no {name.upper()} token")
        return token_id

    # --- ids -> text ------------------------------------------------------------------------
    def token_piece(self, token_id: int, render_special: bool = False) -> bytes:
        """The bytes token_id contributes to detokenized text (llama.cpp token_to_piece)."""
        token_id = self._check_id(token_id)
        if self.vocab.types[token_id] in _SILENT_TYPES:
            return self.vocab.texts[token_id].encode("utf-8", "surrogateescape") if render_special else b""
        piece = self._pieces.get(token_id)
        if piece is None:
            piece = self._pieces[token_id] = self._make_piece(token_id)
        return piece

    def _make_piece(self, token_id: int) -> bytes:
        text = self.vocab.texts[token_id]
        token_type = self.vocab.types[token_id]
        if token_type == TokenType.USER_DEFINED:
            return text.encode("utf-8", "surrogateescape")
        if token_type == TokenType.NORMAL:
            if self._is_spm:
                return text.replace(SPACE_MARK, " ").encode("utf-8", "surrogateescape")
            return byte_decode(text)
        if token_type == TokenType.BYTE and self._is_spm:
            return _byte_token_value(text)
        return b""  # UNUSED, UNDEFINED: rendered as nothing, as in llama.cpp

    def detokenize(self, ids: Iterable[int], render_special: bool = False) -> str:
        """The text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""
        decoder = StreamDecoder(self, render_special)
        return "".join(decoder.feed(i) for i in ids) + decoder.flush()

    def stream_decoder(self, render_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, render_special)

    def _check_id(self, token_id) -> int:
        try:
            index = operator.index(token_id)  # ints and NumPy integers, not floats or strings
        except TypeError:
            raise MinillmError(f"token id {token_id!r} is not an integer") from None
        if not 0 <= index < self.vocab.n_vocab:
            raise MinillmError(f"token id {token_id!r} is outside the vocabulary "
                               f"(0..{self.vocab.n_vocab - 1})")
        return index


def _byte_token_value(text: str) -> bytes:
    """`<0xNN>` -> bytes([0xNN])."""
    try:
        return bytes([int(text[3:5], 16)])
    except ValueError:
        return b""


class StreamDecoder:
    """Turns token ids into text one at a time, for streaming output.

    feed() returns only complete characters: bytes of a character split across tokens wait
    for the rest. Invalid sequences become U+FFFD. flush() returns what is left at the end.
    """

    def __init__(self, tokenizer: Tokenizer, render_special: bool = False):
        self._tokenizer = tokenizer
        self._render_special = render_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._strip_space = tokenizer.vocab.add_space_prefix

    def feed(self, token_id: int) -> str:
        """Text completed by this token (possibly empty)."""
        piece = self._tokenizer.token_piece(token_id, self._render_special)
        if self._strip_space and token_id != self._tokenizer.bos_id:
            self._strip_space = False
            if piece.startswith(b" "):
                piece = piece[1:]
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever is still buffered (an incomplete character becomes U+FFFD)."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
