"""Kernels over many short strings kept as one byte buffer (a GGUF vocabulary): the scan that
finds each string of a GGUF string array, and the hash table behind the tokenizer's
text -> id lookups. A Python loop over a 262,144-token vocabulary took ~0.2 s of a cold start
and ~40 MiB of Python objects; these take a few milliseconds and a few MiB.

The hash is CRC-32 exactly as zlib computes it, so Python looks a key up with zlib.crc32.
"""
import numba as nb
import numpy as np

_SER = dict(cache=True, nogil=True)


def _crc32_table() -> np.ndarray:
    """zlib's CRC-32 table (reflected polynomial 0xEDB88320), int64[256]."""
    table = np.arange(256, dtype=np.int64)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ 0xEDB88320, table >> 1)
    return table


CRC32_TABLE = _crc32_table()


@nb.njit(**_SER)
def scan_string_array(buf, pos, count):
    """Starts and ends (int64[count]) of `count` GGUF strings (u64 little-endian length, then the
    bytes) from buf[pos]; failed is the index of the first string that runs past the buffer's
    end (-1: none), and the arrays hold only the strings before it."""
    starts = np.empty(count, np.int64)
    ends = np.empty(count, np.int64)
    size = buf.shape[0]
    for i in range(count):
        if pos + 8 > size:
            return starts, ends, i
        n = np.uint64(0)
        for k in range(7, -1, -1):
            n = (n << np.uint64(8)) | np.uint64(buf[pos + k])
        pos += 8
        if n > np.uint64(size - pos):
            return starts, ends, i
        starts[i] = pos
        pos += np.int64(n)
        ends[i] = pos
    return starts, ends, -1


@nb.njit(inline="always", **_SER)
def crc32(data, start, end, table):
    """zlib.crc32(data[start:end]) for a uint8 array."""
    crc = np.int64(0xFFFFFFFF)
    for i in range(start, end):
        crc = table[(crc ^ np.int64(data[i])) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@nb.njit(inline="always", **_SER)
def _same_bytes(data, a0, a1, b0, b1):
    if a1 - a0 != b1 - b0:
        return False
    for k in range(a1 - a0):
        if data[a0 + k] != data[b0 + k]:
            return False
    return True


@nb.njit(**_SER)
def build_text_index(data, starts, ends, table_bits, keep_first, crc_table):
    """An open-addressing table (linear probing) of the strings data[starts[i]:ends[i]]:
    slot_ids int32[2**table_bits] (-1: empty) and slot_hashes uint32[2**table_bits], each string
    at slot crc32 & mask or the first free one after it. Empty strings are left out; a string
    that occurs twice keeps its first id if keep_first, else its last."""
    size = 1 << table_bits
    mask = size - 1
    slot_ids = np.full(size, -1, np.int32)
    slot_hashes = np.zeros(size, np.uint32)
    for i in range(starts.shape[0]):
        a, b = starts[i], ends[i]
        if a == b:
            continue
        h = crc32(data, a, b, crc_table)
        slot = h & mask
        while True:
            j = slot_ids[slot]
            if j < 0:
                slot_hashes[slot] = h
                slot_ids[slot] = i
                break
            if slot_hashes[slot] == h and _same_bytes(data, starts[j], ends[j], a, b):
                if not keep_first:
                    slot_ids[slot] = i
                break
            slot = (slot + 1) & mask
    return slot_ids, slot_hashes
