"""Byte-level BPE (`tokenizer.ggml.model = gpt2`), as llama.cpp's llm_tokenizer_bpe_session.

A word from the pre-tokenizer is turned into its UTF-8 bytes, each byte shown as one printable
character (GPT-2's byte-to-unicode table), then adjacent symbols are merged, always the pair
with the lowest merge rank first (leftmost on ties), until no ranked pair is left.
"""
from __future__ import annotations

import heapq

from .pre_types import pre_type
from .pretokenize import PreTokenizer
from .texts import TextIndex, TokenIndex
from .vocab import Vocab

_MAX_CACHE = 200_000  # words remembered with their ids


def _byte_to_char_table() -> list[str]:
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_TO_CHAR = _byte_to_char_table()
CHAR_TO_BYTE = {ch: b for b, ch in enumerate(BYTE_TO_CHAR)}
_LATIN1_TO_BYTE_CHARS = {b: ch for b, ch in enumerate(BYTE_TO_CHAR)}


def byte_encode(word: str) -> str:
    """`word`'s UTF-8 bytes written with GPT-2's byte characters."""
    return word.encode("utf-8", "surrogatepass").decode("latin-1").translate(_LATIN1_TO_BYTE_CHARS)


def byte_decode(token_text: str) -> bytes:
    """Inverse of byte_encode for a token's text; characters outside the table pass as UTF-8."""
    out = bytearray()
    for ch in token_text:
        byte = CHAR_TO_BYTE.get(ch)
        if byte is None:
            out += ch.encode("utf-8", "surrogatepass")
        else:
            out.append(byte)
    return bytes(out)


class BpeEncoder:
    """Encodes raw text (no special tokens) into token ids for a BPE vocabulary."""

    def __init__(self, vocab: Vocab):
        self.vocab = vocab
        self.pre = pre_type(vocab.pre)
        self.pre_tokenizer = PreTokenizer(list(self.pre.regexes))
        # "left right" -> rank; the first of a repeated merge counts (llama.cpp's bpe_ranks).
        # Symbols never hold a space (GPT-2's byte characters stand for it), so a pair's key
        # is its merge text, split at the first space after position 0 as llama.cpp does.
        self.ranks = TextIndex(vocab.merges, keep_first=True)
        self._word_cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str, output: list[int]) -> None:
        """Append the ids of `text` to `output`."""
        cache = self._word_cache
        for word in self.pre_tokenizer.split(text):
            ids = cache.get(word)
            if ids is None:
                ids = self._encode_word(byte_encode(word))
                if len(cache) < _MAX_CACHE:
                    cache[word] = ids
            output.extend(ids)

    def _encode_word(self, word: str) -> tuple[int, ...]:
        token_to_id = self.vocab.token_to_id
        if self.pre.ignore_merges and word in token_to_id:
            return (token_to_id[word],)
        ids: list[int] = []
        for symbol in self._merge(word):
            token_id = token_to_id.get(symbol)
            if token_id is not None:
                ids.append(token_id)
            else:
                ids.extend(_single_byte_fallback(symbol, token_to_id))
        return tuple(ids)

    def _merge(self, word: str) -> list[str]:
        """Apply merges to the characters of `word`, lowest rank first, leftmost on ties."""
        symbols = list(word)
        n = len(symbols)
        if n < 2:
            return symbols
        ranks = self.ranks
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap: list[tuple[int, int, int, str]] = []

        def queue_pair(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                rank = ranks.get(symbols[left] + " " + symbols[right])
                if rank is not None:
                    heapq.heappush(heap, (rank, left, right, symbols[left] + symbols[right]))

        for i in range(n - 1):
            queue_pair(i, i + 1)
        while heap:
            _, left, right, merged = heapq.heappop(heap)
            if not symbols[left] or not symbols[right] or symbols[left] + symbols[right] != merged:
                continue  # outdated: one side was merged since this pair was queued
            symbols[left], symbols[right] = merged, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prv[nxt[right]] = left
            queue_pair(prv[left], left)
            queue_pair(left, nxt[left])
        return [s for s in symbols if s]


def _single_byte_fallback(symbol: str, token_to_id: TokenIndex) -> list[int]:
    """llama.cpp's fallback for a merged symbol missing from the vocabulary: its UTF-8 bytes
    looked up one at a time (only ASCII bytes can match a token); the rest are dropped."""
    ids = []
    for byte in symbol.encode("utf-8", "surrogatepass"):
        token_id = token_to_id.get(chr(byte)) if byte < 128 else None
        if token_id is not None:
            ids.append(token_id)
    return ids
