"""Chooses how the CUDA kernel tests run: under NVIDIA's CUDA simulator (the default, no GPU
needed) or on a real GPU when MINILLM_CUDA_REAL=1.

numba reads NUMBA_ENABLE_CUDASIM when numba itself is imported (numba.cuda's config is numba's),
which other tests do first; so `use_simulator_unless_real()` sets the variable and reloads the
config, and must run before the first `import numba.cuda`.
"""
from __future__ import annotations

import os
import sys

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


def environment_for_ptx_check() -> dict[str, str]:
    """The environment of a subprocess that compiles to real PTX (no simulator)."""
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env
