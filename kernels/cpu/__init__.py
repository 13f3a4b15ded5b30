"""Numba CPU kernels. Cached kernels load without parsing their bitcode (lazy_cache.py)."""
from .lazy_cache import install as _install_lazy_cache

_install_lazy_cache()
