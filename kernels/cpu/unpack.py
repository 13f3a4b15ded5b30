"""Unpack GGUF quantized blocks into the uniform (q, scale, bias) layout of minillm.formats.

One kernel per format; each reads raw blocks (rows, row_bytes) uint8 and writes
    q     int8    (rows, K)
    scale float32 (rows, K // G)
    bias  float32 (rows, K // G) or (rows, 0)
such that scale * q + bias equals ggml's dequantized value bit for bit.
"""
import numba as nb
import numpy as np

# float16 bits -> float32, exact (Numba has no float16 scalars on the CPU)
F16_TO_F32 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)

_JIT = dict(parallel=True, cache=True, nogil=True)


@nb.njit(inline="always", cache=True)
def _f16(raw, i):
    return F16_TO_F32[np.int32(raw[i]) | (np.int32(raw[i + 1]) << 8)]


@nb.njit(**_JIT)
def unpack_q4_0(raw, q, scale, bias):
    rows, nb_ = raw.shape[0], raw.shape[1] // 18
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * 18
            scale[r, b] = _f16(raw[r], o)
            for j in range(16):
                v = raw[r, o + 2 + j]
                q[r, b * 32 + j] = np.int8((v & 15) - 8)
                q[r, b * 32 + j + 16] = np.int8((v >> 4) - 8)


@nb.njit(**_JIT)
def unpack_q4_1(raw, q, scale, bias):
    rows, nb_ = raw.shape[0], raw.shape[1] // 20
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * 20
            scale[r, b] = _f16(raw[r], o)
            bias[r, b] = _f16(raw[r], o + 2)
            for j in range(16):
                v = raw[r, o + 4 + j]
                q[r, b * 32 + j] = np.int8(v & 15)
                q[r, b * 32 + j + 16] = np.int8(v >> 4)


@nb.njit(inline="always", cache=True)
def _u32(raw, i):
    return (np.uint32(raw[i]) | (np.uint32(raw[i + 1]) << 8)
            | (np.uint32(raw[i + 2]) << 16) | (np.uint32(raw[i + 3]) << 24))


@nb.njit(inline="always", cache=True)
def _unpack_q5(raw, r, o_qh, o_qs, q, base, offset):
    qh = _u32(raw[r], o_qh)
    for j in range(16):
        v = raw[r, o_qs + j]
        h0 = np.int32((qh >> j) & 1) << 4
        h1 = np.int32((qh >> (j + 16)) & 1) << 4
        q[r, base + j] = np.int8(((v & 15) | h0) - offset)
        q[r, base + j + 16] = np.int8(((v >> 4) | h1) - offset)


@nb.njit(**_JIT)
def unpack_q5_0(raw, q, scale, bias):
    rows, nb_ = raw.shape[0], raw.shape[1] // 22
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * 22
            scale[r, b] = _f16(raw[r], o)
            _unpack_q5(raw, r, o + 2, o + 6, q, b * 32, 16)


@nb.njit(**_JIT)
def unpack_q5_1(raw, q, scale, bias):
    rows, nb_ = raw.shape[0], raw.shape[1] // 24
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * 24
            scale[r, b] = _f16(raw[r], o)
            bias[r, b] = _f16(raw[r], o + 2)
            _unpack_q5(raw, r, o + 4, o + 8, q, b * 32, 0)


@nb.njit(**_JIT)
def unpack_q8_0(raw, q, scale, bias):
    rows, nb_ = raw.shape[0], raw.shape[1] // 34
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * 34
            scale[r, b] = _f16(raw[r], o)
            for j in range(32):
                q[r, b * 32 + j] = np.int8(np.int32(raw[r, o + 2 + j]) - 256 * (raw[r, o + 2 + j] >> 7))


@nb.njit(**_JIT)
def unpack_q2_k(raw, q, scale, bias):
    # scales[16] | qs[64] | d f16 | dmin f16; 16 groups of 16
    rows, nb_ = raw.shape[0], raw.shape[1] // 84
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * 84
            d = _f16(raw[r], o + 80)
            dmin = _f16(raw[r], o + 82)
            for g in range(16):
                sc = raw[r, o + g]
                scale[r, b * 16 + g] = d * np.float32(sc & 15)
                bias[r, b * 16 + g] = -(dmin * np.float32(sc >> 4))
            for e in range(256):
                h, rem = e // 128, e % 128
                j, s, l = rem // 32, (rem % 32) // 16, rem % 16
                v = raw[r, o + 16 + h * 32 + s * 16 + l]
                q[r, b * 256 + e] = np.int8((v >> (2 * j)) & 3)


