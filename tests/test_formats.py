"""Every format: dequantization bit-exact against gguf.quants; products match dequantize-then-matmul."""
import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as ref_dequantize

from minillm.formats import FORMATS, FORMATS_BY_NAME
from minillm.kernels.cpu import layers
from minillm.kernels.cpu import matmul as mm
from minillm.kernels.cpu.unpack import dequantize, unpack
from minillm.weights import Matrix
from synthetic import random_blocks
from conftest import loaded_model

QUANTIZED = [f.name for f in FORMATS if f.quantized]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = a.astype(np.float32).ravel(), b.astype(np.float32).ravel()
    nan = np.isnan(a)
    return np.array_equal(nan, np.isnan(b)) and np.array_equal(a[~nan].view(np.uint32), b[~nan].view(np.uint32))


def reference(fmt, raw, cols):
    return ref_dequantize(raw, gguf.GGMLQuantizationType[fmt.name]).reshape(raw.shape[0], cols)


def test_registry_matches_gguf_constants():
    for f in FORMATS:
        qtype = gguf.GGMLQuantizationType[f.name]
        assert f.ggml_type == qtype.value
        assert (f.block_size, f.type_size) == gguf.GGML_QUANT_SIZES[qtype]


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantize_random_bytes_bit_exact(name):
    fmt = FORMATS_BY_NAME[name]
    rng = np.random.default_rng(1)
    cols = 2 * max(fmt.block_size, 32)
    raw = rng.integers(0, 256, size=(8, cols // fmt.block_size * fmt.type_size), dtype=np.uint8)
    with np.errstate(all="ignore"):  # random f16 scales include inf and nan
        assert same_bits(dequantize(fmt, raw, cols), reference(fmt, raw, cols))


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantize_zero_blocks(name):
    fmt = FORMATS_BY_NAME[name]
    cols = fmt.block_size * 2
    raw = np.zeros((3, 2 * fmt.type_size), np.uint8)
    assert same_bits(dequantize(fmt, raw, cols), reference(fmt, raw, cols))


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_dequantize_float_formats(name):
    fmt = FORMATS_BY_NAME[name]
    rng = np.random.default_rng(2)
    raw = rng.integers(0, 256, size=(4, 64 * fmt.type_size), dtype=np.uint8)
    with np.errstate(all="ignore"):
        assert same_bits(dequantize(fmt, raw, 64), reference(fmt, raw, 64))


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_dequantize_real_tensors_bit_exact(model):
    g = loaded_model(model).gguf
    seen = set()
    for info in g.tensors.values():
        key = (info.format.name, len(info.shape))
        if key in seen:
            continue
        seen.add(key)
        raw = g.raw(info.name)[:64]  # the first 64 rows of one tensor per type
        assert same_bits(dequantize(info.format, raw, info.shape[0]), reference(info.format, raw, info.shape[0])), info.name
    assert {f for f, _ in seen} >= ({"Q4_1", "Q8_0", "F32"} if model == "smollm2" else {"Q5_0", "Q8_0", "Q4_K", "Q6_K", "F32"})


def test_code_ranges_fit_the_stored_layout():
    rng = np.random.default_rng(4)
    for name in QUANTIZED:
        fmt = FORMATS_BY_NAME[name]
        raw = rng.integers(0, 256, size=(16, 2 * fmt.type_size), dtype=np.uint8)
        q = unpack(fmt, raw, 2 * fmt.block_size)[0].astype(np.int32)
        if fmt.nibble_offset is not None:
            assert 0 <= q.min() + fmt.nibble_offset and q.max() + fmt.nibble_offset <= 15, name
        assert 0 <= q.min() + 128 and q.max() + 128 <= 255


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("n_tokens", [1, 5])
def test_quantized_product_matches_dequantized(name, n_tokens):
    """out = x_q @ W.T where x_q is the Q8-quantized activation: equal up to float rounding."""
    fmt = FORMATS_BY_NAME[name]
    rng = np.random.default_rng(3)
    n_rows, cols = 70, 512  # 70 rows: a partial last tile
    raw = random_blocks(name, n_rows, cols, rng)
    q, scale, bias = unpack(fmt, raw, cols)
    w = Matrix("w", fmt, raw, n_rows, cols)
    assert (w.packed.bits == 4) == (fmt.name in ("Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K"))  # codes two a byte
    x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
    xq = np.empty((n_tokens, cols), np.int8)
    d16, s16 = np.empty((n_tokens, cols // 16), np.float32), np.empty((n_tokens, cols // 16), np.float32)
    d32, s32 = np.empty((n_tokens, cols // 32), np.float32), np.empty((n_tokens, cols // 32), np.float32)
    n16, n32 = np.empty((n_tokens, cols // 16), np.int32), np.empty((n_tokens, cols // 32), np.int32)
    n4 = np.empty((n_tokens, cols // 4), np.int32)
    mm.quantize_act(x, mm.KIND_IDS[fmt.activation], xq, d16, s16, n16, d32, s32, n32, n4)
    xd, xs, xn = (d16, s16, n16) if fmt.group == 16 else (d32, s32, n32)
    assert np.array_equal(xn, xq.reshape(n_tokens, -1, fmt.group).astype(np.int32).sum(-1))
    assert np.array_equal(n4, xq.reshape(n_tokens, -1, 4).astype(np.int32).sum(-1))
    out = w(x)

    w = reference(fmt, raw, cols).astype(np.float64)
    x_deq = xq.astype(np.float64) * np.repeat(xd, fmt.group, axis=1)
    expected = x_deq @ w.T
    if fmt.has_bias:  # Q8_1's s is rounded to f16, so use the sums as the kernel sees them
        expected = (np.repeat(xd, fmt.group, axis=1) * xq) @ (w - np.repeat(bias, fmt.group, axis=1)).T
        expected += xs.astype(np.float64) @ bias.astype(np.float64).T
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    # and the activation quantization itself is faithful to x
    assert np.abs(x_deq - x).max() <= np.abs(x).max() / 127 * 0.51 + 1e-6


def test_activation_quantization_q8_0_follows_llama_cpp():
    x = np.array([[0.5, -1.0, 0.25] + [0.0] * 29], np.float32)
    xq = np.empty((1, 32), np.int8)
    d16, s16, d32, s32 = (np.empty((1, n), np.float32) for n in (2, 2, 1, 1))
    n16, n32, n4 = np.empty((1, 2), np.int32), np.empty((1, 1), np.int32), np.empty((1, 8), np.int32)
    mm.quantize_act(x, mm.KIND_Q8_0, xq, d16, s16, n16, d32, s32, n32, n4)
    assert xq[0, :3].tolist() == [64, -127, 32]  # rint(0.5 * 127) = 64 (half to even: 63.5 -> 64)
    assert d32[0, 0] == np.float32(np.float16(1.0 / 127))


@pytest.mark.parametrize("nibbles", [False, True])
def test_portable_tile_dot_matches_vnni(nibbles):
    """The plain-Numba fallback (CPUs without AVX-512 VNNI) computes the same integers."""
    from minillm.kernels.cpu import vnni

    rng = np.random.default_rng(5)
    steps = 8  # one group of 32 columns
    data = rng.integers(0, 16 if nibbles else 256, size=steps * 128 // (2 if nibbles else 1) + 256).astype(np.uint8)
    if nibbles:
        data |= rng.integers(0, 16, size=data.shape).astype(np.uint8) << 4
    x = rng.integers(-127, 128, size=64).astype(np.int8)
    portable, fast = np.zeros(32, np.int32), np.zeros(32, np.int32)
    dot_portable = vnni.tile_dot_nib_portable if nibbles else vnni.tile_dot_portable
    dot_fast = vnni.tile_dot_nib if nibbles else vnni.tile_dot
    dot_portable(data, 128, x, 32, steps, portable)
    dot_fast(data, 128, x, 32, steps, fast)
    codes = data[128:128 + steps * 128 // (2 if nibbles else 1)].astype(np.int32)
    if nibbles:  # (pair p, row r, j) -> columns 8p+j (low) and 8p+4+j (high)
        c = codes.reshape(steps // 2, 32, 4)
        full = np.concatenate([c & 15, c >> 4], axis=2)          # (p, r, 8)
        w = full.transpose(1, 0, 2).reshape(32, -1)
    else:
        w = codes.reshape(steps, 32, 4).transpose(1, 0, 2).reshape(32, -1)
    expected = w @ x[32:64].astype(np.int32)
    assert np.array_equal(portable, expected) and np.array_equal(fast, expected)


LANES_FORMATS = [f.name for f in FORMATS if f.quantized and f.product == "lanes"]


@pytest.mark.parametrize("name,n_rows", [(name, 70) for name in LANES_FORMATS] + [("Q4_0", 72)])
def test_lanes_tiles_hold_the_file_size_and_sum_like_the_portable_path(name, n_rows):
    """The 32-block formats' tiles (kernels/cpu/lanes.py) take the file's bytes (codes at their
    width, float16 scales); the SIMD loop, the plain-Numba fallback, the token groups (AVX2,
    AVX-512 VNNI) and the widened 5-bit batches give the same bits; and the products match dequantize-then-matmul. Q4_0 with rows in
    eights sums each block first (llama.cpp's repacked q4_0_8x8 arithmetic)."""
    from minillm.kernels.cpu import lanes, layers

    fmt = FORMATS_BY_NAME[name]
    rng = np.random.default_rng(6)
    cols = 640  # 70 rows: a partial last tile
    raw = random_blocks(name, n_rows, cols, rng)
    w = Matrix("w", fmt, raw, n_rows, cols).packed
    block_sums = w[11] == mm.PRODUCT_LANES_BLOCKS
    assert block_sums == (n_rows % 8 == 0 and name == "Q4_0")
    n_tiles = (n_rows + mm.R - 1) // mm.R
    assert w[0].nbytes == n_tiles * mm.R * cols // fmt.block_size * fmt.type_size
    x = rng.standard_normal((12, cols)).astype(np.float32)
    batch = layers.linear(w, x)  # 12 tokens: 5-bit tiles are widened to bytes first
    one_by_one = np.concatenate([layers.linear(w, x[t:t + 1]) for t in range(12)])
    assert np.array_equal(batch, one_by_one)
    # 7 tokens: groups walked together (AVX2 one of 4, AVX-512 VNNI three pairs), the rest alone
    assert np.array_equal(layers.linear(w, x[:7]), one_by_one[:7])

    q, _, _, _, xd, xs, _, xn4 = layers.quantize(x, mm.KIND_IDS[fmt.activation])
    starts = lanes.lane_starts(xn4, np.int32(fmt.code_offset), fmt.has_bias)
    n_blk, acc, portable = cols // 32, np.empty(9 * mm.R, np.float32), np.empty_like(batch)
    for t in range(12):
        for nt in range(n_tiles):
            w_off = nt * n_blk * lanes.block_bytes(fmt.code_bits, fmt.has_bias)
            lanes._tile_portable(w[0], w_off, q, t, xd, xs, starts, n_blk, np.int32(fmt.code_offset), fmt.code_bits,
                                 fmt.has_bias, block_sums, acc)
            a = acc.reshape(9, mm.R)
            h = a[0] if block_sums else (((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
                                         + (a[8] if fmt.has_bias else 0))
            rows = min(mm.R, n_rows - nt * mm.R)
            portable[t, nt * mm.R:nt * mm.R + rows] = h[:rows]
    assert np.array_equal(portable, batch)

    x_deq = q.reshape(12, cols).astype(np.float64) * np.repeat(xd, 32, axis=1)
    expected = x_deq @ reference(fmt, raw, cols).astype(np.float64).T
    np.testing.assert_allclose(batch, expected, rtol=1e-3, atol=1e-3 * np.abs(expected).max())


def test_q2_k_as_llama_cpp_repacks_it():
    """Q2_K with rows in eights is repacked by llama.cpp on AVX-512 hosts (q2_K_8x8): its gemm
    takes a batch's rows in fours, a half super-block per fma, its gemv the rest, a super-block
    per fma (the bits against llama.cpp: test_architectures' qwen3-q2_k on such a host). On
    every host: both stay within float rounding of the dequantized product, and row by row
    (the scheduler's rows) every row is the gemv's, as if alone."""
    from minillm.weights import row_by_row, with_product

    fmt = FORMATS_BY_NAME["Q2_K"]
    rng = np.random.default_rng(5)
    n_rows, cols = 64, 512
    raw = random_blocks("Q2_K", n_rows, cols, rng)
    packed = Matrix("w", fmt, raw, n_rows, cols).packed
    repacked = with_product(packed, mm.PRODUCT_K_LANES_8X8)
    x = rng.standard_normal((6, cols)).astype(np.float32)  # rows 0-3: the gemm; 4-5: the gemv
    batch = layers.linear(repacked, x)
    alone = np.concatenate([layers.linear(repacked, x[t:t + 1]) for t in range(6)])
    assert np.array_equal(batch[4:], alone[4:])
    assert np.array_equal(layers.linear(row_by_row(repacked), x), alone)
    expected = x.astype(np.float64) @ reference(fmt, raw, cols).astype(np.float64).T
    for out in (batch, alone):
        np.testing.assert_allclose(out, expected, atol=0.02 * np.abs(expected).max())
    assert not np.array_equal(batch[:4], alone[:4])  # the halves' extra rounding shows


@pytest.mark.parametrize("fmt", [0, 1, 2])  # FLOAT_F32, FLOAT_F16, FLOAT_BF16
def test_float_batches_in_register_tiles_sum_as_tiny_blas(fmt):
    """The batched float product takes register tiles (float_matmul.TILE, SMALL_TILE for 2
    rows); every output is still tinyBLAS's accumulator over steps of 16 lanes (AVX2: 8), bit
    for bit (partial tiles: odd N, T not a multiple of the tile's rows)."""
    import numba as nb

    from minillm.kernels.cpu import float_matmul as fm

    @nb.njit
    def one_output_at_a_time(w, x):
        N, K = w.shape
        out = np.empty((x.shape[0], N), np.float32)
        acc = np.empty(64, np.float32)
        for n in range(N):
            for t in range(x.shape[0]):
                out[t, n] = fm._tiny_blas_dot(w.reshape(-1), n * K, x.reshape(-1), t * K, K, acc)
        return out

    rng = np.random.default_rng(7)
    for n_rows, cols, n_tokens in ((33, 64, 2), (64, 576, 7), (7, 1536, 9)):
        w = rng.standard_normal((n_rows, cols)).astype(np.float32)
        x = rng.standard_normal((n_tokens, cols)).astype(np.float32)
        out = np.empty((n_tokens, n_rows), np.float32)
        fm.float_matmul(w, x, fmt, out)
        if fmt == fm.FLOAT_BF16 and fm.GGML_AVX512_BF16:
            continue  # vdpbf16ps's own steps (test_quantize's BF16 files)
        assert np.array_equal(out, one_output_at_a_time(w, x)), (n_rows, cols, n_tokens)


def test_f16_weights_kept_as_bit_patterns_multiply_as_their_values():
    """F16 matrices stay float16 bit patterns (uint16, half the bytes): every product path (one
    row, register tiles, the scalar steps of a width not a multiple of 16) gives the bits that
    the same weights widened to float32 give."""
    from minillm.kernels.cpu import float_matmul as fm

    rng = np.random.default_rng(3)
    for n_rows, cols in ((9, 576), (5, 72)):
        w16 = rng.standard_normal((n_rows, cols)).astype(np.float16)
        for n_tokens in (1, 3, 9):
            x = rng.standard_normal((n_tokens, cols)).astype(np.float16).astype(np.float32)  # rounded as ggml does
            as_bits, as_values = (np.empty((n_tokens, n_rows), np.float32) for _ in range(2))
            fm.float_matmul(w16.view(np.uint16), x, fm.FLOAT_F16, as_bits)
            fm.float_matmul(w16.astype(np.float32), x, fm.FLOAT_F16, as_values)
            assert np.array_equal(as_bits, as_values), (n_rows, cols, n_tokens)
    assert Matrix("w", FORMATS_BY_NAME["F16"], w16.view(np.uint8), 5, 72).packed.fweight.dtype == np.uint16


def test_bf16_weights_kept_as_bit_patterns_multiply_as_their_values():
    """BF16 matrices stay bfloat16 bit patterns (int16, half the bytes). With AVX512_BF16 their
    products take vdpbf16ps itself (tiles for batches, two accumulators for one row); every path
    gives the bits the same weights widened to float32 give through the step-by-step emulation
    of the instruction (and without AVX512_BF16, through tinyBLAS and ggml_vec_dot_bf16)."""
    from minillm.kernels.cpu import float_matmul as fm

    def to_bf16_bits(a):
        u = a.view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).view(np.int16)

    rng = np.random.default_rng(5)
    for n_rows, cols in ((9, 576), (5, 608), (4, 72)):  # 608: a tail past the last 64; 72: no vector steps
        bits = to_bf16_bits(rng.standard_normal((n_rows, cols)).astype(np.float32))
        values = (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        for n_tokens in (1, 3, 9):
            x = (to_bf16_bits(rng.standard_normal((n_tokens, cols)).astype(np.float32)).view(np.uint16)
                 .astype(np.uint32) << 16).view(np.float32)  # rounded as ggml does
            as_bits, as_values = (np.empty((n_tokens, n_rows), np.float32) for _ in range(2))
            fm.float_matmul(bits, x, fm.FLOAT_BF16, as_bits)
            fm.float_matmul(values, x, fm.FLOAT_BF16, as_values)
            assert np.array_equal(as_bits, as_values), (n_rows, cols, n_tokens)
    raw = bits.view(np.uint8)
    assert Matrix("w", FORMATS_BY_NAME["BF16"], raw, 4, 72).packed.fweight.dtype == np.uint16  # read as int16
