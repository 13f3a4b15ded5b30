"""Every CUDA kernel of this package, registered with the signatures it is checked for.

Kernels are declared with `@kernel(signature, ...)` instead of a bare `@cuda.jit`: the decorator
records the Python function and its signatures in KERNELS, so that `ptx_check` compiles each
one to real PTX (and the tests run it) without a list to keep up by hand. The kernels
themselves stay lazily compiled: a launch compiles for the argument types it is given.

Kernels are cached on disk (numba-cuda's cache, per compute capability, in __pycache__ or the
user's cache folder), keyed to every source they are compiled from (kernels/cache_stamp.py):
a process after the first loads them instead of compiling them. Not under the simulator.

Device helpers are declared with `@device` (a plain `cuda.jit(device=True)`); they are compiled
as part of every kernel that calls them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from numba import cuda
from numba.core import config

from ..cache_stamp import install_cuda

PACKAGE = __name__.rsplit(".", 2)[0]  # minillm.kernels


def _compile_without_contraction() -> None:
    """NVVM fuses a multiply and an add into one fma by default (-fma=1): one rounding where the
    source has two, so a kernel computes other bits than the simulator runs and than the CPU
    kernels it is written to match (an fma of the CPU's is written fma32). This package's
    kernels compile with -fma=0, under which NVVM writes mul.rn/add.rn, which ptxas does not
    fuse either (ptx_check checks that no fusable instruction is left). numba-cuda has no option
    for it: the compile_cuda its dispatcher and compile_ptx call adds it for functions of this
    package only (a kernel's device functions compile with the kernel's options)."""
    import numba.cuda.compiler as compiler
    import numba.cuda.dispatcher as dispatcher

    numba_compile_cuda = compiler.compile_cuda
    if getattr(numba_compile_cuda, "_minillm", False):
        return

    def compile_cuda(pyfunc, *args, nvvm_options=None, **kwargs):
        if nvvm_options is not None and getattr(pyfunc, "__module__", "").startswith(PACKAGE + "."):
            nvvm_options = {**nvvm_options, "fma": False}
        return numba_compile_cuda(pyfunc, *args, nvvm_options=nvvm_options, **kwargs)

    compile_cuda._minillm = True
    compiler.compile_cuda = dispatcher.compile_cuda = compile_cuda


CACHE = not config.ENABLE_CUDASIM and install_cuda()  # (before any kernel is declared)
if not config.ENABLE_CUDASIM:
    _compile_without_contraction()


@dataclass(frozen=True)
class KernelSpec:
    name: str
    pyfunc: Callable            # the undecorated Python function
    signatures: tuple[str, ...]  # numba signatures, e.g. "void(float32[:, ::1], int64)"


KERNELS: dict[str, KernelSpec] = {}


def kernel(*signatures: str):
    """Declare a CUDA kernel; each signature is compiled to PTX by ptx_check."""
    if not signatures:
        raise ValueError("a kernel needs at least one signature to check")

    def register(pyfunc):
        name = pyfunc.__name__
        if name in KERNELS:
            raise ValueError(f"two CUDA kernels are named {name}")
        KERNELS[name] = KernelSpec(name, pyfunc, tuple(signatures))
        return cuda.jit(pyfunc, cache=CACHE)

    return register


def device(pyfunc):
    """Declare a device function (callable from kernels only)."""
    return cuda.jit(device=True)(pyfunc)
