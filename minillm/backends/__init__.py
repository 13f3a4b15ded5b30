"""Backends: where a model's weights live and its forward pass runs (base.py: the interface and
the shared forward loop; cpu.py: the Numba kernels; cuda.py: numba.cuda on an NVIDIA GPU).
This is the one place that chooses a backend; the rest of the engine calls the interface."""
from __future__ import annotations

import os

from ..errors import MinillmError
from .base import Backend, NotOnThisBackend

DEVICES = ("cpu", "cuda", "auto")

__all__ = ["Backend", "NotOnThisBackend", "DEVICES", "resolve_device", "load_backend", "CUDA_FASTER_THAN_CPU"]


# Whether "auto" may choose the GPU: only where the CUDA path is faster than the CPU path. It is
# not yet: on an NVIDIA H200 (2026-12-04) it decoded SmolLM2 at 8.8 tok/s, where the CPU path
# decodes 100-250 on a 2-core VM (docs/performance.md).
CUDA_FASTER_THAN_CPU = False
SLOWER_GPU_NOTICE = ("a CUDA GPU is present, but minillm's CUDA path is still slower than its CPU path: "
                     "running on the CPU (device 'cuda' runs on the GPU anyway)")


def resolve_device(device: str) -> tuple[str, str | None]:
    """("cpu" or "cuda", a notice or None) for a requested device. "auto": CUDA where a usable
    GPU is present (an NVIDIA driver, numba-cuda finding a GPU; the CUDA simulator does not count)
    and the CUDA path is the faster (CUDA_FASTER_THAN_CPU), else the CPU, with a notice when a GPU
    went unused. numba.cuda is imported only when a GPU may be there, so CPU users never pay for it."""
    if device not in DEVICES:
        raise MinillmError(f"unknown device {device!r} (choose from {', '.join(DEVICES)})")
    if device == "cpu" or (device == "auto" and not os.path.exists("/dev/nvidiactl")):
        return "cpu", None
    import importlib.util

    if importlib.util.find_spec("numba_cuda") is None:
        if device == "cuda":
            raise MinillmError("device 'cuda' needs numba-cuda: pip install 'minillm[cuda]'")
        return "cpu", None
    from numba import cuda
    from numba.core import config

    usable = cuda.is_available() and not config.ENABLE_CUDASIM
    if device == "auto":
        if not usable:
            return "cpu", None
        return ("cuda", None) if CUDA_FASTER_THAN_CPU else ("cpu", SLOWER_GPU_NOTICE)
    if not cuda.is_available():
        raise MinillmError("device 'cuda': numba.cuda finds no CUDA GPU")
    return "cuda", None


def load_backend(arch, device: str, cache_types: tuple[str, str], progress=None, on_compile=None) -> Backend:
    """The architecture's weights loaded on device ("cpu" or "cuda", as resolve_device gives);
    kernels that must compile first (the CPU's products, on a first run) inside on_compile()."""
    if device == "cuda":
        from .cuda import CudaBackend

        return CudaBackend(arch, cache_types, progress)
    from .cpu import CpuBackend

    return CpuBackend(arch, cache_types, progress, on_compile)
