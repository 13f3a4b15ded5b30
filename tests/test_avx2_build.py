"""The AVX2 build, tested on an AVX-512 machine. minillm computes as ggml built for the CPU that
Numba compiles for (kernels/cpu/target.py), so with Numba told to compile for Haswell the whole
AVX2 code path runs here. The tests that pin that arithmetic to llama.cpp's AVX2 build run again
that way, in a child pytest: every architecture's small model (F16, BF16 and F32 products among
them) bit for bit against tests/data's avx2 references, the float products' register tiles and
16-bit rows against their one-output-at-a-time definitions, and SmolLM2's greedy runs against
llama.cpp's AVX2 goldens."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from minillm.kernels.cpu.ops import GGML_AVX512

HASWELL = dict(NUMBA_CPU_NAME="haswell", NUMBA_CPU_FEATURES=(
    "+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fsgsbase,+fxsr,+lzcnt,+mmx,+movbe,+pclmul,"
    "+popcnt,+sahf,+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+x87,+xsave"))
AGAIN = ["tests/test_architectures.py::test_logits_and_greedy_tokens_match_llama_cpp",
         "tests/test_formats.py::test_float_batches_in_register_tiles_sum_as_tiny_blas",
         "tests/test_formats.py::test_f16_weights_kept_as_bit_patterns_multiply_as_their_values",
         "tests/test_formats.py::test_bf16_weights_kept_as_bit_patterns_multiply_as_their_values",
         "tests/test_generate.py::test_greedy_generation_against_llama_cpp[smollm2]",
         "tests/test_hybrid.py::test_perplexity_equals_llama_perplexity",
         "tests/test_moe.py::test_perplexity_equals_llama_perplexity"]


@pytest.mark.slow
@pytest.mark.skipif(not GGML_AVX512, reason="an AVX2 CPU: the whole suite runs the AVX2 build")
def test_the_avx2_build_computes_as_llama_cpps_avx2_build():
    env = {**os.environ, **HASWELL}
    build = subprocess.run([sys.executable, "-c", "from minillm.kernels.cpu.ops import ggml_build; print(ggml_build())"],
                           env=env, capture_output=True, text=True, check=True)
    assert build.stdout.strip() == "avx2"
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *AGAIN], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=1200)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    summary = child.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"\d+ passed(, \d+ warnings?)? in .*", summary), summary  # nothing skipped
    assert int(summary.split()[0]) >= 16, summary
