"""Resident memory: what the engine no longer needs, handed back to the kernel; what it will
need again, kept."""
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


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_MMAP_THRESHOLD_MAX = 32 << 20                  # glibc's ceiling for it on 64-bit systems
_kept_freed_memory = False


def keep_freed_memory() -> bool:
    """A forward pass allocates its activations afresh (up to a few MiB an array in a prefill)
    and frees them: glibc gives each such block back to the kernel (mmap, then munmap), so
    every pass faults in and zeroes the same pages again, 10% of a float model's prefill here.
    Raising glibc's mmap and trim thresholds keeps freed blocks of up to 32 MiB in the heap
    for the next pass. Once a process; False where the C library is not glibc."""
    global _kept_freed_memory
    if _kept_freed_memory or not sys.platform.startswith("linux"):
        return _kept_freed_memory
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    _kept_freed_memory = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_MAX))
    return _kept_freed_memory
