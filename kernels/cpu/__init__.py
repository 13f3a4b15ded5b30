"""Numba CPU kernels."""
