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

# ggml's vector code follows the CPU it is built for: AVX-512 (16 lanes, its own ggml_v_expf)
# or AVX2 (8 lanes, another ggml_v_expf that rounds differently). minillm computes as llama.cpp
# built for this CPU does, on the CPU and (to match it) on CUDA. Numba keeps its CPU cache per
# CPU and features; the CUDA kernels' cache stamp names the build (cache_stamp.install_cuda).
GGML_AVX512 = FEATURES.get("avx512f", False) and FEATURES.get("avx512dq", False)
SIMD_WIDTH = 16 if GGML_AVX512 else 8  # float32 lanes of ggml's vector loops
GGML_AVX512_BF16 = GGML_AVX512 and FEATURES.get("avx512bf16", False)  # BF16 products by vdpbf16ps
