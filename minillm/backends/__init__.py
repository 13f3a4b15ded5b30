"""Backends: where a model's weights live and its forward pass runs (base.py: the interface and
the shared forward loop; cpu.py: the Numba kernels; cuda.py: numba.cuda on an NVIDIA GPU).
This is the one place that chooses a backend; the rest of the engine calls the interface."""
from __future__ import annotations

import os

from ..errors import MinillmError
from .base import Backend, NotOnThisBackend

DEVICES = ("cpu", "cuda", "auto")

__all__ = ["Backend", "NotOnThisBackend", "DEVICES", "resolve_device", "load_backend"]


def resolve_device(device: str) -> str:
    """"cpu" or "cuda" for a requested device. "auto": CUDA when an NVIDIA driver is present and
    numba-cuda finds a GPU (the CUDA simulator does not count). numba.cuda is imported only when
    a GPU may be there, so CPU users never pay for it."""
    if device not in DEVICES:
        raise MinillmError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if device == "cpu" or (device == "auto" and not os.path.exists("/dev/nvidiactl")):
        return "cpu"
    import importlib.util

    if importlib.util.find_spec("numba_cuda") is None:
        if device == "cuda":
            raise MinillmError("device 'cuda' needs numba-cuda: pip install 'minillm[cuda]'")
        return "cpu"
    from numba import cuda
    from numba.core import config

    if device == "auto":
        return "cuda" if cuda.is_available() and not config.ENABLE_CUDASIM else "cpu"
    if not cuda.is_available():
        raise MinillmError("device 'cuda': numba.cuda finds no CUDA GPU")
    return "cuda"


def load_backend(arch, device: str, cache_types: tuple[str, str], progress=None) -> Backend:
    """The architecture's weights loaded on device ("cpu" or "cuda", as resolve_device gives)."""
    if device == "cuda":
        from .cuda import CudaBackend

        return CudaBackend(arch, cache_types, progress)
    from .cpu import CpuBackend

    return CpuBackend(arch, cache_types, progress)