@nb.njit(inline="always", cache=True)
def _scale_q3_k(raw, r, o, k):
    """Q3_K's 6-bit scale number k (0..15) of the block at raw[r, o:], less 32."""
    bb, grp = k % 4, k // 4
    low = (np.int32(raw[r, o + 96 + bb + 4 * (grp % 2)]) >> (4 * (grp // 2))) & 15
    high = (np.int32(raw[r, o + 96 + 8 + bb]) >> (2 * grp)) & 3
    return (low | (high << 4)) - 32


@nb.njit(**_JIT)
def unpack_q3_k(raw, q, scale, bias):
    # hmask[32] | qs[64] | scales[12] (16 x 6 bits) | d f16; 16 groups of 16
    rows, nb_ = raw.shape[0], raw.shape[1] // 110
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * 110
            d = _f16(raw[r], o + 108)
            for k in range(16):
                scale[r, b * 16 + k] = d * np.float32(_scale_q3_k(raw, r, o, k))
            for e in range(256):
                h, rem = e // 128, e % 128
                j, s, l = rem // 32, (rem % 32) // 16, rem % 16
                v = (np.int32(raw[r, o + 32 + h * 32 + s * 16 + l]) >> (2 * j)) & 3
                hbit = (np.int32(raw[r, o + s * 16 + l]) >> (h * 4 + j)) & 1
                q[r, b * 256 + e] = np.int8(v - 4 * (1 - hbit))


@nb.njit(inline="always", cache=True)
def _scale_min_k4(raw, r, o, j):
    # 6-bit scale and min number j (0..7) of the 12-byte packed field at raw[r, o:o+12]
    if j < 4:
        return np.int32(raw[r, o + j]) & 63, np.int32(raw[r, o + j + 4]) & 63
    sc = (np.int32(raw[r, o + j + 4]) & 15) | ((np.int32(raw[r, o + j - 4]) >> 6) << 4)
    m = (np.int32(raw[r, o + j + 4]) >> 4) | ((np.int32(raw[r, o + j]) >> 6) << 4)
    return sc, m


@nb.njit(inline="always", cache=True)
def _k4_scales(raw, r, o, scale, bias, g0):
    d = _f16(raw[r], o)
    dmin = _f16(raw[r], o + 2)
    for j in range(8):
        sc, m = _scale_min_k4(raw, r, o + 4, j)
        scale[r, g0 + j] = d * np.float32(sc)
        bias[r, g0 + j] = -(dmin * np.float32(m))


@nb.njit(**_JIT)
def unpack_q4_k(raw, q, scale, bias):
    # d f16 | dmin f16 | scales[12] | qs[128]; 8 groups of 32
    rows, nb_ = raw.shape[0], raw.shape[1] // 144
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * 144
            _k4_scales(raw, r, o, scale, bias, b * 8)
            for c in range(4):
                for l in range(32):
                    v = raw[r, o + 16 + c * 32 + l]
                    q[r, b * 256 + c * 64 + l] = np.int8(v & 15)
                    q[r, b * 256 + c * 64 + 32 + l] = np.int8(v >> 4)


@nb.njit(**_JIT)
def unpack_q5_k(raw, q, scale, bias):
    # d f16 | dmin f16 | scales[12] | qh[32] | qs[128]; 8 groups of 32
    rows, nb_ = raw.shape[0], raw.shape[1] // 176
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * 176
            _k4_scales(raw, r, o, scale, bias, b * 8)
            for c in range(4):
                for l in range(32):
                    v = raw[r, o + 48 + c * 32 + l]
                    h = np.int32(raw[r, o + 16 + l])
                    q[r, b * 256 + c * 64 + l] = np.int8((v & 15) + 16 * ((h >> (2 * c)) & 1))
                    q[r, b * 256 + c * 64 + 32 + l] = np.int8((v >> 4) + 16 * ((h >> (2 * c + 1)) & 1))


@nb.njit(**_JIT)
def unpack_q6_k(raw, q, scale, bias):
    # ql[128] | qh[64] | scales int8[16] | d f16; 16 groups of 16
    rows, nb_ = raw.shape[0], raw.shape[1] // 210
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * 210
            d = _f16(raw[r], o + 208)
            for g in range(16):
                sc = np.int32(raw[r, o + 192 + g])
                scale[r, b * 16 + g] = d * np.float32(sc - 256 * (sc >> 7))
            for e in range(256):
                h, rem = e // 128, e % 128
                quarter, l = rem // 32, rem % 32
                lo = (np.int32(raw[r, o + h * 64 + (quarter % 2) * 32 + l]) >> (4 * (quarter // 2))) & 15
                hi = (np.int32(raw[r, o + 128 + h * 32 + l]) >> (2 * quarter)) & 3
                q[r, b * 256 + e] = np.int8((lo | (hi << 4)) - 32)



@nb.njit(**_JIT)
def superblocks_k4(raw, sc, mins, sb, type_size):
    """Q4_K's and Q5_K's own scales, for ggml's integer-exact products: sc, mins (rows, K/32) the
    6-bit integers, sb (rows, 2 * K/256) each super-block's d and dmin (the blocks' first bytes)."""
    rows, nb_ = raw.shape[0], raw.shape[1] // type_size
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * type_size
            sb[r, 2 * b] = _f16(raw[r], o)
            sb[r, 2 * b + 1] = _f16(raw[r], o + 2)
            for j in range(8):
                s, m = _scale_min_k4(raw, r, o + 4, j)
                sc[r, b * 8 + j] = s
                mins[r, b * 8 + j] = m


@nb.njit(**_JIT)
def superblocks_q6_k(raw, sc, mins, sb, type_size):
    """Q6_K's own scales: sc (rows, K/16) the int8 scales, sb (rows, 2 * K/256) each super-block's
    d (and 0); mins (rows, 0) unused."""
    rows, nb_ = raw.shape[0], raw.shape[1] // type_size
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * type_size
            sb[r, 2 * b] = _f16(raw[r], o + 208)
            sb[r, 2 * b + 1] = 0
            for g in range(16):
                v = np.int32(raw[r, o + 192 + g])
                sc[r, b * 16 + g] = v - 256 * (v >> 7)


@nb.njit(**_JIT)
def superblocks_q2_k(raw, sc, mins, sb, type_size):
    """Q2_K's own scales: sc, mins (rows, K/16) the 4-bit integers, sb (rows, 2 * K/256) each
    super-block's d and dmin."""
    rows, nb_ = raw.shape[0], raw.shape[1] // type_size
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * type_size
            sb[r, 2 * b] = _f16(raw[r], o + 80)
            sb[r, 2 * b + 1] = _f16(raw[r], o + 82)
            for g in range(16):
                sc[r, b * 16 + g] = raw[r, o + g] & 15
                mins[r, b * 16 + g] = raw[r, o + g] >> 4


@nb.njit(**_JIT)
def superblocks_q3_k(raw, sc, mins, sb, type_size):
    """Q3_K's own scales: sc (rows, K/16) the 6-bit integers less 32, sb (rows, 2 * K/256) each
    super-block's d (and 0); mins (rows, 0) unused."""
    rows, nb_ = raw.shape[0], raw.shape[1] // type_size
    for r in nb.prange(rows):
        for b in range(nb_):
            o = b * type_size
            sb[r, 2 * b] = _f16(raw[r], o + 108)
            sb[r, 2 * b + 1] = 0
            for k in range(16):
                sc[r, b * 16 + k] = _scale_q3_k(raw, r, o, k)


SUPERBLOCKS = {"Q2_K": superblocks_q2_k, "Q3_K": superblocks_q3_k, "Q4_K": superblocks_k4, "Q5_K": superblocks_k4,
               "Q6_K": superblocks_q6_k}


def superblocks(fmt, raw: np.ndarray, n_cols: int):
    """(sc, mins, sb) float32 for the formats whose products ggml computes from integer
    sub-block scales (see SUPERBLOCKS)."""
    rows = raw.shape[0]
    sc = np.empty((rows, n_cols // fmt.group), np.float32)
    mins = np.empty((rows, n_cols // fmt.group if fmt.has_bias else 0), np.float32)
    sb = np.empty((rows, 2 * (n_cols // 256)), np.float32)
    SUPERBLOCKS[fmt.name](raw, sc, mins, sb, fmt.type_size)
    return sc, mins, sb

UNPACKERS = {
    "Q4_0": unpack_q4_0, "Q4_1": unpack_q4_1, "Q5_0": unpack_q5_0, "Q5_1": unpack_q5_1,
    "Q8_0": unpack_q8_0, "Q2_K": unpack_q2_k, "Q3_K": unpack_q3_k, "Q4_K": unpack_q4_k,
    "Q5_K": unpack_q5_k, "Q6_K": unpack_q6_k,
}


def unpack(fmt, raw: np.ndarray, n_cols: int):
    """raw (rows, row_bytes) uint8 -> (q, scale, bias) for a quantized Format."""
    rows = raw.shape[0]
    q = np.empty((rows, n_cols), dtype=np.int8)
    scale = np.empty((rows, n_cols // fmt.group), dtype=np.float32)
    bias = np.empty((rows, n_cols // fmt.group if fmt.has_bias else 0), dtype=np.float32)
    UNPACKERS[fmt.name](raw, q, scale, bias)
    return q, scale, bias


def dequantize(fmt, raw: np.ndarray, n_cols: int) -> np.ndarray:
    """raw (rows, row_bytes) uint8 -> float32 (rows, n_cols), equal to ggml's dequantization."""
    if fmt.name == "F32":
        return raw.view(np.float32).reshape(raw.shape[0], n_cols)
    if fmt.name == "F16":
        return raw.view(np.float16).reshape(raw.shape[0], n_cols).astype(np.float32)
    if fmt.name == "BF16":
        bits = raw.view(np.uint16).reshape(raw.shape[0], n_cols).astype(np.uint32) << 16
        return bits.view(np.float32)
    q, scale, bias = unpack(fmt, raw, n_cols)
    return _apply(q, scale, bias, fmt.group)


@nb.njit(**_JIT)
def _apply(q, scale, bias, group):
    rows, n = q.shape
    out = np.empty((rows, n), dtype=np.float32)
    has_bias = bias.shape[1] > 0
    for r in nb.prange(rows):
        for i in range(n):
            v = scale[r, i // group] * np.float32(q[r, i])
            if has_bias:
                v = v + bias[r, i // group]
            out[r, i] = v
    return out
