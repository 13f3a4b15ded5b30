"""GGUF's quantized blocks read in place on the device: a weight's integer code and its group's
scale and bias, decoded in registers by the products (kernels/cuda/matmul.py).

A quantized matrix is uploaded as the file stores it, one row of blocks a row:
    raw    uint8   (N, row_bytes)     the blocks
    raw_h  float16 (N, row_bytes / 2) the same memory as float16 (every block size is even and
                                      every f16 field of a block sits at an even offset)
    raw_w  uint16  (N, row_bytes / 2) the same memory as 16-bit words: 4 code bytes at an even
                                      offset are two loads (codes4)
so the device holds exactly the file's bytes, and a token's products read each weight's bits
once. The values are those of minillm.kernels.cpu.unpack (the uniform layout of
minillm.formats): code(e) * scale(g) + bias(g) is ggml's dequantized weight e of group g, the
scale and bias computed with the same float32 operations.

Formats are numbered (FORMAT_IDS); the kernels take the number as an argument and branch on it
(the same branch for every thread of a launch).
"""
from __future__ import annotations

import numpy as np

from .device import pack4
from .registry import device

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = range(10)
FORMAT_IDS = {"Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q8_0": Q8_0, "Q2_K": Q2_K,
              "Q3_K": Q3_K, "Q4_K": Q4_K, "Q5_K": Q5_K, "Q6_K": Q6_K}


@device
def _byte(raw, n, i):
    return np.int32(raw[n, i])


