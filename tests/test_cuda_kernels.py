"""The CUDA kernels (minillm.kernels.cuda) against the CPU kernels, on tiny random inputs.

They run under NVIDIA's CUDA simulator, so no GPU is needed (MINILLM_CUDA_REAL=1 runs them on
a real GPU instead; see cuda_env.py). The simulator runs one Python thread per CUDA thread:
shapes stay tiny. test_every_kernel_compiles_to_ptx compiles every registered kernel to real
sm_90 PTX in a subprocess without the simulator.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import zlib

import numpy as np
import pytest

import cuda_env

cuda_env.use_simulator_unless_real()
cuda_env.poison_simulated_memory()  # after: it imports numba.cuda

from numba import cuda  # noqa: E402  (after the simulator is chosen)
from synthetic import float_tensor, random_blocks  # noqa: E402

from minillm.formats import FORMATS, FORMATS_BY_NAME  # noqa: E402
from minillm.kernels import cuda as gpu  # noqa: E402
from minillm.kernels.cpu import matmul as cpu_mm  # noqa: E402
from minillm.kernels.cpu import ops as cpu_ops  # noqa: E402
from minillm.kernels.cpu.attention import attention as cpu_attention  # noqa: E402
from minillm.kernels.cpu.attention import attention_rows as cpu_attention_rows  # noqa: E402
from minillm.kernels.cpu.unpack import dequantize  # noqa: E402
from minillm.weights import Matrix  # noqa: E402

# modules the package shadows with functions of their names
gpu_attention = importlib.import_module("minillm.kernels.cuda.attention")
gpu_launch = importlib.import_module("minillm.kernels.cuda.launch")
gpu_matmul = importlib.import_module("minillm.kernels.cuda.matmul")
gpu_ptx = importlib.import_module("minillm.kernels.cuda.ptx")

pytestmark = pytest.mark.cuda
from cuda_env import every_launch_is_a_signature_ptx_check_compiles  # noqa: E402,F401 (autouse)

QUANT_FORMATS = [f.name for f in FORMATS if f.quantized]
FLOAT_FORMATS = [f.name for f in FORMATS if not f.quantized]
KINDS = {"q8_0": cpu_mm.KIND_Q8_0, "q8_1": cpu_mm.KIND_Q8_1, "q8_k": cpu_mm.KIND_Q8_K}


def rng_for(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def to_host(dev) -> np.ndarray:
    return dev.copy_to_host()


def assert_close(got, want, rel=1e-5):
    """Equal within rel of the largest magnitude in want."""
    np.testing.assert_allclose(got, want, rtol=0, atol=rel * max(1e-30, float(np.abs(want).max())))


def cpu_quantize(x: np.ndarray, kind: int) -> dict[str, np.ndarray]:
    T, K = x.shape
    out = {"q": np.empty((T, K), np.int8)}
    for g in (16, 32):
        out[f"d{g}"] = np.empty((T, K // g), np.float32)
        out[f"s{g}"] = np.empty((T, K // g), np.float32)
        out[f"n{g}"] = np.empty((T, K // g), np.int32)
    out["n4"] = np.empty((T, K // 4), np.int32)
    cpu_mm.quantize_act(x, kind, out["q"], out["d16"], out["s16"], out["n16"], out["d32"], out["s32"], out["n32"],
                        out["n4"])
    return out


def cpu_qmatmul(fmt, raw, x) -> np.ndarray:
    """The CPU's quantized product of the file rows raw (x quantized as the format pairs it)."""
    n_rows, n_cols = raw.shape[0], x.shape[1]
    return Matrix("w", FORMATS_BY_NAME[fmt], raw, n_rows, n_cols)(x)


def activations_input(T: int, K: int, rng) -> np.ndarray:
    """Random activations with the edge cases of the quantizers: a zero 32-group, a tie for the max."""
    x = (rng.standard_normal((T, K)) * 2).astype(np.float32)
    x[0, 32:64] = 0.0
    x[-1, 5] = 9.0
    x[-1, 40] = -9.0  # same |x| as x[-1, 5], later: Q8_K must keep the first (positive) one
    return x


def assert_quantized_equal(act, want: dict[str, np.ndarray]):
    np.testing.assert_array_equal(to_host(act.words).view(np.int8), want["q"])
    for name in ("d16", "s16", "d32", "s32"):
        np.testing.assert_array_equal(to_host(getattr(act, name)), want[name], err_msg=name)


# ---------------------------------------------------------------------------------------------
# norm and activation quantization
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_quantize_matches_cpu(kind):
    x = activations_input(2, 512, rng_for("quantize", kind))
    act = gpu.quantize(cuda.to_device(x), KINDS[kind])
    assert_quantized_equal(act, cpu_quantize(x, KINDS[kind]))


