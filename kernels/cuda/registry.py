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

CACHE = not config.ENABLE_CUDASIM and install_cuda()  # (before any kernel is declared)


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
