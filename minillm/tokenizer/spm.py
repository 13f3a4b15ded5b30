"""SentencePiece-style tokenizer (`tokenizer.ggml.model = llama`), as llama.cpp's llm_tokenizer_spm.

Spaces become U+2581 ("▁"). Starting from single characters, the adjacent pair whose
concatenation is the vocabulary token with the highest score is merged first (leftmost on
ties), until no pair forms a token. Characters left that are no token are written as byte
tokens `<0xNN>` (byte fallback).

Speed: no merge can cross a point where the two characters on either side never occur next to
each other inside any token. Text is cut at such points before each "▁" and the pieces are
encoded independently (and cached), which gives the same ids as encoding the whole text.
"""
from __future__ import annotations

import heapq
import re

from ..errors import MinillmError
from .vocab import Vocab

SPACE_MARK = "\u2581"
_MAX_CACHE = 200_000


class SpmEncoder:
    """Encodes raw text (no special tokens) into token ids for a SentencePiece vocabulary."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self._piece_cache: dict[str, tuple[int, ...]] = {}
        self._byte_ids: dict[int, int] = {}
        self._cut_pattern: re.Pattern | None = None

    def encode(self, text: str, output: list[int]) -> None:
        """Append the ids of `text` to `output`."""
        text = text.replace(" ", SPACE_MARK)
        cache = self._piece_cache
        for piece in self._independent_pieces(text):
            ids = cache.get(piece)
            if ids is None:
                ids = self._encode_piece(piece)
                if len(cache) < _MAX_CACHE:
                    cache[piece] = ids
            output.extend(ids)

    def _independent_pieces(self, text: str) -> list[str]:
        if self._cut_pattern is None:
            self._cut_pattern = self._build_cut_pattern()
        return [p for p in self._cut_pattern.split(text) if p]

    def _build_cut_pattern(self) -> re.Pattern:
        """A zero-width pattern matching before each "▁" that no token joins to its left."""
        before_mark = self.vocab.texts.chars_before(SPACE_MARK) | {"\x00"}  # never an empty class
        excluded = "".join(re.escape(ch) for ch in sorted(before_mark))
        return re.compile(f"(?<=[^{excluded}])(?={SPACE_MARK})")

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        ids: list[int] = []
        token_to_id = self.vocab.token_to_id
        for symbol in self._merge(piece):
            token_id = token_to_id.get(symbol)
            if token_id is not None:
                ids.append(token_id)
            else:
                ids.extend(self._byte_id(b) for b in symbol.encode("utf-8", "surrogatepass"))
        return tuple(ids)

    def _merge(self, text: str) -> list[str]:
        """Merge adjacent symbols, best-scoring resulting token first, leftmost on ties."""
        symbols = list(text)
        n = len(symbols)
        if n < 2:
            return symbols
        token_to_id = self.vocab.token_to_id
        scores = self.vocab.scores
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[float, int, int, int]] = []

        def queue_pair(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                token_id = token_to_id.get(symbols[left] + symbols[right])
                if token_id is not None:
                    size = len(symbols[left]) + len(symbols[right])
                    heapq.heappush(heap, (-scores[token_id], left, right, size))

        for i in range(n - 1):
            queue_pair(i, i + 1)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            left_text, right_text = symbols[left], symbols[right]
            if not left_text or not right_text or len(left_text) + len(right_text) != size:
                continue  # outdated: one side changed since this pair was queued
            symbols[left], symbols[right] = left_text + right_text, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            queue_pair(prv[left], left)
            queue_pair(left, nxt[left])
        return [s for s in symbols if s]

    def _byte_id(self, byte: int) -> int:
        """The token for one byte: `<0xNN>`, else the byte as a one-character token."""
        token_id = self._byte_ids.get(byte)
        if token_id is None:
            token_to_id = self.vocab.token_to_id
            token_id = token_to_id.get(f"<0x{byte:02X}>")
            if token_id is None and byte < 128:
                token_id = token_to_id.get(chr(byte))
            if token_id is None:
                token_id = self.vocab.special_ids.get("unk")
            if token_id is None:
                raise MinillmError(f"the vocabulary has no token for byte 0x{byte:02X} "
                                   "and no unknown token")
            self._byte_ids[byte] = token_id
        return token_id