def test_rmsnorm_matches_cpu():
    rng = rng_for("rmsnorm")
    x = rng.standard_normal((4, 48)).astype(np.float32)  # e.g. 2 tokens x 2 heads of 48
    weight = (1 + rng.standard_normal(48) * 0.1).astype(np.float32)
    want = np.empty_like(x)
    cpu_ops.rmsnorm(x, weight, np.float32(1e-6), want)
    out = cuda.device_array_like(x)
    gpu.rmsnorm(cuda.to_device(x), cuda.to_device(weight), 1e-6, out)
    assert_close(to_host(out), want, 1e-6)


@pytest.mark.parametrize("quantized", [False, True])
def test_a_norm_takes_over_the_residual_add_before_it(quantized):
    """x = res + x, then the norm of x (and its quantization), in one launch: x becomes the
    CPU's sum, and the rest is what the add launched alone, then the norm, give."""
    rng = rng_for("add_rmsnorm", quantized)
    x, res = activations_input(3, 256, rng), activations_input(3, 256, rng)
    weight = (1 + rng.standard_normal(256) * 0.1).astype(np.float32)
    want_sum = res + x  # the CPU layers' add
    alone, dx = cuda.device_array_like(x), cuda.to_device(x)
    gpu.rmsnorm(cuda.to_device(want_sum), cuda.to_device(weight), 1e-5, alone)
    out = cuda.device_array_like(x)
    if quantized:
        act = gpu.rmsnorm_quantize(dx, cuda.to_device(weight), 1e-5, cpu_mm.KIND_Q8_0, out, res=cuda.to_device(res))
        assert_quantized_equal(act, cpu_quantize(to_host(alone), cpu_mm.KIND_Q8_0))
    else:
        gpu.rmsnorm(dx, cuda.to_device(weight), 1e-5, out, res=cuda.to_device(res))
    np.testing.assert_array_equal(to_host(dx), want_sum)
    np.testing.assert_array_equal(to_host(out), to_host(alone))


def test_rmsnorm_quantize_fused_matches_cpu():
    rng = rng_for("rmsnorm_quantize")
    x = activations_input(3, 256, rng)
    weight = (1 + rng.standard_normal(256) * 0.1).astype(np.float32)
    normed = np.empty_like(x)
    cpu_ops.rmsnorm(x, weight, np.float32(1e-5), normed)
    out = cuda.device_array_like(x)
    act = gpu.rmsnorm_quantize(cuda.to_device(x), cuda.to_device(weight), 1e-5, cpu_mm.KIND_Q8_K, out)
    np.testing.assert_array_equal(to_host(out), normed)
    assert_quantized_equal(act, cpu_quantize(normed, cpu_mm.KIND_Q8_K))


# ---------------------------------------------------------------------------------------------
# matrix products
# ---------------------------------------------------------------------------------------------
# (tokens, kernel): T = 1 through the decode kernel and T = 3 through the tiled one for every
# format; T = 3 through the decode kernel for one format per (group, bias) pair
MATMUL_CASES = [(1, "matvec"), (3, "tiled")]
MATVEC_BATCH_FORMATS = ["Q4_0", "Q4_1", "Q3_K", "Q2_K"]
QMATMUL_CASES = ([(fmt, T, path) for fmt in QUANT_FORMATS for T, path in MATMUL_CASES]
                 + [(fmt, 3, "matvec") for fmt in MATVEC_BATCH_FORMATS])


@pytest.mark.parametrize("fmt,T,path", QMATMUL_CASES)
def test_qmatmul_matches_cpu(fmt, T, path):
    """Every quantized format read from its own blocks: G = 16 and 32, with and without bias."""
    f = FORMATS_BY_NAME[fmt]
    rng = rng_for("qmatmul", fmt, T, path)
    K = 256 if f.activation == "q8_k" else 96  # 96: the tiled kernel's last chunk is partial
    N = 10  # not a multiple of either kernel's rows per block
    raw = random_blocks(fmt, N, K, rng)
    x = rng.standard_normal((T, K)).astype(np.float32)
    want = cpu_qmatmul(fmt, raw, x)

    w = gpu.upload_blocks(f, raw, K)
    assert w.has_bias == f.has_bias and w.group == f.group
    np.testing.assert_array_equal(to_host(w.raw), raw)  # the file's bytes, as they are
    act = gpu.quantize(cuda.to_device(x), KINDS[f.activation])
    out = cuda.device_array((T, N), np.float32)
    gpu.qmatmul(w, act, out, batched=path == "tiled")
    assert_close(to_host(out), want, 1e-5)


MMA_FORMATS = [f.name for f in FORMATS if f.quantized and f.group == 32]


