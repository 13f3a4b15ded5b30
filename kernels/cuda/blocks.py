"""GGUF's quantized blocks read in place on the device: weights' integer codes, 4 at a time
(codes4), and their group's scale and bias (group_scale), decoded in registers by the products
(kernels/cuda/matmul.py).

A quantized matrix is uploaded as the file stores it, one row of blocks a row:
    raw    uint8   (N, row_bytes)     the blocks
    raw_h  float16 (N, row_bytes / 2) the same memory as float16 (every block size is even and
                                      every f16 field of a block sits at an even offset)
    raw_w  uint16  (N, row_bytes / 2) the same memory as 16-bit words: 4 code bytes at an even
                                      offset are two loads (codes4)
so the device holds exactly the file's bytes, and a token's products read each weight's bits
once. The values are those of minillm.kernels.cpu.unpack (the uniform layout of
minillm.formats): code * scale(g) + bias(g) is ggml's dequantized weight of group g, the scale
and bias computed with the same float32 operations.

Formats are numbered (FORMAT_IDS); the kernels take the number as an argument and branch on it
(the same branch for every thread of a launch).
"""
from __future__ import annotations

import numpy as np

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
def _word(raw_w, n, offset):
    """The 4 bytes at even byte `offset` of row n, as an unsigned 32-bit value (two 16-bit loads)."""
    i = offset // 2
    return np.int64(raw_w[n, i]) | (np.int64(raw_w[n, i + 1]) << 16)


@device
def _signed(word):
    """An unsigned 32-bit value as the int32 of the same bits."""
    return np.int32(word - ((word >> 31) << 32))


@device
def _offset_codes(x, bits):
    """4 bytes of unsigned codes x of `bits` bits as the signed bytes x - 2^(bits - 1) (Q4_0's
    minus 8, Q3_K's minus 4, ...): the top bit flipped makes a two's complement of `bits` bits,
    then extended over the byte."""
    sign = 0x01010101 << (bits - 1)
    flipped = x ^ sign
    return _signed(flipped | (((flipped & sign) >> (bits - 1)) * (256 - (1 << (bits - 1)))))


@device
def codes4(raw_w, n, fmt, k):
    """Codes k..k+3 of row n (k a multiple of 4) as one int32 word of signed bytes, the lowest k
    in the lowest byte: the codes of ggml's blocks (minillm.formats), as minillm.kernels.cpu.unpack
    reads them. In every format 4 consecutive codes keep their bits in 4 consecutive bytes at an
    even offset (or two such runs: low and high bits; Q5_0 and Q5_1 their fifth bits in one
    32-bit word): a 32-bit read each, the bits taken bytewise."""
    if fmt == Q4_0 or fmt == Q4_1 or fmt == Q5_0 or fmt == Q5_1:
        # blocks of 32: an f16 scale (and an f16 min: Q4_1, Q5_1), Q5's 32-bit word of fifth bits
        # (bit l: weight l), then 16 bytes of nibbles, weights l and l + 16 in byte l
        b, l = k // 32, k % 32
        o = b * (18 + 2 * fmt) + 2 * (fmt % 2)  # the block (18, 20, 22, 24 bytes), past its min
        low = (_word(raw_w, n, o + (2 if fmt <= Q4_1 else 6) + l % 16) >> (4 * (l // 16))) & 0x0F0F0F0F
        if fmt == Q4_1:
            return np.int32(low)
        if fmt == Q4_0:
            return _offset_codes(low, 4)
        fifth = (_word(raw_w, n, o + 2) >> l) & 15
        codes = low | (((fifth * 0x00204081) & 0x01010101) << 4)  # bit i to bit 8 i
        return np.int32(codes) if fmt == Q5_1 else _offset_codes(codes, 5)
    if fmt == Q8_0:  # 32 signed bytes after the scale
        return _signed(_word(raw_w, n, (k // 32) * 34 + 2 + k % 32))
    e = k % 256  # the K-quants: super-blocks of 256 weights
    if fmt == Q4_K or fmt == Q5_K:
        # 64-weight chunks c of 32 bytes, low nibbles first; Q5_K's fifth bits one a byte from
        # 32 bytes at 16 (bit 2c for the chunk's low nibbles, 2c + 1 for its high)
        c, w = e // 64, e % 64
        o = (k // 256) * (144 if fmt == Q4_K else 176)
        low = (_word(raw_w, n, o + (16 if fmt == Q4_K else 48) + c * 32 + w % 32) >> (4 * (w // 32))) & 0x0F0F0F0F
        if fmt == Q4_K:
            return np.int32(low)
        return np.int32(low | (((_word(raw_w, n, o + 16 + w % 32) >> (2 * c + w // 32)) & 0x01010101) << 4))
    h = e // 128  # Q2_K, Q3_K, Q6_K: two halves of 128 weights
    if fmt == Q6_K:
        # 4 low bits: weight l of quarter q of half h in byte h 64 + (q % 2) 32 + l, nibble q // 2;
        # 2 high bits in byte 128 + h 32 + l, at bit 2 q; minus 32
        o, quarter, l = (k // 256) * 210, (e % 128) // 32, e % 32
        low = (_word(raw_w, n, o + h * 64 + (quarter % 2) * 32 + l) >> (4 * (quarter // 2))) & 0x0F0F0F0F
        high = (_word(raw_w, n, o + 128 + h * 32 + l) >> (2 * quarter)) & 0x03030303
        return _offset_codes(low | (high << 4), 6)
    # Q2_K, Q3_K: 2 bits, weight l of 16-weight part s of quarter j of half h in byte h 32 + s 16 + l at
    # bit 2 j (after 16 bytes of scales; Q3_K's after 32 bytes of high bits); Q3_K's third bit in
    # byte s 16 + l at bit 4 h + j, and its codes minus 4
    j, s, l = (e % 128) // 32, (e % 32) // 16, e % 16
    if fmt == Q2_K:
        return np.int32((_word(raw_w, n, (k // 256) * 84 + 16 + h * 32 + s * 16 + l) >> (2 * j)) & 0x03030303)
    o = (k // 256) * 110
    low = (_word(raw_w, n, o + 32 + h * 32 + s * 16 + l) >> (2 * j)) & 0x03030303
    third = (_word(raw_w, n, o + s * 16 + l) >> (4 * h + j)) & 0x01010101
    return _offset_codes(low | (third << 2), 3)


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
