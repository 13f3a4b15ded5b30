"""Numba CPU kernels. Cached kernels load without parsing their bitcode (lazy_cache.py), and
only if every source compiled code is made of is as it was (kernels/cache_stamp.py)."""
from ..cache_stamp import install_cpu as _install_cache_stamp
from .lazy_cache import install as _install_lazy_cache

_install_cache_stamp()
_install_lazy_cache()


def _align_arrays_to_cache_lines() -> None:
    """Arrays the kernels allocate start on a 64-byte line, not Numba's 32: a 64-byte vector
    load from an array 32 bytes off a line touches two lines, and the float tiles then ran
    about 25% slower (which of the two a process got decided each run)."""
    from numba.core.cpu import CPUContext
    CPUContext.get_preferred_array_alignment = lambda context, ty: 64


_align_arrays_to_cache_lines()
