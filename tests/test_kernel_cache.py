"""Cached kernels load without parsing their bitcode (kernels/cpu/lazy_cache.py), and a function
compiled later can still link against one loaded that way."""
import os
import subprocess
import sys

import pytest

import cuda_env

from minillm.kernels.cpu.lazy_cache import elf_defined_symbols

PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
import minillm.kernels.cpu  # installs the lazy loading
import numba
import cached_mod

assert cached_mod.add_one(1) == 2
library = cached_mod.add_one.overloads[cached_mod.add_one.signatures[0]].library
bitcode_left_unparsed = getattr(library, "_minillm_bitcode", None) is not None

@numba.njit
def twice_plus_two(x):  # compiled now: links add_one's library, parsing its bitcode
    return cached_mod.add_one(x) * 2

assert twice_plus_two(1) == 4
print(bitcode_left_unparsed, sum(cached_mod.add_one.stats.cache_hits.values()))
"""


def _probe(script: str, tmp_path, *args: str) -> list[str]:
    """The words a new process running script prints (its argv: tmp_path, then args), with
    Numba's cache in tmp_path/cache."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path), *args], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    return out.stdout.split()


def test_cached_kernel_loads_lazily_and_still_links(tmp_path):
    (tmp_path / "cached_mod.py").write_text(
        "import numba\n\n@numba.njit(cache=True)\ndef add_one(x):\n    return x + 1\n")
    assert _probe(PROBE, tmp_path) == ["False", "0"]  # compiled and cached
    assert _probe(PROBE, tmp_path) == ["True", "1"]   # loaded from the cache, bitcode untouched until linked


def test_elf_symbols_are_the_defined_ones():
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    module = llvm.parse_assembly("""
        @table = global [4 x i32] zeroinitializer
        declare i32 @external_helper(i32)
        define i32 @probe(i32 %x) {
          %y = call i32 @external_helper(i32 %x)
          ret i32 %y
        }
        define internal i32 @inner(i32 %x) {
          ret i32 %x
        }
        define i32 @uses_inner(i32 %x) {
          %y = call i32 @inner(i32 %x)
          ret i32 %y
        }""")
    machine = llvm.Target.from_triple(llvm.get_process_triple()).create_target_machine(codemodel="default")
    symbols = elf_defined_symbols(machine.emit_object(module))
    if sys.platform.startswith("linux"):
        assert {"probe", "uses_inner", "table"} <= symbols and "external_helper" not in symbols
    assert elf_defined_symbols(b"\xcf\xfa\xed\xfe" + bytes(60)) is None  # Mach-O: Numba's own path


PARALLEL_CALLEE = """
import sys
sys.path.insert(0, sys.argv[1])
import minillm.kernels.cpu  # installs the lazy loading
import numpy as np
import cached_caller

function = getattr(cached_caller, sys.argv[2])
print(function(np.arange(8.0))[0], sum(function.stats.cache_hits.values()))
"""


def test_a_cached_function_calling_a_parallel_one_loads_first_in_a_process(tmp_path):
    """A cached function that calls a parallel=True one through another, compiled while that
    other was loaded from the cache (as layers.quantize, over matmul's quantize_act and its
    parallel quantizer), then loaded from the cache before any parallel kernel ran in a
    process: its call into the threading layer jumped to address 0 (numba issues 8578, 9938)
    until loading it started the layer."""
    (tmp_path / "cached_caller.py").write_text(
        "import numba\nimport numpy as np\n\n"
        "@numba.njit(parallel=True, cache=True)\ndef inner(x):\n    return np.zeros(x.size) + x.sum()\n\n"
        "@numba.njit(cache=True)\ndef middle(x):\n    return inner(x)\n\n"
        "@numba.njit(cache=True)\ndef outer(x):\n    return middle(x) + 1\n")
    assert _probe(PARALLEL_CALLEE, tmp_path, "middle") == ["28.0", "0"]  # compiled and cached
    assert _probe(PARALLEL_CALLEE, tmp_path, "outer") == ["29.0", "0"]   # compiled, middle loaded from the cache
    assert _probe(PARALLEL_CALLEE, tmp_path, "outer") == ["29.0", "1"]   # loaded from the cache, first in its process