@pytest.mark.parametrize("fmt,T", [(fmt, 5) for fmt in MMA_FORMATS] + [("Q4_0", 19)])
def test_tensor_core_product_equals_the_tiled_one(fmt, T):
    """qmatmul_mma_kernel (m16n8k32 int8 MMA through inline PTX; its warp-wide fragments gathered
    in Python under the simulator): for the formats of 32-value groups the same results as the
    tiled kernel, bit for bit, over tiles that are partly past the rows and the tokens."""
    f = FORMATS_BY_NAME[fmt]
    rng = rng_for("mma", fmt, T)
    K = 256 if f.activation == "q8_k" else 96
    N = 18  # a tile of 16 rows and one of 2; T: 5 of a tile's 8 tokens, or three tiles, the last partial
    w = gpu.upload_blocks(f, random_blocks(fmt, N, K, rng), K)
    assert w.group == 32
    act = gpu.quantize(cuda.to_device(rng.standard_normal((T, K)).astype(np.float32)), KINDS[f.activation])
    tiled, mma = (cuda.device_array((T, N), np.float32) for _ in range(2))
    gpu.qmatmul(w, act, tiled, batched=True, mma=False)
    gpu.qmatmul(w, act, mma, batched=True, mma=True)
    np.testing.assert_array_equal(to_host(mma), to_host(tiled))
    assert np.abs(to_host(tiled)).max() > 0


def test_tensor_core_rows_equal_the_matrix_vector_product(fmt="Q4_1"):
    """qmatvec_mma_kernel (the scheduler's rows on the tensor cores) gives each output the same
    float32 as qmatvec_kernel, bit for bit: 34 groups (two of the 32 classes hold two), 10 rows
    (a tile of 16, partly past them) and 11 tokens (a whole tile of 8 and 3 of the next)."""
    f = FORMATS_BY_NAME[fmt]
    rng = rng_for("rows mma", fmt)
    N, K, T = 10, 34 * 32, gpu_matmul.ROWS_MMA_MIN_T + 3
    w = gpu.upload_blocks(f, random_blocks(fmt, N, K, rng), K)
    act = gpu.quantize(cuda.to_device(rng.standard_normal((T, K)).astype(np.float32)), KINDS[f.activation])
    matvec, mma = (cuda.device_array((T, N), np.float32) for _ in range(2))
    gpu.qmatmul(w, act, matvec, batched=False, mma=False)
    with gpu_launch.recording() as launches:
        gpu.qmatmul(w, act, mma, batched=False, mma=True)
    assert [item.kernel for item in launches] == [gpu_matmul.qmatvec_mma_kernel]
    np.testing.assert_array_equal(to_host(mma), to_host(matvec))
    assert np.abs(to_host(matvec)).min() > 0


def test_mma_fragments_follow_the_ptx_layout():
    """The simulated m16n8k32 MMA against a NumPy product of the tiles its lanes hold, placed as
    the PTX ISA's fragment layout says (ptx.py's doc)."""
    rng = rng_for("mma layout")
    A = rng.integers(-128, 128, (16, 32)).astype(np.int8)
    B = rng.integers(-128, 128, (32, 8)).astype(np.int8)
    words = lambda v: np.ascontiguousarray(v).view(np.int32)[0]  # noqa: E731 (4 int8, lowest first)
    a_regs = np.zeros((32, 4), np.int32)
    b_regs = np.zeros((32, 2), np.int32)
    for lane in range(32):
        gid, tig = lane >> 2, lane & 3
        for r in range(4):
            row, k = gid + 8 * (r & 1), 4 * tig + 16 * (r >> 1)
            a_regs[lane, r] = words(A[row, k:k + 4])
        for r in range(2):
            b_regs[lane, r] = words(B[4 * tig + 16 * r:4 * tig + 16 * r + 4, gid])
    d = cuda.device_array((32, 4), np.int32)
    mma_probe[1, (32, 1)](cuda.to_device(a_regs), cuda.to_device(b_regs), d)
    want = A.astype(np.int32) @ B.astype(np.int32)
    got = np.zeros((16, 8), np.int32)
    for lane in range(32):
        gid, tig = lane >> 2, lane & 3
        for i in range(4):
            got[gid + 8 * (i >> 1), 2 * tig + (i & 1)] = to_host(d)[lane, i]
    np.testing.assert_array_equal(got, want)


@cuda.jit
def mma_probe(a_regs, b_regs, d):
    scratch_a = cuda.shared.array((1, 32, 4), np.int32)
    scratch_b = cuda.shared.array((1, 32, 2), np.int32)
    lane = cuda.threadIdx.x
    d[lane, 0], d[lane, 1], d[lane, 2], d[lane, 3] = gpu_ptx.mma_s8(
        a_regs[lane, 0], a_regs[lane, 1], a_regs[lane, 2], a_regs[lane, 3], b_regs[lane, 0], b_regs[lane, 1],
        scratch_a, scratch_b)


