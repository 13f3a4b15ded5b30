"""The CUDA backend (minillm/backends/cuda.py: the architectures' own layer code over
kernels/cuda/layers.py) against the CPU path, on tiny synthetic models.

Under NVIDIA's CUDA simulator (no GPU needed; MINILLM_CUDA_REAL=1 runs on a real GPU) every
CUDA thread is a Python thread: a one-layer forward pass of a 32-wide model costs seconds. So
each model mixes several formats (one per matrix), which covers every format of the registry
in four models, and the models have one layer: Gemma 3 is tested once with a sliding-window
(local) layer and once with a global one (window 0 makes every layer global). Under the
simulator the matrix products take the tiled kernels at every batch size, and the simulator's
thread blocks synchronise through a barrier instead of polling (see `fast_simulator`).
"""
from __future__ import annotations

import copy
import subprocess
import sys
import threading

import numpy as np
import pytest

import cuda_env

cuda_env.use_simulator_unless_real()
cuda_env.poison_simulated_memory()  # after: it imports numba.cuda

from synthetic import SyntheticModel  # noqa: E402

import minillm  # noqa: E402
from minillm.arch import get_architecture  # noqa: E402
from minillm.backends.cuda import CudaBackend  # noqa: E402
from minillm.formats import FORMATS  # noqa: E402
from minillm.gguf_file import GGUFFile  # noqa: E402
from minillm.kernels.cuda import layers as cuda_layers  # noqa: E402

pytestmark = pytest.mark.cuda
from cuda_env import every_launch_is_a_signature_ptx_check_compiles  # noqa: E402,F401 (autouse)

# CUDA and CPU logits agree within this fraction of the largest |logit|. Under the simulator
# the largest difference measured is 1.1e-7 (most models: bit-identical): the kernels sum some
# float32 products in another order. A real GPU also contracts multiply-adds (FMA), and a
# last-bit change can move an activation's int8 code by one step, about 1e-3 of the logits.
REL_TOL = 1e-3 if cuda_env.REAL_GPU else 1e-5
MEASURED = {"max_rel_diff": 0.0}

TINY = dict(n_embd=32, n_head=2, n_head_kv=1, head_dim=16, n_ff=32, n_vocab=16)
# K-quants need rows of 256 values: the matrices reading the embedding (q, k, v, gate, up and
# the tied output) are 256 wide, the others take the 32-value formats
WIDE = dict(TINY, n_embd=256)

# per model: the format of each matrix (by tensor name), the rest in the model's default format
SMALL_FORMATS = {"token_embd": "Q8_0", "attn_q": "F32", "attn_k": "F16", "attn_v": "BF16",
                 "attn_output": "Q4_0", "ffn_gate": "Q4_1", "ffn_up": "Q5_0", "ffn_down": "Q5_1"}
K_FORMATS = {"token_embd": "Q6_K", "attn_q": "Q2_K", "attn_k": "Q3_K", "attn_v": "Q4_K",
             "attn_output": "Q8_0", "ffn_gate": "Q5_K", "ffn_up": "Q6_K", "ffn_down": "Q4_0"}

# (arch, dims, formats, sliding window): every format of the registry, both architectures
MODELS = {
    "llama-small-formats": ("llama", TINY, SMALL_FORMATS, 0),
    "llama-k-quants": ("llama", WIDE, K_FORMATS, 0),
    "gemma3-local-small-formats": ("gemma3", TINY, SMALL_FORMATS, 2),
    "gemma3-global-k-quants": ("gemma3", WIDE, K_FORMATS, 0),
}


# the other architectures, each with what its module adds (keys, tensors), on TINY/SMALL_FORMATS
ARCH_MODELS = {
    "llama-rope-freqs-yarn": ("llama", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
                                        "rope.scaling.original_context_length": 8},
                              {"rope_freqs.weight": [1.0, 1.5, 2.0, 4.0, 1.0, 1.0, 3.0, 8.0]}, None),
    "qwen2": ("qwen2", {}, {}, None),
    "qwen3": ("qwen3", {}, {}, None),
    "phi3": ("phi3", {"rope.scaling.original_context_length": 2, "rope.scaling.attn_factor": 1.2},
             {"rope_factors_long.weight": [1.0, 2.0, 3.0, 4.0], "rope_factors_short.weight": [1.0, 1.0, 1.5, 2.0]}, 8),
    "granite": ("granite", {"logit_scale": 4.0, "residual_scale": 0.5, "embedding_scale": 3.0,
                            "attention.scale": 0.3}, {}, None),
    "gemma2": ("gemma2", {"attn_logit_softcapping": 1.5, "final_logit_softcapping": 2.0}, {}, None),
}


def tiny_model(arch: str, formats: dict, dims: dict, **extra) -> SyntheticModel:
    """A one-layer model whose matrices take the formats given by tensor name."""
    return SyntheticModel(arch, "Q8_0", n_layer=1, formats=formats, **dims, **extra).build()


