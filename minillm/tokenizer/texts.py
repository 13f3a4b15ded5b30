"""A vocabulary's token texts without a Python object per token.

`VocabTexts` (id -> text) decodes a text from the file's bytes when asked; `TokenIndex`
(text -> id) is a hash table built by a Numba kernel over those bytes (`TextIndex`, also behind
BPE merge ranks). Together they hold a 262,144-token vocabulary in ~10 MiB, where a list of str
plus a dict took ~44 MiB and ~0.1 s of every start.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from zlib import crc32

import numpy as np

from ..gguf_file import StringArray

_EMPTY = re.compile(r"\[EMPTY_(\d+)\]")


class VocabTexts(Sequence):
    """id -> token text as stored in the file. llama.cpp renames an empty text "[EMPTY_<id>]"
    so that every text maps back to one id; so does this."""

    def __init__(self, strings: StringArray):
        self.strings = strings

    def __len__(self) -> int:
        return len(self.strings)

    def __getitem__(self, token_id):
        if isinstance(token_id, slice):
            return [self[i] for i in range(*token_id.indices(len(self)))]
        text = self.strings[token_id]
        return text if text else f"[EMPTY_{token_id % len(self)}]"

    def chars_before(self, mark: str) -> set[str]:
        """Characters that come right before `mark` inside some token (and possibly a few that
        do not: the buffer is searched as a whole, length fields included)."""
        data = np.frombuffer(self.strings.buffers()[0], np.uint8)
        needle = np.frombuffer(mark.encode("utf-8"), np.uint8)
        n = len(data) - len(needle) + 1
        found = np.ones(max(n, 0), bool)
        for k, byte in enumerate(needle):
            found &= data[k:k + n] == byte
        positions = np.flatnonzero(found)
        # the 4 bytes before each occurrence (UTF-8's longest character), as one uint32
        padded = np.concatenate([np.zeros(4, np.uint8), data])
        windows = np.zeros(len(positions), np.uint32)
        for k in range(4):
            windows = (windows << 8) | padded[positions + k]
        chars = set()
        for window in np.unique(windows).tolist():
            text = window.to_bytes(4, "big").decode("utf-8", "surrogateescape")
            chars.add(text[-1])
        return chars


class TextIndex:
    """string -> index over a StringArray (a vocabulary's texts, a BPE model's merges)."""

    def __init__(self, strings: StringArray, keep_first: bool = False):
        """A string that occurs twice maps to its first index if keep_first, else its last."""
        from ..kernels.cpu.text import CRC32_TABLE, build_text_index

        data, starts, ends = strings.buffers()
        table_bits = max(4, (2 * len(strings) - 1).bit_length())  # at most half full
        ids, hashes = build_text_index(np.frombuffer(data, np.uint8), starts, ends,
                                       table_bits, keep_first, CRC32_TABLE)
        self._mask = (1 << table_bits) - 1
        # memoryviews: indexing one gives a Python int ~3x faster than indexing the ndarray
        self._slot_ids, self._slot_hashes = memoryview(ids), memoryview(hashes)
        self._data, self._starts, self._ends = data, memoryview(starts), memoryview(ends)

    def get(self, text: str, default=None):
        try:
            key = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a lone surrogate no string can hold
            return default
        h = crc32(key)
        mask, slot_ids, slot_hashes = self._mask, self._slot_ids, self._slot_hashes
        slot = h & mask
        while True:
            index = slot_ids[slot]
            if index < 0:
                return self._missing(text, default)
            if slot_hashes[slot] == h and self._data[self._starts[index]:self._ends[index]] == key:
                return index
            slot = (slot + 1) & mask

    def _missing(self, text: str, default):
        return default

    def __contains__(self, text: str) -> bool:
        return self.get(text) is not None

    def __getitem__(self, text: str) -> int:
        index = self.get(text)
        if index is None:
            raise KeyError(text)
        return index


class TokenIndex(TextIndex):
    """token text -> id over VocabTexts, "[EMPTY_<id>]" included; a repeated text maps to its
    last id (llama.cpp's token_to_id)."""

    def __init__(self, texts: VocabTexts):
        super().__init__(texts.strings)
        self._strings = texts.strings
        self._has_empty = bool(np.any(np.equal(*texts.strings.buffers()[1:])))

    def _missing(self, text: str, default):
        match = _EMPTY.fullmatch(text) if self._has_empty else None
        if match and int(match[1]) < len(self._strings) and not self._strings[int(match[1])]:
            return int(match[1])
        return default