@pytest.mark.parametrize("fmt", ["Q4_1", "F16"])
def test_matvec_products_give_a_row_the_same_sums_in_any_batch(fmt):
    """The scheduler's rows take the matrix-vector kernels at any batch size (blocks of
    MATVEC_MAX_T tokens): 6 rows at once equal each row alone, bit for bit."""
    f = FORMATS_BY_NAME[fmt]
    rng = rng_for("matvec rows", fmt)
    N, K, T = 6, 64, gpu_matmul.MATVEC_MAX_T + 2
    x = rng.standard_normal((T, K)).astype(np.float32)
    if f.quantized:
        w = gpu.upload_blocks(f, random_blocks(fmt, N, K, rng), K)

        def product(rows):
            out = cuda.device_array((len(rows), N), np.float32)
            act = gpu.quantize(cuda.to_device(x[rows]), KINDS[f.activation])
            return to_host(gpu.qmatmul(w, act, out, batched=False))
    else:
        raw = np.ascontiguousarray(float_tensor(fmt, N, K, rng)).view(np.uint8).reshape(N, -1)
        w = gpu.upload_float_matrix(dequantize(f, raw, K), fmt)

        def product(rows):
            out = cuda.device_array((len(rows), N), np.float32)
            return to_host(gpu.fmatmul(w, cuda.to_device(x[rows]), out, batched=False))

    together = product(list(range(T)))
    for t in (0, T - 1):
        np.testing.assert_array_equal(product([t]), together[t:t + 1])


def round_like_weights(x: np.ndarray, fmt: str) -> np.ndarray:
    """The CPU's float path rounds the activations to the weight type (nearest even)."""
    if fmt == "F16":
        return x.astype(np.float16).astype(np.float32)
    if fmt == "BF16":
        bits = x.view(np.uint32)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return x


@pytest.mark.parametrize("T,path", MATMUL_CASES)
@pytest.mark.parametrize("fmt", FLOAT_FORMATS)
def test_fmatmul_matches_cpu(fmt, T, path):
    f = FORMATS_BY_NAME[fmt]
    rng = rng_for("fmatmul", fmt, T, path)
    N, K = 10, 40
    raw = np.ascontiguousarray(float_tensor(fmt, N, K, rng)).view(np.uint8).reshape(N, -1)
    weight = dequantize(f, raw, K)  # (N, K) float32, the CPU's float matrix
    x = rng.standard_normal((T, K)).astype(np.float32)
    x[0, :4] = [1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, -(1 + 3 * 2**-8)]  # f16 and bf16 rounding ties
    want = round_like_weights(x, fmt).astype(np.float64) @ weight.T.astype(np.float64)

    w = gpu.upload_float_matrix(weight, fmt)
    out = cuda.device_array((T, N), np.float32)
    gpu.fmatmul(w, cuda.to_device(x), out, batched=path == "tiled")
    assert_close(to_host(out), want, 1e-5)