def test_cached_kernels_are_keyed_to_every_source_compiled_code_comes_from(monkeypatch):
    """A kernel's cache entry records, beside its own file's hash, a digest of all the sources
    compiled code is made of (kernels/cache_stamp.py): when any of them changes (simd.py
    under matmul.py's kernels, say), the entry no longer matches and the kernel compiles again."""
    import numpy as np

    from minillm.kernels import cache_stamp
    from minillm.kernels.cpu import layers

    x = np.ones((1, 32), np.float32)
    layers.quantize(x, 0)  # compiled or loaded, and in the cache either way
    cache_file = layers.quantize._cache._cache_file
    own_hash, digest = cache_file._source_stamp
    assert digest == cache_stamp.source_digest() and cache_file._load_index()
    monkeypatch.setattr(cache_file, "_source_stamp", (own_hash, "the digest of other sources"))
    assert cache_file._load_index() == {}


def test_arrays_the_kernels_allocate_start_on_a_cache_line():
    """Importing the kernels makes Numba align the arrays it allocates to 64 bytes (Numba's own
    is 32, and about half of the arrays below then start 32 bytes off a line): a 64-byte vector
    load from such a row touches two cache lines."""
    import numba as nb
    import numpy as np

    import minillm.kernels.cpu  # noqa: F401

    @nb.njit(parallel=True)
    def offsets(n):
        kept = [np.empty(0, np.float32) for _ in range(0)]  # all alive at once
        off = np.empty(48, np.int64)
        for i in range(40):
            kept.append(np.empty(n + 3 * i, np.float32))
            off[i] = kept[-1].ctypes.data % 64
        for i in nb.prange(8):  # in a parallel region too
            off[40 + i] = np.empty(n + i, np.int8).ctypes.data % 64
        return off

    for n in (5, 1000, 70_000):
        assert not offsets(n).any()


CUDA_STAMP_PROBE = """
from minillm.kernels import cache_stamp
from minillm.kernels.cuda import matmul, registry

own_stamp, digest = matmul.qmatvec_kernel._cache._cache_file._source_stamp
sources = cache_stamp.source_digest(cache_stamp.CUDA_SOURCES)
print(registry.CACHE, digest.startswith(sources), digest[len(sources):])
"""