@device
def _f16(raw_h, n, offset):
    """The float16 field at byte `offset` of row n, as float32 (exact)."""
    return np.float32(raw_h[n, offset // 2])


@device
def _code_32(raw, n, fmt, e):
    """Code of weight e of a row in a format of 32-value blocks."""
    b = e // 32
    l = e % 32
    if fmt == Q4_0:
        return ((_byte(raw, n, b * 18 + 2 + l % 16) >> (4 * (l // 16))) & 15) - 8
    if fmt == Q4_1:
        return (_byte(raw, n, b * 20 + 4 + l % 16) >> (4 * (l // 16))) & 15
    if fmt == Q8_0:
        v = _byte(raw, n, b * 34 + 2 + l)
        return v - 256 * (v >> 7)
    # Q5_0, Q5_1: a 32-bit word of fifth bits (bit l: weight l), then the nibbles
    o = b * 22 if fmt == Q5_0 else b * 24 + 2
    high = (_byte(raw, n, o + 2 + l // 8) >> (l % 8)) & 1
    low = (_byte(raw, n, o + 6 + l % 16) >> (4 * (l // 16))) & 15
    return (low | (high << 4)) - (16 if fmt == Q5_0 else 0)


@device
def _code_k(raw, n, fmt, e):
    """Code of weight e of a row in a K-quant (256-value super-blocks)."""
    b = e // 256
    E = e % 256
    h = E // 128
    rem = E % 128
    if fmt == Q2_K or fmt == Q3_K:
        j = rem // 32
        s = (rem % 32) // 16
        l = rem % 16
        if fmt == Q2_K:
            return (_byte(raw, n, b * 84 + 16 + h * 32 + s * 16 + l) >> (2 * j)) & 3
        o = b * 110
        v = (_byte(raw, n, o + 32 + h * 32 + s * 16 + l) >> (2 * j)) & 3
        hbit = (_byte(raw, n, o + s * 16 + l) >> (h * 4 + j)) & 1
        return v - 4 * (1 - hbit)
    if fmt == Q6_K:
        o = b * 210
        quarter = rem // 32
        l = rem % 32
        low = (_byte(raw, n, o + h * 64 + (quarter % 2) * 32 + l) >> (4 * (quarter // 2))) & 15
        high = (_byte(raw, n, o + 128 + h * 32 + l) >> (2 * quarter)) & 3
        return (low | (high << 4)) - 32
    # Q4_K, Q5_K: 64-value chunks c of 32 bytes, low nibbles first
    c = E // 64
    w = E % 64
    l = w % 32
    if fmt == Q4_K:
        return (_byte(raw, n, b * 144 + 16 + c * 32 + l) >> (4 * (w // 32))) & 15
    o = b * 176
    low = (_byte(raw, n, o + 48 + c * 32 + l) >> (4 * (w // 32))) & 15
    return low + 16 * ((_byte(raw, n, o + 16 + l) >> (2 * c + w // 32)) & 1)


@device
def code(raw, n, fmt, e):
    """The signed integer code of weight e of row n."""
    if fmt <= Q8_0:
        return _code_32(raw, n, fmt, e)
    return _code_k(raw, n, fmt, e)


@device
def _word(raw_w, n, offset):
    """The 4 bytes at even byte `offset` of row n, as an unsigned 32-bit value (two 16-bit loads)."""
    i = offset // 2
    return np.int64(raw_w[n, i]) | (np.int64(raw_w[n, i + 1]) << 16)


@device
def _signed(word):
    """An unsigned 32-bit value as the int32 of the same bits."""
    return np.int32(word - ((word >> 31) << 32))


@device
def codes4(raw, raw_w, n, fmt, k):
    """Codes k..k+3 of row n (k a multiple of 4) as one int32 word of signed bytes, the lowest k
    in the lowest byte. Every format but Q2_K and Q3_K keeps 4 consecutive codes' bits in 4
    consecutive bytes at an even offset (or two such runs: low and high bits; Q5_0 and Q5_1
    their fifth bits in one 32-bit word): a 32-bit read each, the bits taken bytewise (an
    offset code minus 8, 16 or 32 as a two's complement of 4, 5 or 6 bits: flip the top bit,
    then extend it over the byte). Q2_K and Q3_K take code() 4 times."""
    if fmt == Q4_0 or fmt == Q4_1 or fmt == Q4_K:
        if fmt == Q4_K:  # as _code_k: 64-value chunks of 32 bytes, low nibbles first
            b, e = k // 256, k % 256
            offset, shift = b * 144 + 16 + (e // 64) * 32 + e % 32, 4 * ((e % 64) // 32)
        else:  # as _code_32: 16 bytes, weights l and l + 16 in the low and high nibbles of byte l
            b, l = k // 32, k % 32
            offset = (b * 18 + 2 if fmt == Q4_0 else b * 20 + 4) + l % 16
            shift = 4 * (l // 16)
        nibbles = (_word(raw_w, n, offset) >> shift) & 0x0F0F0F0F
        if fmt != Q4_0:
            return np.int32(nibbles)
        flipped = nibbles ^ 0x08080808  # x - 8 in 4 bits; bit 3 its sign
        return _signed(flipped | (((flipped & 0x08080808) >> 3) * 0xF0))
    if fmt == Q8_0:
        return _signed(_word(raw_w, n, (k // 32) * 34 + 2 + k % 32))
    if fmt == Q5_0 or fmt == Q5_1:  # as _code_32: the fifth bits l..l+3 of a 32-bit word, spread to bit 4 of each byte
        b, l = k // 32, k % 32
        o = b * 22 if fmt == Q5_0 else b * 24 + 2
        low = (_word(raw_w, n, o + 6 + l % 16) >> (4 * (l // 16))) & 0x0F0F0F0F
        fifth = (_word(raw_w, n, o + 2) >> l) & 15
        codes = low | (((fifth * 0x00204081) & 0x01010101) << 4)  # bit i to bit 8 i
        if fmt == Q5_1:
            return np.int32(codes)
        flipped = codes ^ 0x10101010  # x - 16 in 5 bits; bit 4 its sign
        return _signed(flipped | (((flipped & 0x10101010) >> 4) * 0xE0))
    if fmt == Q5_K:  # as _code_k: the low nibbles as Q4_K's, a fifth bit a byte from 32 bytes at 16
        o, e = (k // 256) * 176, k % 256
        c, w = e // 64, e % 64
        low = (_word(raw_w, n, o + 48 + c * 32 + w % 32) >> (4 * (w // 32))) & 0x0F0F0F0F
        fifth = (_word(raw_w, n, o + 16 + w % 32) >> (2 * c + w // 32)) & 0x01010101
        return np.int32(low | (fifth << 4))
    if fmt == Q6_K:  # as _code_k: 4 low bits and 2 high bits, minus 32 as a 6-bit two's complement
        o, e = (k // 256) * 210, k % 256
        h, quarter, l = e // 128, (e % 128) // 32, e % 32
        low = (_word(raw_w, n, o + h * 64 + (quarter % 2) * 32 + l) >> (4 * (quarter // 2))) & 0x0F0F0F0F
        high = (_word(raw_w, n, o + 128 + h * 32 + l) >> (2 * quarter)) & 0x03030303
        flipped = (low | (high << 4)) ^ 0x20202020  # x - 32 in 6 bits; bit 5 its sign
        return _signed(flipped | (((flipped & 0x20202020) >> 5) * 0xC0))
    return np.int32(pack4(code(raw, n, fmt, k), code(raw, n, fmt, k + 1), code(raw, n, fmt, k + 2),
                          code(raw, n, fmt, k + 3)))


@device
def _scale_min_k4(raw, n, o, j):
    """Q4_K's / Q5_K's 6-bit scale and min number j (0..7) of the 12 bytes at raw[n, o:]."""
    if j < 4:
        return _byte(raw, n, o + j) & 63, _byte(raw, n, o + j + 4) & 63
    sc = (_byte(raw, n, o + j + 4) & 15) | ((_byte(raw, n, o + j - 4) >> 6) << 4)
    m = (_byte(raw, n, o + j + 4) >> 4) | ((_byte(raw, n, o + j) >> 6) << 4)
    return sc, m


@device
def group_scale(raw, raw_h, n, fmt, g):
    """(scale, bias) float32 of group g of row n (bias 0 for formats without one)."""
    zero = np.float32(0.0)
    if fmt == Q4_0:
        return _f16(raw_h, n, g * 18), zero
    if fmt == Q4_1:
        return _f16(raw_h, n, g * 20), _f16(raw_h, n, g * 20 + 2)
    if fmt == Q5_0:
        return _f16(raw_h, n, g * 22), zero
    if fmt == Q5_1:
        return _f16(raw_h, n, g * 24), _f16(raw_h, n, g * 24 + 2)
    if fmt == Q8_0:
        return _f16(raw_h, n, g * 34), zero
    if fmt == Q2_K:
        o = (g // 16) * 84
        sc = _byte(raw, n, o + g % 16)
        return (_f16(raw_h, n, o + 80) * np.float32(sc & 15),
                -(_f16(raw_h, n, o + 82) * np.float32(sc >> 4)))
    if fmt == Q3_K:
        o = (g // 16) * 110
        k = g % 16
        low = (_byte(raw, n, o + 96 + k % 4 + 4 * ((k // 4) % 2)) >> (4 * (k // 8))) & 15
        high = (_byte(raw, n, o + 104 + k % 4) >> (2 * (k // 4))) & 3
        return _f16(raw_h, n, o + 108) * np.float32((low | (high << 4)) - 32), zero
    if fmt == Q6_K:
        o = (g // 16) * 210
        v = _byte(raw, n, o + 192 + g % 16)
        return _f16(raw_h, n, o + 208) * np.float32(v - 256 * (v >> 7)), zero
    # Q4_K, Q5_K: d, dmin, then the 12 bytes of 6-bit scales and mins
    o = (g // 8) * (144 if fmt == Q4_K else 176)
    sc, m = _scale_min_k4(raw, n, o + 4, g % 8)
    return _f16(raw_h, n, o) * np.float32(sc), -(_f16(raw_h, n, o + 2) * np.float32(m))