# ---------------------------------------------------------------------------------------------
# the simulator, faster: its BlockManager polls every thread of a block in a loop that holds
# the GIL (about 0.5 ms per thread and syncthreads); here the threads of a block wait on a
# barrier instead. Same semantics: the block's threads run concurrently, syncthreads waits for
# every thread still running, the first error is raised.
# ---------------------------------------------------------------------------------------------
class _BlockBarrier:
    def __init__(self, n_threads: int):
        self.n_running, self.n_waiting, self.broken = n_threads, 0, False
        self.cond = threading.Condition()
        self.generation = 0

    def _release(self):
        self.n_waiting = 0
        self.generation += 1
        self.cond.notify_all()

    def wait(self):
        with self.cond:
            generation = self.generation
            self.n_waiting += 1
            if self.n_waiting == self.n_running:
                self._release()
            while generation == self.generation and not self.broken:
                self.cond.wait()
            if self.broken:
                raise RuntimeError("another thread of the block failed")

    def leave(self):
        with self.cond:
            self.n_running -= 1
            if self.n_waiting and self.n_waiting == self.n_running:
                self._release()

    def abort(self):
        with self.cond:
            self.broken = True
            self.cond.notify_all()


def _barrier_block_manager(sim_kernel):
    class BarrierThread(sim_kernel.BlockThread):
        def __init__(self, barrier, *args):
            super().__init__(*args)
            self.barrier = barrier

        def syncthreads(self):
            self.barrier.wait()

    class BarrierBlockManager(sim_kernel.BlockManager):
        def run(self, grid_point, *args):
            barrier = _BlockBarrier(int(np.prod(self._block_dim)))

            def target():
                try:
                    self._f(*args)
                except BaseException:
                    barrier.abort()
                    raise
                finally:
                    barrier.leave()

            threads = [BarrierThread(barrier, target, self, grid_point, point, self._debug)
                       for point in np.ndindex(*self._block_dim)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            errors = [t.exception for t in threads if t.exception]
            if errors:  # the failing thread's error, rather than the others' aborts
                exc, tb = next((e for e in errors if "another thread" not in str(e[0])), errors[0])
                raise exc.with_traceback(tb)

    return BarrierBlockManager


@pytest.fixture(scope="module", autouse=True)
def fast_simulator():
    if cuda_env.REAL_GPU:
        yield
        return
    from numba.cuda.simulator import kernel as sim_kernel

    saved = sim_kernel.BlockManager, cuda_layers.BATCHED
    sim_kernel.BlockManager = _barrier_block_manager(sim_kernel)
    cuda_layers.BATCHED = True
    yield
    sim_kernel.BlockManager, cuda_layers.BATCHED = saved


# ---------------------------------------------------------------------------------------------
# the models
# ---------------------------------------------------------------------------------------------
def test_the_models_cover_every_format():
    covered = {fmt for _, _, formats, _ in MODELS.values() for fmt in formats.values()}
    assert covered == {f.name for f in FORMATS}


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cuda_models")
    files = {name: tiny_model(arch, formats, dims, window=window).write(folder / f"{name}.gguf")
             for name, (arch, dims, formats, window) in MODELS.items()}
    for name, (arch, keys, tensors, rope_dims) in ARCH_MODELS.items():
        model = tiny_model(arch, SMALL_FORMATS, TINY, window=2, keys=keys, extra_tensors=tensors, rope_dims=rope_dims)
        files[name] = model.write(folder / f"{name}.gguf")
    return files


def cuda_backend(path) -> CudaBackend:
    gguf = GGUFFile(path)
    return CudaBackend(get_architecture(gguf.architecture)(gguf))


def assert_logits_match(got: np.ndarray, want: np.ndarray):
    assert got.shape == want.shape and got.dtype == np.float32
    if want.size:
        rel = float(np.abs(got - want).max() / np.abs(want).max())
        MEASURED["max_rel_diff"] = max(MEASURED["max_rel_diff"], rel)
        assert rel <= REL_TOL, rel
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


@pytest.fixture(scope="module", autouse=True)
def report_measured():
    yield
    from conftest import REPORT

    where = "GPU" if cuda_env.REAL_GPU else "simulator"
    REPORT.append(f"CUDA backend vs CPU ({where}): largest logit difference "
                  f"{MEASURED['max_rel_diff']:.2g} of the largest |logit| (tolerance {REL_TOL:g})")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_prefill_logits_match_cpu(model_files, name):
    ids = np.random.default_rng(1).integers(0, TINY["n_vocab"], 3)
    want = minillm.load(model_files[name]).logits(ids)
    backend = cuda_backend(model_files[name])
    got = backend.forward(ids, backend.new_cache(len(ids)), 0)
    assert_logits_match(got, want)


@pytest.mark.parametrize("name", sorted(ARCH_MODELS))
def test_architectures_prefill_and_decode_match_cpu(model_files, name, monkeypatch):
    """Every architecture's own steps (biases, QK-norms, fused tensors, partial and scaled RoPE
    with frequency factors, multipliers, soft-capping) on the GPU path: a prefill, then a step."""
    monkeypatch.setattr(cuda_layers, "BATCHED", None)
    ids = np.random.default_rng(4).integers(0, TINY["n_vocab"], 5)
    cpu = minillm.load(model_files[name])
    cpu_cache = cpu.new_cache(8)
    backend = cuda_backend(model_files[name])
    cache = backend.new_cache(8)
    assert_logits_match(backend.forward(ids[:4], cache, 0), cpu.eval(ids[:4], cpu_cache))
    assert_logits_match(backend.forward(ids[4:], cache, 0), cpu.eval(ids[4:], cpu_cache))


def test_decode_with_ring_and_sinks_matches_cpu(model_files, monkeypatch):
    """Prefill 4 tokens, then 3 single-token steps in a 6-slot cache with 2 sink tokens: the
    ring wraps (position 6 overwrites position 2). Only the last prefill logits come back.
    The matrix products choose their kernels by batch size, as on a GPU (matrix-vector here)."""
    monkeypatch.setattr(cuda_layers, "BATCHED", None)
    path = model_files["llama-small-formats"]
    ids = np.random.default_rng(2).integers(0, TINY["n_vocab"], 7)
    cpu = minillm.load(path)
    cpu_cache = cpu.new_cache(6, n_keep=2, batch_size=4)
    backend = cuda_backend(path)
    cache = backend.new_cache(6, n_keep=2, batch_size=4)
    assert_logits_match(backend.forward(ids[:4], cache, 3), cpu.eval(ids[:4], cpu_cache, logits_from=3))
    for i in range(4, 7):
        assert_logits_match(backend.forward(ids[i:i + 1], cache, 0), cpu.eval(ids[i:i + 1], cpu_cache))
    assert cache.wrapped and cache.n_past == cpu_cache.n_past == 7
    np.testing.assert_array_equal(cache.device_kv_pos["global"].copy_to_host(), cpu_cache.groups["global"].kv_pos)


def test_sliding_window_ring_truncate_and_copy_match_cpu(model_files):
    """Gemma 3's local ring (window 2 + batch 2: 4 slots) wraps; then truncate rewinds an
    unwrapped cache, and a deep copy (as beam search makes) evaluates on its own."""
    path = model_files["gemma3-local-small-formats"]
    ids = np.random.default_rng(3).integers(0, TINY["n_vocab"], 6)
    cpu = minillm.load(path)
    backend = cuda_backend(path)

    cpu_cache, cache = cpu.new_cache(8, batch_size=2), backend.new_cache(8, batch_size=2)
    assert cache.groups["local"].n_slots == 4
    for i in range(0, 6, 2):
        assert_logits_match(backend.forward(ids[i:i + 2], cache, 1), cpu.eval(ids[i:i + 2], cpu_cache, logits_from=1))
    assert cache.wrapped
    np.testing.assert_array_equal(cache.device_kv_pos["local"].copy_to_host(), cpu_cache.groups["local"].kv_pos)

    cpu_cache, cache = cpu.new_cache(8), backend.new_cache(8)
    backend.forward(ids[:3], cache, 3)
    cpu.eval(ids[:3], cpu_cache, logits_from=3)
    cache.truncate(1)
    cpu_cache.truncate(1)
    for name, group in cache.groups.items():  # (stale positions would be masked anyway)
        np.testing.assert_array_equal(cache.device_kv_pos[name].copy_to_host(), group.kv_pos)
    fork, cpu_fork = copy.deepcopy(cache), copy.deepcopy(cpu_cache)
    assert_logits_match(backend.forward(ids[3:5], cache, 0), cpu.eval(ids[3:5], cpu_cache))
    # the fork stores other tokens at the same positions; the cache then reads its own
    assert_logits_match(backend.forward(ids[:2], fork, 0), cpu.eval(ids[:2], cpu_fork))
    assert_logits_match(backend.forward(ids[5:], cache, 0), cpu.eval(ids[5:], cpu_cache))


def test_cpu_path_does_not_import_numba_cuda(model_files):
    code = ("import sys, minillm; minillm.load(sys.argv[1]).logits([1, 2]); "
            "assert 'numba.cuda' not in sys.modules, 'numba.cuda was imported'")
    proc = subprocess.run([sys.executable, "-c", code, str(model_files["llama-small-formats"])],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_both_ops_modules_offer_what_the_layers_call():
    """The layer code (arch/llama.py, arch/gemma3.py) is written once over `ops`: every operation
    it calls exists in kernels/cpu/layers.py and kernels/cuda/layers.py with the same parameters."""
    import ast
    import inspect

    from minillm.arch import gemma3, llama
    from minillm.kernels.cpu import layers as cpu_layers

    called = set()
    for layer in (llama.decoder_layer_ops, gemma3.gemma_layer_ops):
        for node in ast.walk(ast.parse(inspect.getsource(layer))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "ops":
                called.add(node.attr)
    assert {"linear", "linear3", "rope_attend", "norm"} <= called

    def parameters(fn):
        return list(inspect.signature(getattr(fn, "py_func", fn)).parameters)

    for name in sorted(called):
        assert parameters(getattr(cpu_layers, name)) == parameters(getattr(cuda_layers, name)), name


def test_skipped_layers_leave_the_same_layers_out_on_both_backends(model_files):
    """The shared forward loop: layer importance's skipped layers apply on CUDA as on the CPU."""
    ids = np.random.default_rng(2).integers(0, TINY["n_vocab"], 3)
    cpu = minillm.load(model_files["llama-small-formats"])
    backend = cuda_backend(model_files["llama-small-formats"])
    cpu.backend.skipped_layers = backend.skipped_layers = frozenset({0})
    skipped = cpu.logits(ids)
    assert_logits_match(backend.forward(ids, backend.new_cache(len(ids)), 0), skipped)
    cpu.backend.skipped_layers = frozenset()
    assert not np.array_equal(cpu.logits(ids), skipped)


def test_caches_and_pools_are_zeroed_on_the_device(model_files, monkeypatch):
    """A scheduler's pool takes most of the free device memory: its zeros (and a cache's) are set
    on the device, never copied over from host memory."""
    backend = cuda_backend(model_files["llama-small-formats"])
    from numba import cuda

    upload = cuda.to_device

    def no_f16_upload(array, *args, **kwargs):
        assert array.dtype != np.float16, "keys or values copied from host memory"
        return upload(array, *args, **kwargs)

    monkeypatch.setattr(cuda, "to_device", no_f16_upload)
    arrays = [*backend.pool_arrays([48, 0], "f16"), *backend.new_cache(32).k]  # new memory: garbage
    assert [a.shape[0] for a in arrays[:2]] == [48, 0] and all(a.dtype == np.float16 for a in arrays)
    assert all(not a.copy_to_host().any() for a in arrays)


def test_a_toolchain_that_cannot_compile_is_one_clear_error(model_files, monkeypatch):
    backend = cuda_backend(model_files["llama-small-formats"])

    def broken(*args):
        raise AttributeError("module 'numpy' has no attribute 'row_stack'")

    monkeypatch.setattr(backend, "forward", broken)
    with pytest.raises(minillm.MinillmError, match=r"do not compile with numba-cuda [\d.]+, numba [\d.]+ and "
                                                   r"numpy [\d.]+ \(AttributeError: .*row_stack"):
        backend.warm_up()


# ---------------------------------------------------------------------------------------------
# decode steps: recorded once per cache, replayed without the layer code
# ---------------------------------------------------------------------------------------------
from minillm.backends import cuda as cuda_backend_module  # noqa: E402
from minillm.kernels.cuda.launch import COUNTS, Replay, kernel_param  # noqa: E402

# a Llama layer's decode step: (the last add +) norm + quantize, q/k/v stacked, RoPE + store,
# attention (its runs, merged and quantized by the last), o, add + norm + quantize, gate/up
# stacked, SwiGLU + quantize, down (biases and scales absent: no launch); then the last add, the
# output norm and its quantization in one launch, and the output product
LAUNCHES_PER_LLAMA_LAYER = 9
LAUNCHES_PER_LLAMA_LAYER_UNSTACKED = 12  # with the tiled kernels (BATCHED): a launch a matrix
LAUNCHES_AFTER_THE_LAYERS = 2


def _counted(step):
    before = dict(COUNTS)
    result = step()
    return result, {key: COUNTS[key] - before.get(key, 0) for key in ("launches", "allocations", "replays")}


@pytest.fixture(scope="module")
def one_layer_q4_0(tmp_path_factory):
    """A one-layer Llama in one format (the real models' shape: one activation kind), its heads
    a 32-group each (as the real models' are whole groups); its last add is taken by the output
    norm, as a layer's by the next layer's."""
    model = SyntheticModel("llama", "Q4_0", n_layer=1, **dict(TINY, head_dim=32)).build()
    return model.write(tmp_path_factory.mktemp("cuda_steps") / "llama-q4_0.gguf")


def test_a_residual_add_is_computed_before_anything_reads_it():
    """add() leaves its sum to the norm taken of it next; any other operation on the sum (or on
    its operands) launches the add first, and a sum nobody keeps is never computed."""
    from numba import cuda

    rng = np.random.default_rng(3)
    x, y = (rng.standard_normal((2, 64)).astype(np.float32) for _ in range(2))
    pool = cuda_layers.BufferPool()
    with cuda_layers.using_pool(pool):
        dy = cuda_layers.add(cuda.to_device(x), cuda.to_device(y))
        np.testing.assert_array_equal(dy.copy_to_host(), y)  # pending: not launched yet
        np.testing.assert_array_equal(cuda_layers.scaled(dy, 2.0).copy_to_host(), (x + y) * np.float32(2))

        _, counts = _counted(lambda: cuda_layers.add(cuda.to_device(x), cuda.to_device(y)))
        cuda_layers.recycle()  # its sum is not kept
        _, counts_after = _counted(lambda: cuda_layers.scaled(cuda.to_device(x), 2.0))
        assert counts["launches"] == 0 and counts_after["launches"] == 1  # the scale alone


def test_the_pool_keeps_a_buffer_whose_rows_a_pending_add_reads():
    pool = cuda_layers.BufferPool()
    held, _ = pool.take((4, 64)), pool.take((4, 64))
    pool.recycle(keep_memory=[held[1:]])  # a view of some of its rows, made outside the pool
    assert len(pool.used) == 1 and pool.used[0][2] is held
    assert [len(buffers) for buffers in pool.free.values()] == [1]  # other's buffer only


def test_decode_steps_replay_a_fixed_count_of_launches_and_allocate_nothing(one_layer_q4_0, monkeypatch):
    """The first step of a cache is recorded (the layer code runs); a later step replays it:
    the same launches, no device allocation, the same logits as the layer code and the CPU."""
    monkeypatch.setattr(cuda_layers, "BATCHED", None)
    path = one_layer_q4_0
    ids = np.random.default_rng(5).integers(0, TINY["n_vocab"], 4)
    cpu = minillm.load(path)
    cpu_cache = cpu.new_cache(8)
    backend = cuda_backend(path)
    cache = backend.new_cache(8)
    assert_logits_match(backend.forward(ids[:2], cache, 1), cpu.eval(ids[:2], cpu_cache, logits_from=1))
    assert cache.step_plan is None  # a prefill records nothing

    logits, recorded = _counted(lambda: backend.forward(ids[2:3], cache, 0))
    assert_logits_match(logits, cpu.eval(ids[2:3], cpu_cache))
    plan = cache.step_plan
    assert recorded["replays"] == 0 and recorded["launches"] == len(plan.replay.launches)
    assert backend.hp.n_layer == 1
    assert len(plan.replay.launches) == LAUNCHES_PER_LLAMA_LAYER + LAUNCHES_AFTER_THE_LAYERS

    logits, replayed = _counted(lambda: backend.forward(ids[3:4], cache, 0))
    assert replayed == {"launches": len(plan.replay.launches), "allocations": 0, "replays": 1}
    assert_logits_match(logits, cpu.eval(ids[3:4], cpu_cache))
    assert cache.step_plan is plan

    # the layer code itself, step by step, on a copy of the prefix: the very same logits
    monkeypatch.setattr(cuda_backend_module, "REPLAY", "off")
    plain_cache = backend.new_cache(8)
    backend.forward(ids[:2], plain_cache, 1)
    plain = [backend.forward(ids[i:i + 1], plain_cache, 0) for i in (2, 3)]
    assert plain_cache.step_plan is None
    np.testing.assert_array_equal(plain[-1], logits)


def test_a_decode_step_is_recorded_again_when_the_layers_change(model_files, monkeypatch):
    monkeypatch.setattr(cuda_layers, "BATCHED", None)
    path = model_files["llama-small-formats"]
    backend = cuda_backend(path)
    cache = backend.new_cache(8)
    backend.forward(np.array([1]), cache, 0)
    first = cache.step_plan
    backend.skipped_layers = frozenset({0})
    _, counts = _counted(lambda: backend.forward(np.array([2]), cache, 0))
    assert counts["replays"] == 0 and cache.step_plan is not first
    assert len(cache.step_plan.replay.launches) == LAUNCHES_AFTER_THE_LAYERS  # no layer left
    fork = copy.deepcopy(cache)
    assert fork.step_plan is None  # its launches would read the original's arrays


def test_replay_modes_are_checked(model_files, monkeypatch):
    with pytest.raises(ValueError, match="replay mode 'fast'"):
        Replay([], None, "fast")
    assert Replay([], None, "graph").mode == "direct"  # the simulator has no driver to capture with
    monkeypatch.setattr(cuda_backend_module, "REPLAY", "fast")
    with pytest.raises(minillm.MinillmError, match="MINILLM_CUDA_REPLAY='fast'"):
        cuda_backend(model_files["llama-small-formats"])


def _cuda_core_param_holder():
    """cuda.core's packer of kernel arguments (what numba-cuda's own launch goes through)."""
    import importlib

    for name in ("cuda.core._kernel_arg_handler", "cuda.core.experimental._kernel_arg_handler"):
        try:
            return importlib.import_module(name).ParamHolder
        except ImportError:
            continue
    pytest.fail("cuda.core's ParamHolder is not where numba-cuda 0.30's cuda.core keeps it")


def test_prepared_launches_pack_arguments_as_cuda_core_does():
    """A prepared replay (and the graph captured from it) hands the driver numba-cuda's marshalled
    arguments itself, so they must be the bytes numba-cuda's own launch gives the kernel through
    cuda.core. _prepare_args leaves an array's meminfo, parent, size, itemsize, pointer, shape and
    strides as Python ints (intptr_t) and a boolean as a Python bool; the rest are ctypes scalars."""
    import ctypes

    marshalled = [0, 0, 6, 4, 0x7F12_3456_7000, 2, 3, 12, -4, True, False,
                  ctypes.c_int32(-3), ctypes.c_uint32(7), ctypes.c_int64(-2**40), ctypes.c_float(0.5),
                  ctypes.c_double(-1.25), ctypes.c_uint16(0x3C00), ctypes.c_uint8(9)]
    ours = [kernel_param(value) for value in marshalled]
    holder = _cuda_core_param_holder()(marshalled)
    theirs = (ctypes.c_void_p * len(marshalled)).from_address(holder.ptr)
    for value, mine, address in zip(marshalled, ours, theirs):
        if type(value) is int:
            assert ctypes.sizeof(mine) == 8, value  # intptr_t
        elif type(value) is bool:
            assert ctypes.sizeof(mine) == 1, value
        assert bytes(mine) == ctypes.string_at(address, ctypes.sizeof(mine)), value
    with pytest.raises(TypeError, match="str"):
        kernel_param("7")


def test_a_graph_is_captured_with_frees_held_and_freed_after(monkeypatch):
    """Replay's capture against a stand-in driver (the simulator has none): the prepared launches
    are captured between begin and end while numba's deferred frees are held (a free would
    invalidate the capture), the captured graph is destroyed once instantiated, and the
    executable one when its Replay goes."""
    import contextlib
    import gc
    import types

    from numba.cuda.cudadrv import driver as driver_module

    from minillm.kernels.cuda import launch as launch_module

    calls, holding = [], [False]

    class StandInDriver:  # records the stream, launch and graph calls (on a GPU, frees pass by too)
        def __getattr__(self, name):
            def call(*args):
                if name.startswith(("cuStream", "cuLaunch", "cuGraph")):
                    calls.append((name, holding[0]))
                return {"cuStreamEndCapture": "graph", "cuGraphInstantiate": "executable"}.get(name)
            return call

    @contextlib.contextmanager
    def held():
        holding[0] = True
        yield
        holding[0] = False

    monkeypatch.setattr(driver_module, "driver", StandInDriver())
    monkeypatch.setattr(launch_module.cuda, "defer_cleanup", held, raising=False)
    replay = Replay([], None, "direct")
    replay.stream = types.SimpleNamespace(handle="stream")
    replay._prepared = [types.SimpleNamespace(issue=lambda driver, handle: driver.cuLaunchKernel(handle))] * 2
    assert replay._capture() == "executable"
    assert calls == [("cuStreamBeginCapture", True), ("cuLaunchKernel", True), ("cuLaunchKernel", True),
                     ("cuStreamEndCapture", True), ("cuGraphInstantiate", False), ("cuGraphDestroy", False)]
    del replay
    gc.collect()
    assert calls[-1] == ("cuGraphExecDestroy", False)


def test_gpu_check_compares_the_replay_modes(one_layer_q4_0):
    """make gpu-check's comparison of the ways to replay a step runs (under the simulator every
    mode replays directly) and finds the layer code's logits in each."""
    from minillm.cli import gpu_check

    model = minillm.load(one_layer_q4_0, device="cuda")
    result = gpu_check.compare_replay_modes(model, n_steps=2, n_prompt=2)  # a recorded step, a replayed one
    assert result["ok"] and result["off"].get("used") is None
    for mode in ("direct", "prepared", "graph"):
        expected = "direct" if not cuda_env.REAL_GPU else mode
        assert result[mode]["used"] == expected and result[mode]["max_abs_diff_vs_off"] == 0.0
        per_layer = LAUNCHES_PER_LLAMA_LAYER_UNSTACKED if cuda_layers.BATCHED else LAUNCHES_PER_LLAMA_LAYER
        assert result[mode]["launches_per_step"] == per_layer + LAUNCHES_AFTER_THE_LAYERS


@pytest.mark.parametrize("name", ["llama-k-quants", "gemma3-global-k-quants"])
def test_quantized_weights_take_the_files_bytes_on_the_device(model_files, name):
    """The blocks are uploaded as the file holds them (no widening to int8 codes and float
    scales): the device's weights are the file's tensor bytes, less the host's embedding table
    where the output matrix is a tensor of its own."""
    backend = cuda_backend(model_files[name])
    tensors = backend.arch.gguf.tensors
    on_device = sum(t.n_bytes for name, t in tensors.items()
                    if name != "token_embd.weight" or backend.output_name == "token_embd.weight")
    assert backend.weight_bytes() == on_device


# ---------------------------------------------------------------------------------------------
# the batching scheduler's rows on the GPU
# ---------------------------------------------------------------------------------------------
def test_rows_of_a_mixed_batch_equal_each_sequence_alone_on_the_gpu(model_files):
    """forward_rows on the CUDA backend: prompt chunks and decode rows of three sequences in one
    pass, their cells in a paged pool on the device; every row's logits are what evaluating its
    sequence alone, one token a call, gives on the GPU, bit for bit (and the CPU's, within the
    tolerance)."""
    from test_batch_rows import lone_logits, run_schedule

    from minillm.serving.kv_pool import KVPool

    path = model_files["llama-small-formats"]
    model = minillm.load(path, device="cuda")
    rng = np.random.default_rng(9)
    seqs = {0: rng.integers(0, TINY["n_vocab"], 4), 1: rng.integers(0, TINY["n_vocab"], 3),
            2: rng.integers(0, TINY["n_vocab"], 2)}
    pool = KVPool(model.backend, n_seqs=3, n_ctx=8, n_cells=48, n_batch=4)
    steps = [[(0, 3), (1, 2)], [(1, 1), (0, 1), (2, 2)]]
    got = run_schedule(model, pool, seqs, steps)
    cpu = minillm.load(path)
    for s, ids in seqs.items():
        n = len(got[s])
        rows = np.array([got[s][p] for p in range(n)])
        np.testing.assert_array_equal(rows, lone_logits(model, ids[:n]))
        assert_logits_match(rows, lone_logits(cpu, ids[:n]))


def test_a_step_of_prompt_rows_only_launches_nothing_over_zero_rows(model_files):
    """A scheduler step whose rows all continue prompts (no row wants logits: out_from = T)
    gives no logits, and its last layer launches nothing over the zero rows it keeps (a grid
    of no blocks, which CUDA refuses)."""
    from minillm.kernels.cuda.launch import recording
    from minillm.serving.kv_pool import KVPool

    model = minillm.load(model_files["llama-small-formats"], device="cuda")
    pool = KVPool(model.backend, n_seqs=1, n_ctx=8, n_cells=16, n_batch=4)
    pool.assign(0, pool.blocks_needed(0, 0, 3))
    positions = np.arange(3, dtype=np.int64)
    kv_of = pool.batch_kv(np.zeros(3, np.int64), positions)
    with recording() as launches:
        logits = model.backend.forward_rows(np.array([1, 2, 3]), positions, kv_of, 3, pool.n_ctx)
    assert logits.shape[0] == 0
    assert launches and all(min(np.atleast_1d(item.grid)) > 0 for item in launches)


@pytest.fixture(scope="module")
def vocab_model(tmp_path_factory):
    """A one-layer Q4_0 Llama on the CUDA backend, with a vocabulary (the scheduler detokenizes;
    it needs the 256 byte tokens)."""
    path = SyntheticModel("llama", "Q4_0", n_layer=1, vocab=True, **dict(TINY, n_vocab=260)).build().write(
        tmp_path_factory.mktemp("cuda_vocab") / "llama-vocab.gguf")
    return minillm.load(path, device="cuda")


def test_gpu_check_compares_the_tensor_core_products_with_the_others(vocab_model, monkeypatch):
    """make gpu-check's MMA stage runs prefill and the scheduler's rows each way, and finds the
    same logits both ways (test_cuda_kernels checks each format's products bit for bit). The
    scheduler's run is timed by bench's _parallel_run, which test_cli runs; here it reports
    which products it had (a scheduler run costs ~16 s under the simulator)."""
    from minillm.cli import bench, gpu_check
    from minillm.kernels.cuda import matmul

    launched, parallel_runs = [], []

    def launch(kernel, *args):
        launched.append(kernel)
        real_launch(kernel, *args)

    def parallel_run(model, rng, n_seq, n_prompt, n_gen):
        parallel_runs.append((matmul.MMA, n_seq, n_prompt, n_gen))
        return 1.0, 0.5

    real_launch = matmul.launch
    monkeypatch.setattr(matmul, "launch", launch)
    monkeypatch.setattr(bench, "_parallel_run", parallel_run)
    result = gpu_check.compare_mma(vocab_model, n_prompt=2, n_logits=3, n_seq=4, seq_tokens=3)
    assert result["ok"] and result["max_abs_diff"] == 0.0 and result["mma_pp2_tokens_per_s"] > 0
    assert result["mma_s_tg4_tokens_per_s"] == result["tiled_s_tg4_tokens_per_s"] == 4 * 3 / 0.5
    assert parallel_runs == [(False, 4, 3, 3), (True, 4, 3, 3)]
    assert matmul.qmatmul_mma_kernel in launched and matmul.qmatmul_tiled_kernel in launched
    assert matmul.MMA is False  # put back


def test_the_scheduler_on_the_gpu_gives_a_request_the_same_tokens_in_any_batch(vocab_model):
    """Model.scheduler on a CUDA model, as make gpu-check checks it on a GPU: a request alone and
    inside batches of 2, 7 and 16 (16 on 8 slots: some join later) gets the same sampled tokens
    and logprobs."""
    from minillm.cli import gpu_check

    assert gpu_check.batch_invariance(vocab_model, sizes=(2, 7, 16), max_tokens=2, prompt_tokens=1, n_ctx=8)


def test_prefix_reuse_on_the_gpu_gives_the_tokens_of_a_fresh_run(vocab_model):
    """A prompt that extends a finished one reuses its cells (the pool's kv_pos, kept on the host
    and uploaded each step, forgets the rest) and gets what a fresh scheduler gives it."""
    from minillm.sampling import SamplingParams
    from minillm.serving.scheduler import Request

    greedy = SamplingParams(temperature=0)
    scheduler = vocab_model.scheduler(parallel=1, n_ctx=16)
    first = scheduler.submit(Request([5, 6, 7, 8], 1, greedy, ignore_eos=True)).result()
    follow = Request([5, 6, 7, 8] + first.tokens + [9], 2, greedy, ignore_eos=True, logprobs=1)
    h = scheduler.submit(follow)
    reused = [(c.token, c.logprobs) for c in h if c.token is not None]
    assert h.n_cached >= 4
    fresh = vocab_model.scheduler(parallel=1, n_ctx=16).submit(follow)
    assert reused == [(c.token, c.logprobs) for c in fresh if c.token is not None] and len(reused) == 2


def test_speculative_rows_on_the_gpu_equal_each_token_alone(model_files):
    """forward_each_alone on the CUDA backend (speculative verification): three rows after a
    prefill, each bit for bit what evaluating its token alone gives on the GPU, and the CPU's
    forward_each_alone within the tolerance."""
    path = model_files["llama-small-formats"]
    ids = np.random.default_rng(11).integers(0, TINY["n_vocab"], 6)
    backend = cuda_backend(path)
    cache, lone_cache = backend.new_cache(8), backend.new_cache(8)
    backend.forward(ids[:3], cache, 2)
    backend.forward(ids[:3], lone_cache, 2)
    rows = backend.forward_each_alone(ids[3:], cache)
    lone = np.concatenate([backend.forward(ids[i:i + 1], lone_cache, 0) for i in range(3, 6)])
    np.testing.assert_array_equal(rows, lone)
    assert cache.n_past == 6
    np.testing.assert_array_equal(cache.device_kv_pos["global"].copy_to_host(), lone_cache.groups["global"].kv_pos)
    cpu = minillm.load(path)
    cpu_cache = cpu.new_cache(8)
    cpu.eval(ids[:3], cpu_cache)
    assert_logits_match(rows, cpu.backend.forward_each_alone(ids[3:], cpu_cache))


def test_scheduler_decode_steps_replay_their_recording_and_allocate_nothing(model_files, monkeypatch):
    """A step whose rows all want logits is padded to a power of two and recorded once per row
    count; later steps of that count replay it (one replay, no device allocation) and give what
    the layer code gives each step (MINILLM_CUDA_REPLAY=off), bit for bit."""
    from minillm.serving.kv_pool import KVPool

    path = model_files["llama-small-formats"]
    rng = np.random.default_rng(12)
    seqs = {s: rng.integers(0, TINY["n_vocab"], 5) for s in range(3)}
    steps = [[(0, 1), (1, 1), (2, 1)]] * 3 + [[(0, 1), (2, 1)]]  # 3 rows (padded to 4), then 2

    def run(replay: str):
        monkeypatch.setattr(cuda_backend_module, "REPLAY", replay)
        model = minillm.load(path, device="cuda")
        pool = KVPool(model.backend, n_seqs=3, n_ctx=8, n_cells=48, n_batch=4)
        counts = []
        done = {s: 0 for s in seqs}
        out = []
        for step in steps:
            rows = []
            for s, n in step:
                pool.assign(s, pool.blocks_needed(s, done[s], done[s] + n))
                rows.append((s, done[s], seqs[s][done[s]]))
                done[s] += n
            rows = np.array(rows, np.int64)
            kv_of = pool.batch_kv(rows[:, 0].copy(), rows[:, 1].copy())
            logits, counted = _counted(lambda: model.backend.forward_rows(rows[:, 2].copy(), rows[:, 1].copy(),
                                                                          kv_of, 0, pool.n_ctx))
            out.append(logits)
            counts.append(counted)
        return out, counts

    replayed, counts = run("auto")
    assert [c["replays"] for c in counts] == [0, 1, 1, 0]  # 4 rows recorded, replayed; 2 rows recorded
    assert counts[1]["allocations"] == counts[2]["allocations"] == 0
    assert counts[1]["launches"] == counts[0]["launches"]
    plain, _ = run("off")
    for got, want in zip(replayed, plain):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("arch,extra,reason", [
    ("qwen35", dict(rope_dims=8, keys={"rope.dimension_sections": [2, 1, 1, 0]}), "recurrent layers beside attention"),
    ("lfm2", {}, "recurrent layers beside attention"),
    ("granitehybrid", dict(ssm=dict(N=16, G=1, Hs=4)), "recurrent layers beside attention"),
    ("mistral3", dict(n_layer=1, keys={"attention.temperature_scale": 0.1}), "Llama 4's attention temperature"),
    ("qwen3moe", dict(n_layer=1, moe=dict(X=4, K=2, F=32)), "a mixture of experts"),
])
def test_what_the_cuda_path_does_not_compute_is_refused_by_name(tmp_path, arch, extra, reason):
    """The CPU's kernels only (recurrent layers, Mistral 3's temperature, experts): one clear
    error, before any upload."""
    model = dict(dict(n_layer=4, n_embd=64, head_dim=16, n_ff=64, n_vocab=40), **extra)
    path = SyntheticModel(arch, "Q8_0", **model).build().write(tmp_path / f"{arch}.gguf")
    with pytest.raises(minillm.MinillmError, match=f"{arch} models \\({reason}\\) run on the CPU only"):
        CudaBackend(get_architecture(arch)(GGUFFile(path)))
