"""A vocabulary's token texts without a Python object per token.

`VocabTexts` (id -> text) decodes a text from the file's bytes when asked; `TextIndex`
(text -> id) is a hash table built by a Numba kernel over those bytes. Together they hold a
262,144-token vocabulary in ~10 MiB, where a list of str plus a dict took ~44 MiB and
~0.1 s of every start.
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
    """text -> token id over VocabTexts; a text that occurs twice maps to its last id."""

    def __init__(self, texts: VocabTexts):
        from ..kernels.cpu.text import CRC32_TABLE, build_text_index

        self._texts = texts
        data, starts, ends = texts.strings.buffers()
        table_bits = max(4, (2 * len(texts) - 1).bit_length())  # at most half full
        ids, hashes = build_text_index(np.frombuffer(data, np.uint8), starts, ends,
                                       table_bits, CRC32_TABLE)
        self._mask = (1 << table_bits) - 1
        # memoryviews: indexing one gives a Python int ~3x faster than indexing the ndarray
        self._slot_ids, self._slot_hashes = memoryview(ids), memoryview(hashes)
        self._data, self._starts, self._ends = data, memoryview(starts), memoryview(ends)
        self._has_empty = bool(np.any(starts == ends))

    def get(self, text: str, default=None):
        try:
            key = text.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a lone surrogate no token can hold
            return default
        h = crc32(key)
        mask, slot_ids, slot_hashes = self._mask, self._slot_ids, self._slot_hashes
        slot = h & mask
        while True:
            token_id = slot_ids[slot]
            if token_id < 0:
                return self._renamed_empty(text, default) if self._has_empty else default
            if slot_hashes[slot] == h and self._data[self._starts[token_id]:self._ends[token_id]] == key:
                return token_id
            slot = (slot + 1) & mask

    def _renamed_empty(self, text: str, default):
        match = _EMPTY.fullmatch(text)
        if match and int(match[1]) < len(self._texts) and not self._texts.strings[int(match[1])]:
            return int(match[1])
        return default

    def __contains__(self, text: str) -> bool:
        return self.get(text) is not None

    def __getitem__(self, text: str) -> int:
        token_id = self.get(text)
        if token_id is None:
            raise KeyError(text)
        return token_id