# ---------------------------------------------------------------------------------------------
# attention block ops
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("neox,n_dims,yarn", [(False, 16, False), (True, 16, False), (True, 8, True)])
def test_rope_store_kv_matches_cpu(neox, n_dims, yarn):
    rng = rng_for("rope", neox, n_dims)
    T, H, Hkv, D, S = 3, 4, 2, 16, 6
    positions = np.array([5, 6, 700], np.int64)
    slots = np.array([1, 4, 2], np.int64)
    q = rng.standard_normal((T, H * D)).astype(np.float32)
    k = rng.standard_normal((T, Hkv * D)).astype(np.float32)
    v = rng.standard_normal((T, Hkv * D)).astype(np.float32)

    cos_t = np.empty((T, n_dims // 2), np.float32)
    sin_t = np.empty((T, n_dims // 2), np.float32)
    # the CPU's tables (with frequency factors and YaRN's blend in one case) feed both paths
    factors = (1.0 + rng.random(n_dims // 2)).astype(np.float32) if yarn else np.zeros(0, np.float32)
    low, high = cpu_ops.yarn_corr_dims(n_dims, 64, np.float32(10000.0), 32.0, 1.0)
    cpu_ops.rope_angles(positions, n_dims, np.float32(10000.0), np.float32(0.5), factors, np.float32(yarn),
                        low, high, np.float32(1.0), cos_t, sin_t)
    want_q, want_k = q.copy(), k.copy()
    cpu_ops.rope(want_q, H, D, n_dims, cos_t, sin_t, neox)
    cpu_ops.rope(want_k, Hkv, D, n_dims, cos_t, sin_t, neox)
    want_kc = np.zeros((S, Hkv, D), np.uint16)  # float16 bit patterns, as the CPU cache holds them
    want_vc = np.zeros((S, Hkv, D), np.uint16)
    cpu_ops.store_kv(want_k, v, slots, Hkv, D, want_kc, want_vc)

    dq, dk = cuda.to_device(q), cuda.to_device(k)
    kc = cuda.to_device(np.zeros((S, Hkv, D), np.float16))
    vc = cuda.to_device(np.zeros((S, Hkv, D), np.float16))
    kv_pos = cuda.to_device(np.full(S, -1, np.int64))
    gpu.rope_store_kv(dq, dk, cuda.to_device(v), cuda.to_device(positions), cuda.to_device(slots), H, n_dims,
                      cuda.to_device(cos_t), cuda.to_device(sin_t), neox, kc, vc, kv_pos)
    assert_close(to_host(dq), want_q, 1e-6)
    assert_close(to_host(dk), want_k, 1e-6)
    np.testing.assert_allclose(to_host(kc).astype(np.float32), want_kc.view(np.float16).astype(np.float32),
                               rtol=1e-3)  # at most 1 f16 step
    np.testing.assert_array_equal(to_host(vc).view(np.uint16), want_vc)
    np.testing.assert_array_equal(to_host(kv_pos)[slots], positions)


def test_store_kv_without_rope_matches_cpu():
    rng = rng_for("store_kv")
    T, Hkv, D, S = 2, 2, 8, 5
    k = rng.standard_normal((T, Hkv * D)).astype(np.float32)
    v = rng.standard_normal((T, Hkv * D)).astype(np.float32)
    positions, slots = np.array([3, 4], np.int64), np.array([4, 0], np.int64)
    want_kc = np.zeros((S, Hkv, D), np.uint16)
    want_vc = np.zeros((S, Hkv, D), np.uint16)
    cpu_ops.store_kv(k, v, slots, Hkv, D, want_kc, want_vc)

    dk = cuda.to_device(k)
    kc = cuda.to_device(np.zeros((S, Hkv, D), np.float16))
    vc = cuda.to_device(np.zeros((S, Hkv, D), np.float16))
    kv_pos = cuda.to_device(np.full(S, -1, np.int64))
    gpu.store_kv(dk, cuda.to_device(v), cuda.to_device(positions), cuda.to_device(slots), kc, vc, kv_pos)
    np.testing.assert_array_equal(to_host(kc).view(np.uint16), want_kc)
    np.testing.assert_array_equal(to_host(vc).view(np.uint16), want_vc)
    np.testing.assert_array_equal(to_host(dk), k)
    np.testing.assert_array_equal(to_host(kv_pos), [4, -1, -1, -1, 3])


@pytest.mark.parametrize("window,softcap", [(0, 0.0), (3, 0.0), (5, 0.0), (0, 2.0)])
def test_attention_matches_cpu(window, softcap):
    """GQA (4 query heads on 2 KV heads) over a wrapped ring (positions out of slot order), an
    empty slot, causal + sliding window, soft-capped scores (Gemma 2)."""
    rng = rng_for("attention", window, softcap)
    T, H, Hkv, D, S = 2, 4, 2, 16, 40
    q = rng.standard_normal((T, H * D)).astype(np.float32)
    kc = rng.standard_normal((S, Hkv, D)).astype(np.float16)
    vc = rng.standard_normal((S, Hkv, D)).astype(np.float16)
    scale = 0.25
    kv_pos = np.arange(S, dtype=np.int64)
    kv_pos[:36] += S  # positions 0..75 written into 40 slots: slot s holds the last p with p % 40 == s
    kv_pos[37] = -1
    q_pos = np.array([74, 75], np.int64)
    want = np.empty((T, H * D), np.float32)
    cpu_attention(q, q_pos, kc.view(np.uint16), vc.view(np.uint16), kv_pos, 0, window,
                  np.float32(scale), np.float32(softcap), H, want)

    out = cuda.device_array((T, H * D), np.float32)
    with gpu_launch.recording() as launches:
        gpu.attention(cuda.to_device(q), cuda.to_device(q_pos), cuda.to_device(kc), cuda.to_device(vc),
                      cuda.to_device(kv_pos), 0, window, scale, softcap, H, out)
    np.testing.assert_allclose(to_host(out), want, rtol=2e-3, atol=2e-3)
    assert [item.grid[:2] for item in launches] == [(T, H)]  # rows on x, which has room for any batch


@pytest.mark.skipif(cuda_env.REAL_GPU, reason="the simulator's allocations; a GPU's hold what they hold")
def test_simulated_device_memory_starts_as_garbage():
    """cuda_env.poison_simulated_memory: every kernel test runs over device arrays that start as
    a GPU's reused memory may (NaN, 0xA5 bytes), never the zeros numpy tends to give."""
    assert np.isnan(to_host(cuda.device_array((2, 3), np.float32))).all()
    assert np.isnan(to_host(cuda.device_array_like(np.zeros(4, np.float16)))).all()
    assert (to_host(cuda.device_array(5, np.int64)).view(np.uint8) == 0xA5).all()


def test_a_launch_of_an_undeclared_signature_is_named():
    """The autouse fixture's check: a launch with types no @kernel signature declares (here a
    float64 matrix for scale_kernel's float32 one) is named; a declared one is not."""
    ops = importlib.import_module("minillm.kernels.cuda.ops")
    with cuda_env.launched_signatures() as seen:
        ops.launch(ops.scale_kernel, 1, 32, cuda.to_device(np.ones((2, 4))), np.float64(2.0))
        ops.launch(ops.scale_kernel, 1, 32, cuda.to_device(np.ones((2, 4), np.float32)), np.float32(2.0))
    assert [s.split("(")[0] for s in cuda_env.undeclared_signatures(seen)] == ["scale_kernel"]
    assert len(seen) == 2


def test_a_grid_past_cudas_limits_is_refused():
    """A GPU refuses more than 65535 blocks along y or z (the simulator runs them): launch()
    says so rather than the driver failing mid-pass."""
    with pytest.raises(ValueError, match="past CUDA's limits"):
        gpu_launch.launch(importlib.import_module("minillm.kernels.cuda.ops").scale_kernel, (1, 65536), 1)


@pytest.mark.parametrize("kind", ["q8_0", "q8_1"])
def test_attention_quantizes_its_output_in_its_launch(kind):
    """Heads of whole 32-groups: the block that merges a head's runs quantizes its values for
    the product after it, as quantize() would the output; paths and kinds it cannot take are
    refused."""
    rng = rng_for("attention quantized", kind)
    T, H, Hkv, D, S = 2, 2, 1, 32, 12
    q = rng.standard_normal((T, H * D)).astype(np.float32)
    cache = [cuda.to_device(rng.standard_normal((S, Hkv, D)).astype(np.float16)) for _ in range(2)]
    kv_pos, q_pos = cuda.to_device(np.arange(S, dtype=np.int64)), cuda.to_device(np.array([10, 11], np.int64))
    args = (cuda.to_device(q), q_pos, *cache, kv_pos, 0, 0, 0.125, 0.0, H)
    alone, out = (cuda.device_array((T, H * D), np.float32) for _ in range(2))
    rows_args = (cuda.to_device(q), q_pos, cuda.to_device(np.zeros(T, np.int64)),  # each row alone
                 cuda.to_device(np.zeros((1, 1), np.int64)), -1, S, *cache, kv_pos, 0, 0.125, 0.0, H)
    for attend, how in ((gpu.attention, args), (gpu.attention_rows, rows_args)):
        attend(*how, alone)
        act = gpu.QActivations.empty(T, H * D, KINDS[kind])
        attend(*how, out, act=act)
        np.testing.assert_array_equal(to_host(out), to_host(alone))
        assert_quantized_equal(act, cpu_quantize(to_host(alone), KINDS[kind]))
    assert not gpu_attention.quantizes_output(T, D, cpu_mm.KIND_Q8_K)
    assert not gpu_attention.quantizes_output(gpu_attention.TILE, D, KINDS[kind])
    with pytest.raises(ValueError, match="cannot quantize"):
        gpu.attention(*args, out, act=gpu.QActivations.empty(T, 256, cpu_mm.KIND_Q8_K))


def test_a_lone_query_over_a_long_context_splits_its_cells_as_the_cpu_does():
    """One query over 700 cells (600 kept, a window): ggml's split path, its cells cut into
    runs (as many as the CPU's threads under the simulator) merged in order; and a lone query
    at position 300 (one run): both as the CPU computes them."""
    rng = rng_for("split attention")
    H, Hkv, D, S = 4, 2, 16, 768
    kc = rng.standard_normal((S, Hkv, D)).astype(np.float16)
    vc = rng.standard_normal((S, Hkv, D)).astype(np.float16)
    kv_pos = np.arange(S, dtype=np.int64)
    kv_pos[700:] = -1
    parts = gpu_attention.split_parts(H)
    assert parts == cpu_ops.THREADS
    for pos, window in ((699, 0), (699, 600), (300, 0)):
        q = rng.standard_normal((1, H * D)).astype(np.float32)
        q_pos = np.array([pos], np.int64)
        want = np.empty((1, H * D), np.float32)
        cpu_attention(q, q_pos, kc.view(np.uint16), vc.view(np.uint16), kv_pos, 0, window, np.float32(0.25),
                      np.float32(0.0), H, want)
        out = cuda.device_array((1, H * D), np.float32)
        gpu.attention(cuda.to_device(q), cuda.to_device(q_pos), cuda.to_device(kc), cuda.to_device(vc),
                      cuda.to_device(kv_pos), 0, window, 0.25, 0.0, H, out)
        np.testing.assert_allclose(to_host(out), want, rtol=2e-3, atol=2e-3)


def test_paged_rows_attend_each_as_a_lone_query():
    """The scheduler's rows: three sequences' cells in a shared pool of 16-row blocks (tables
    in no particular order, a sequence past the split threshold), each row as the CPU's
    attention_rows computes it; a row's result does not depend on the other rows."""
    rng = rng_for("paged attention")
    H, Hkv, D, shift, n_slots = 2, 1, 16, 4, 640
    n_blocks = 3 * n_slots // 16
    kc = rng.standard_normal((n_blocks * 16, Hkv, D)).astype(np.float16)
    vc = rng.standard_normal((n_blocks * 16, Hkv, D)).astype(np.float16)
    lengths = [600, 40, 9]
    tables = np.full((3, n_slots // 16), -1, np.int64)
    order = rng.permutation(n_blocks)
    kv_pos = np.full(n_blocks * 16, -1, np.int64)
    used = 0
    for seq, n in enumerate(lengths):
        for e in range(-(-n // 16)):
            tables[seq, e] = order[used]
            used += 1
        rows = (tables[seq, np.arange(n) >> 4] << 4) | (np.arange(n) & 15)
        kv_pos[rows] = np.arange(n)
    row_seq = np.array([1, 0, 2, 1], np.int64)
    q_pos = np.array([39, 599, 8, 20], np.int64)
    q = rng.standard_normal((4, H * D)).astype(np.float32)
    want = np.empty((4, H * D), np.float32)
    cpu_attention_rows(q, q_pos, row_seq, tables, shift, n_slots, 0, kc.view(np.uint16), vc.view(np.uint16), kv_pos,
                       0, np.float32(0.25), np.float32(0.0), H, want)
    args = [cuda.to_device(a) for a in (kc, vc, kv_pos)]

    def gpu_rows(rows):
        out = cuda.device_array((len(rows), H * D), np.float32)
        gpu.attention_rows(cuda.to_device(q[rows]), cuda.to_device(q_pos[rows]), cuda.to_device(row_seq[rows]),
                           cuda.to_device(tables), shift, n_slots, *args, 0, 0.25, 0.0, H, out)
        return to_host(out)

    together = gpu_rows([0, 1, 2, 3])
    np.testing.assert_allclose(together, want, rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(gpu_rows([1]), together[1:2])
    np.testing.assert_array_equal(gpu_rows([3, 2]), together[[3, 2]])


@pytest.mark.parametrize("window,softcap,q_scale", [(0, 0.0, 0.3), (5, 2.0, 1.0)])
def test_tiled_attention_matches_cpu(window, softcap, q_scale):
    """64 query rows or more take ggml's tiled path on both (Q in f32, a softmax maximum per
    64-cell tile, ggml_v_expf, f32 V sums): over a ring with sink cells (rows that see one or two
    tiles, a window), bit for bit; soft-capped scores (tanh: libm's on the CPU, the device's here)
    within a rounding."""
    rng = rng_for("tiled attention", window, softcap)
    T, H, Hkv, D, S, n_keep = 65, 1, 1, 16, 120, 4
    q = rng.standard_normal((T, H * D)).astype(np.float32) * 2
    kc = rng.standard_normal((S, Hkv, D)).astype(np.float16)
    vc = rng.standard_normal((S, Hkv, D)).astype(np.float16)
    q_pos = np.arange(65, 65 + T, dtype=np.int64)  # positions 0..129: 130 in 120 slots, 4 kept
    kv_pos = np.arange(S, dtype=np.int64)
    kv_pos[4:14] += S - 4  # slots 4..13 hold positions 120..129 (the ring wrapped)
    want = np.empty((T, H * D), np.float32)
    cpu_attention(q * np.float32(q_scale), q_pos, kc.view(np.uint16), vc.view(np.uint16), kv_pos, n_keep, window,
                  np.float32(0.25), np.float32(softcap), H, want)

    out = cuda.device_array((T, H * D), np.float32)
    gpu.attention(cuda.to_device(q), cuda.to_device(q_pos), cuda.to_device(kc), cuda.to_device(vc),
                  cuda.to_device(kv_pos), n_keep, window, 0.25, softcap, H, out, q_scale)
    if softcap:
        np.testing.assert_allclose(to_host(out), want, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(to_host(out).view(np.uint32), want.view(np.uint32))
    assert np.abs(want).max() > 0.1 and not np.array_equal(want[0], want[-1])


def glu_inputs(name):
    rng = rng_for(name)
    gate = (rng.standard_normal((3, 40)) * 4).astype(np.float32)
    gate[0, :4] = [-12.0, -10.0, 10.0, 15.0]  # geglu's limits
    return gate, rng.standard_normal((3, 40)).astype(np.float32)


def test_swiglu_matches_cpu():
    gate, up = glu_inputs("swiglu")
    want = np.empty_like(gate)
    cpu_ops.swiglu(gate, up, want)
    out = cuda.device_array_like(gate)
    gpu.swiglu(cuda.to_device(gate), cuda.to_device(up), out)
    assert_close(to_host(out), want, 1e-6)


def test_geglu_matches_cpu():
    gate, up = glu_inputs("geglu")
    want = np.empty_like(gate)
    cpu_ops.geglu(gate, up, want)
    out = cuda.device_array_like(gate)
    gpu.geglu(cuda.to_device(gate), cuda.to_device(up), out)
    np.testing.assert_allclose(to_host(out), want, rtol=1e-3, atol=1e-6)  # gelu rounded to f16


@pytest.mark.parametrize("glu, kind", [("swiglu", cpu_mm.KIND_Q8_K), ("geglu", cpu_mm.KIND_Q8_0),
                                       ("swiglu", cpu_mm.KIND_Q8_1)])
def test_glu_quantize_fused_is_the_glu_then_its_quantization(glu, kind):
    rng = rng_for(f"glu_quantize_{glu}")
    gate = (rng.standard_normal((3, 256)) * 4).astype(np.float32)
    up = rng.standard_normal((3, 256)).astype(np.float32)
    alone = cuda.device_array_like(gate)
    getattr(gpu, glu)(cuda.to_device(gate), cuda.to_device(up), alone)
    out = cuda.device_array_like(gate)
    act = gpu.glu_quantize(cuda.to_device(gate), cuda.to_device(up), gpu.GLU_SILU if glu == "swiglu" else gpu.GLU_GELU,
                           kind, out)
    np.testing.assert_array_equal(to_host(out), to_host(alone))
    assert_quantized_equal(act, cpu_quantize(to_host(alone), kind))


def test_add_inplace_matches_cpu():
    rng = rng_for("add")
    x = rng.standard_normal((3, 40)).astype(np.float32)
    y = rng.standard_normal((3, 40)).astype(np.float32)
    dx = cuda.to_device(x)
    gpu.add_inplace(dx, cuda.to_device(y))
    cpu_ops.add_inplace(x, y)
    np.testing.assert_array_equal(to_host(dx), x)


# ---------------------------------------------------------------------------------------------
# every kernel is registered, and compiles to real PTX
# ---------------------------------------------------------------------------------------------
def _is_kernel(obj) -> bool:
    """A numba.cuda kernel object (simulated or real), not a device function."""
    kernel_type = type(gpu_attention.attention_runs_kernel)
    if not isinstance(obj, kernel_type):
        return False
    device = getattr(obj, "_device", None)  # the simulator's kernels
    if device is None:
        device = obj.targetoptions.get("device", False)
    return not device


def test_every_kernel_is_registered():
    modules = [importlib.import_module(f"minillm.kernels.cuda.{name}")
               for name in ("attention", "matmul", "norm_quant", "ops")]
    found = {name for module in modules for name, obj in vars(module).items() if _is_kernel(obj)}
    assert found == set(gpu.KERNELS), "declare kernels with registry.kernel(...)"
    assert len(found) >= 10


def test_every_kernel_compiles_to_ptx():
    proc = subprocess.run([sys.executable, "-m", "minillm.kernels.cuda.ptx_check", "--cc", "9.0"],
                          capture_output=True, text=True, env=cuda_env.environment_for_ptx_check(), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    n_signatures = sum(len(spec.signatures) for spec in gpu.KERNELS.values())
    assert f"compiled {n_signatures} kernel signatures for sm_90, each assembled" in proc.stdout
    # ptxas keeps every kernel's local arrays in registers (no local memory, which a decode
    # matvec with per-token arrays indexed by a run-time count used to take: 144 bytes)
    lines = [line for line in proc.stdout.splitlines() if "chars of PTX" in line]
    assert len(lines) == n_signatures and all(" 0 B stack" in line for line in lines), proc.stdout


def test_ptx_that_ptxas_could_fuse_into_fma_is_refused():
    """NVVM fuses a multiply and an add into one fma unless told not to (registry.py tells it),
    and ptxas fuses mul.f32/add.f32 that carry no rounding modifier: either would round the
    kernels differently from their source, the simulator and the CPU. ptx_check refuses both."""
    from minillm.kernels.cuda.ptx_check import check_no_fusable_arithmetic

    check_no_fusable_arithmetic("\tmul.rn.f32 \t%f3, %f1, %f2;\n\tadd.rn.f64 \t%fd2, %fd1, %fd1;\n"
                                "\tfma.rn.f32 \t%f4, %f3, %f1, %f2;\n\tsub.rn.f32 \t%f5, %f4, %f1;\n", "rounded")
    with pytest.raises(RuntimeError, match="fusable: 3 float add/mul/sub"):
        check_no_fusable_arithmetic("\tmul.f32 \t%f3, %f1, %f2;\n\t@%p1 add.f32 \t%f4, %f3, %f1;\n"
                                    "\tsub.f64 \t%fd3, %fd1, %fd2;\n\tadd.s32 \t%r1, %r2, %r3;\n", "fusable")


def test_kernels_compile_where_numpy_has_no_row_stack():
    """numpy 2.5 removed np.row_stack, for which numba-cuda 0.30 registers an overload: without
    kernels/cuda's alias every compile fails. Here numpy is made to lack it, as 2.5 does."""
    probe = ("import numpy; del numpy.row_stack\n"
             "from numba import cuda\n"
             "from minillm.kernels.cuda import KERNELS\n"
             "spec = KERNELS['scale_kernel']\n"
             "ptx, _ = cuda.compile_ptx(spec.pyfunc, spec.signatures[0], cc=(9, 0))\n"
             "print('.entry' in ptx)\n")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          env=cuda_env.environment_for_ptx_check(), timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr[-2000:]
