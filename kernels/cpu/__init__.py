"""Numba CPU kernels. Cached kernels load without parsing their bitcode (lazy_cache.py), and
only if every source compiled code is made of is as it was (cache_stamp.py)."""
from .cache_stamp import install as _install_cache_stamp
from .lazy_cache import install as _install_lazy_cache

_install_cache_stamp()
_install_lazy_cache()
