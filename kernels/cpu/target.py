"""The CPU the kernels are compiled for, and so the ggml build minillm computes as: the host's
features, or the ones Numba is told to compile for (NUMBA_CPU_NAME with NUMBA_CPU_FEATURES, such
as "+avx2,+fma,+f16c,...": an AVX2 build runs and is tested on an AVX-512 machine this way)."""
from llvmlite import binding as llvm_binding
from numba.core import config


def _features() -> dict[str, bool]:
    if config.CPU_FEATURES is None:
        return dict(llvm_binding.get_host_cpu_features())
    named = (f.strip() for f in config.CPU_FEATURES.split(","))
    return {f[1:]: f[0] == "+" for f in named if f[:1] in "+-" and len(f) > 1}


FEATURES = _features()
