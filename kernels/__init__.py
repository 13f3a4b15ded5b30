"""Compute kernels, one subpackage per backend. Installed as `minillm.kernels`."""