def test_cuda_kernels_are_cached_and_keyed_to_every_cuda_source_and_the_ggml_build():
    """With numba-cuda's real target (no simulator; no GPU needed to declare kernels) every
    kernel is cached on disk, its entries stamped with the digest of the CUDA sources, as the
    CPU's are with theirs, and with the host's ggml build (the kernels sum as it does; Numba
    keeps its CPU cache per CPU, but a CUDA cache moved to another host would load code that
    sums as the first host's build)."""
    from test_avx2_build import HASWELL

    from minillm.kernels.cpu.ops import GGML_AVX512

    def stamp(**env) -> list[str]:
        proc = subprocess.run([sys.executable, "-c", CUDA_STAMP_PROBE], capture_output=True, text=True,
                              env={**cuda_env.environment_for_ptx_check(), **env}, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout.split()

    assert stamp() == ["True", "True", "-avx512" if GGML_AVX512 else "-avx2"]
    assert stamp(**HASWELL) == ["True", "True", "-avx2"]


CUDA_PICKLE_PROBE = """
import pickle

import numba.cuda.codegen as codegen
import numba.cuda.dispatcher as dispatcher
from numba.core import sigutils
from numba.cuda.serialize import dumps

from minillm.kernels.cuda import KERNELS, ptx_check

# no GPU: the compute capability is given, not asked of a device
codegen.CUDACodeLibrary._ensure_cc = lambda self, cc: cc or (9, 0)
n = 0
with ptx_check._assume_device((9, 0)):
    for spec in KERNELS.values():
        for sig in spec.signatures:
            kernel = dispatcher._Kernel(spec.pyfunc, sigutils.normalize_signature(sig)[0])
            rebuilt = dispatcher._Kernel._rebuild(**pickle.loads(dumps(kernel._reduce_states())))
            assert rebuilt.entry_name == kernel.entry_name
            n += 1
print(n)
"""


def test_every_cuda_kernel_can_be_saved_to_the_cache():
    """numba-cuda saves a kernel to its cache right after compiling it, unguarded: a kernel it
    cannot serialize (one that refers to a global device array, or links other files) would
    fail its first launch on a GPU. Each kernel's compiled state goes through the cache's
    serialization and back here (numba-cuda's internals, as its cache calls them; the cubin
    part needs a GPU)."""
    from minillm.kernels.cuda import KERNELS

    proc = subprocess.run([sys.executable, "-c", CUDA_PICKLE_PROBE], capture_output=True, text=True,
                          env=cuda_env.environment_for_ptx_check(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert int(proc.stdout.split()[-1]) == sum(len(spec.signatures) for spec in KERNELS.values())


def test_each_backend_recompiles_only_for_its_own_sources(tmp_path, monkeypatch):
    """An edit under kernels/cuda changes the CUDA kernels' digest and leaves the CPU's alone
    (a CPU recompile takes minutes); one under kernels/cpu changes both (the CUDA kernels take
    constants from it)."""
    from minillm.kernels import cache_stamp

    kernels, package = tmp_path / "kernels", tmp_path / "minillm"
    for path in (kernels / "cpu" / "ops.py", kernels / "cuda" / "matmul.py", package / "arch" / "llama.py"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("X = 1\n")
    monkeypatch.setattr(cache_stamp, "_roots", lambda: (kernels, package))

    def digests():
        return cache_stamp.source_digest(cache_stamp.CPU_SOURCES), cache_stamp.source_digest(cache_stamp.CUDA_SOURCES)

    cpu, gpu = digests()
    (kernels / "cuda" / "matmul.py").write_text("X = 2\n")
    assert digests()[0] == cpu and digests()[1] != gpu
    cpu, gpu = digests()
    (kernels / "cpu" / "ops.py").write_text("X = 2\n")
    assert digests()[0] != cpu and digests()[1] != gpu


@pytest.mark.parametrize("siblings", [False, True])
@pytest.mark.parametrize("warm_up_first", [True, False])
def test_a_first_runs_products_compile_in_another_process_beside_the_layer(monkeypatch, warm_up_first, siblings):
    """On a first run with two cores the products compile in a second process while this one
    compiles the layer (here both are cached, so each only loads): the matrices pack without
    addresses, get them once that process is done (at warm_up, or at a pass before it), and
    the logits are those of a model loaded the usual way. siblings: `warm --all`'s layer tasks,
    whose products other tasks compile (no process of its own)."""
    import numpy as np

    from conftest import loaded_model, model_path
    from minillm.backends import cpu
    from minillm.model import Model

    compiled_for = []
    monkeypatch.setattr(cpu, "_layer_cached", lambda layer_function: False)
    monkeypatch.setattr(cpu, "products_ready", lambda quantized, float_formats: False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    if siblings:
        monkeypatch.setenv("MINILLM_COMPILE_ELSEWHERE", "siblings")
    model = Model(model_path("smollm2"))
    backend = model.backend
    assert backend._products_elsewhere is not None and backend.output[-2:] == (0, 0)
    assert (backend._products_elsewhere.process is None) == siblings
    real_compile = backend.layer_function.compile
    monkeypatch.setattr(backend.layer_function, "compile", lambda sig: compiled_for.append(sig) or real_compile(sig))
    if warm_up_first:
        model.warm_up()
        assert len(compiled_for) == 1
    ids = np.array([1, 504, 3458, 314])
    logits = model.eval(ids, model.new_cache(8), logits_from=0)
    assert backend._products_elsewhere is None and all(backend.output[-2:])
    assert np.array_equal(logits, loaded_model("smollm2").eval(ids, loaded_model("smollm2").new_cache(8), logits_from=0))
    assert len(backend.layer_function.overloads) == 1  # compiled for the types the passes use


def test_a_layer_task_waits_until_its_siblings_products_are_cached(monkeypatch):
    """ProductsElsewhere(siblings=True).join polls the cache until the products and attention
    the other tasks compile are there."""
    import numpy as np

    from minillm import weights
    from minillm.formats import FORMATS_BY_NAME

    answers = iter([False, False, True])
    monkeypatch.setattr(weights, "products_ready", lambda quantized, float_formats: next(answers))
    monkeypatch.setattr(weights, "attention_fn_cached", lambda dtype: True)
    monkeypatch.setattr(weights.time, "sleep", lambda seconds: None)
    elsewhere = weights.ProductsElsewhere({(FORMATS_BY_NAME["Q8_0"], 64)}, np.uint16, siblings=True)
    assert elsewhere.process is None
    elsewhere.join()
    assert next(answers, "asked three times") == "asked three times"
