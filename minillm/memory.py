"""Resident memory the engine no longer needs, handed back to the kernel."""
from __future__ import annotations

import ctypes
import mmap
import sys

_COMPILER_LIBRARIES = ("libllvmlite",)


def release_compiler_pages() -> int:
    """Once the kernels are loaded, LLVM's code (~70 MiB of libllvmlite resident after Numba
    loads its cache) is idle: ask the kernel to reclaim its pages (MADV_PAGEOUT). Nothing
    changes for the program: they are read back if something compiles later. Returns the
    bytes advised; 0 where the system cannot do it."""
    advice = getattr(mmap, "MADV_PAGEOUT", 21 if sys.platform.startswith("linux") else None)  # Linux >= 5.4
    if advice is None:
        return 0
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except (OSError, AttributeError):
        return 0
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    advised = 0
    for line in lines:
        fields = line.split()
        if len(fields) < 6 or not any(lib in fields[5] for lib in _COMPILER_LIBRARIES):
            continue
        lo, hi = (int(a, 16) for a in fields[0].split("-"))
        if madvise(lo, hi - lo, advice) == 0:
            advised += hi - lo
    return advised
