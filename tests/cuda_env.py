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


def environment_for_ptx_check() -> dict[str, str]:
    """The environment of a subprocess that compiles to real PTX (no simulator)."""
    env = dict(os.environ)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    return env
