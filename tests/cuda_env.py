"""Chooses how the CUDA kernel tests run: under NVIDIA's CUDA simulator (the default, no GPU
needed) or on a real GPU when MINILLM_CUDA_REAL=1.

numba reads NUMBA_ENABLE_CUDASIM when numba itself is imported (numba.cuda's config is numba's),
which other tests do first; so `use_simulator_unless_real()` sets the variable and reloads the
config, and must run before the first `import numba.cuda`.
"""
from __future__ import annotations

import contextlib
import os
import sys

import pytest

REAL_GPU = os.environ.get("MINILLM_CUDA_REAL") == "1"


def use_simulator_unless_real() -> None:
    if REAL_GPU:
        os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    else:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    if "numba" in sys.modules:
        from numba.core import config

        config.reload_config()
        if "numba.cuda" in sys.modules and bool(config.ENABLE_CUDASIM) == REAL_GPU:
            raise RuntimeError("numba.cuda was imported before the CUDA test mode was chosen")


def poison_simulated_memory() -> None:
    """Under the simulator, device arrays start as garbage, as a GPU's do: NaN where they hold
    floats, 0xA5 bytes elsewhere. The simulator's own come from numpy, often zeros, so a kernel
    that read a value nothing wrote (a buffer the pool hands out again, padding) could pass by
    luck there and fail on a GPU."""
    if REAL_GPU:
        return
    import numpy as np
    from numba import cuda
    from numba.cuda.simulator.cudadrv import devicearray

    fresh = getattr(devicearray.device_array, "__wrapped__", devicearray.device_array)

    def device_array(*args, **kwargs):
        array = fresh(*args, **kwargs)
        values = array._ary  # the simulator's numpy array
        if values.size:
            if values.dtype.kind == "f":
                values.fill(np.nan)
            else:
                values.reshape(-1).view(np.uint8).fill(0xA5)
        return array

    device_array.__wrapped__ = fresh
    devicearray.device_array = cuda.device_array = device_array  # device_array_like calls the first


KERNEL_MODULES = ("attention", "layers", "matmul", "norm_quant", "ops")  # those that launch kernels


@contextlib.contextmanager
def launched_signatures():
    """The set of (kernel name, argument types) of every launch inside, the types as numba
    types its dispatcher would compile for: the kernel modules' `launch` is wrapped meanwhile
    (an enclosing launched_signatures sees none of the launches inside this one)."""
    import importlib

    import numba

    from minillm.kernels.cuda import launch as launch_module

    seen = set()
    issue = launch_module.launch

    def typed(value):
        ty = numba.typeof(value)
        if isinstance(ty, numba.types.Array) and value.size == 0:  # the simulator types an empty
            ty = ty.copy(layout="C")                                # array 'A', a GPU's 'C'
        return ty

    def launch(kernel, grid, block, *args):
        pyfunc = getattr(kernel, "py_func", None) or kernel.fn  # a GPU's dispatcher, the simulator's
        seen.add((pyfunc.__name__, tuple(typed(a) for a in args)))
        return issue(kernel, grid, block, *args)

    modules = [importlib.import_module(f"minillm.kernels.cuda.{name}") for name in KERNEL_MODULES]
    outer = [module.launch for module in modules]  # (an enclosing one's wrapper sees none of these)
    for module in modules:
        module.launch = launch
    try:
        yield seen
    finally:
        for module, previous in zip(modules, outer):
            module.launch = previous


def undeclared_signatures(seen) -> list[str]:
    """Those of launched_signatures() that no @kernel signature declares (ptx_check compiles the
    declared ones; any other would first be compiled on a GPU)."""
    from numba.core import sigutils

    from minillm.kernels.cuda import KERNELS

    declared = {(name, sigutils.normalize_signature(sig)[0]) for name, spec in KERNELS.items()
                for sig in spec.signatures}
    return sorted(f"{name}{types}" for name, types in seen if (name, types) not in declared)


@pytest.fixture(scope="module", autouse=True)
def every_launch_is_a_signature_ptx_check_compiles():
    """A kernel launched with argument types that no @kernel signature declares would first be
    compiled on a GPU, never by ptx_check here: every launch of a CUDA test file's tests must be
    declared (the files import this fixture)."""
    with launched_signatures() as seen:
        yield
    undeclared = undeclared_signatures(seen)
    assert not undeclared, f"launched with undeclared signatures: {undeclared}"


def environment_for_ptx_check() -> dict[str, str]:
    """The environment of a subprocess that compiles to real PTX (no simulator)."""
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env
