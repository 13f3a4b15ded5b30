"""The registry of tensor formats: one entry per GGUF tensor type we read.

Every quantized format is turned, once at load, into one uniform layout that the kernels
use for all of them (see kernels/cpu/unpack.py):

    q     int8    (rows, K)        the integer code of each weight (centered where the format is)
    scale float32 (rows, K // G)   one scale per group of G weights
    bias  float32 (rows, K // G)   one offset per group (formats with a min), else (rows, 0)

so that weight = scale * q + bias exactly as ggml's dequantization computes it. At run
time the activations are quantized to the Q8 kind llama.cpp pairs with each format
(Q8_0, Q8_1 or Q8_K), which keeps the logits within float rounding of llama.cpp's.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Format:
    name: str
    ggml_type: int       # GGML type id in the file
    block_size: int      # values per block
    type_size: int       # bytes per block
    group: int           # values sharing one scale/bias in the unpacked layout (0: float format)
    has_bias: bool       # the format stores a min/offset per group
    activation: str      # run-time activation quantization llama.cpp pairs with it
    quantized: bool = True
    product: str = "lanes"  # how llama.cpp's x86 CPU backend sums its products (kernels/cpu/matmul.py)
    code_bits: int = 8      # q + code_offset is unsigned and fits this many bits: the stored width
    code_offset: int = 128
    repacked_product: str = ""  # the product instead where llama.cpp repacks (rows in eights: REPACK_ROWS)
    repacked_on_avx512_only: bool = False  # llama.cpp repacks it on AVX-512 hosts only

    @property
    def nibble_offset(self) -> int | None:
        """The code offset of formats whose codes are stored two a byte."""
        return self.code_offset if self.code_bits == 4 else None

    @property
    def bits_per_weight(self) -> float:
        return self.type_size * 8 / self.block_size


REPACK_ROWS = 8  # llama.cpp's x86 backend repacks a matrix whose rows come in multiples of this

# activation kinds: block size of the Q8 activation quantization
ACTIVATION_BLOCK = {"q8_0": 32, "q8_1": 32, "q8_k": 256, "f32": 1, "f16": 1, "bf16": 1}

FORMATS = [
    Format("F32", 0, 1, 4, 0, False, "f32", quantized=False),
    Format("F16", 1, 1, 2, 0, False, "f16", quantized=False),
    Format("Q4_0", 2, 32, 18, 32, False, "q8_0", code_bits=4, code_offset=8, repacked_product="lanes_blocks"),
    Format("Q4_1", 3, 32, 20, 32, True, "q8_1", code_bits=4, code_offset=0),
    Format("Q5_0", 6, 32, 22, 32, False, "q8_0", code_bits=5, code_offset=16),
    Format("Q5_1", 7, 32, 24, 32, True, "q8_1", code_bits=5, code_offset=0),
    Format("Q8_0", 8, 32, 34, 32, False, "q8_0"),
    Format("Q2_K", 10, 256, 84, 16, True, "q8_k", product="k_lanes", code_bits=4, code_offset=0,
           repacked_product="k_lanes_8x8", repacked_on_avx512_only=True),
    Format("Q3_K", 11, 256, 110, 16, False, "q8_k", product="k_lanes", code_bits=4, code_offset=4),
    Format("Q4_K", 12, 256, 144, 32, True, "q8_k", product="k_lanes", code_bits=4, code_offset=0,
           repacked_product="q4_k"),
    Format("Q5_K", 13, 256, 176, 32, True, "q8_k", product="k_lanes"),
    Format("Q6_K", 14, 256, 210, 16, False, "q8_k", product="q6_k"),
    Format("BF16", 30, 1, 2, 0, False, "bf16", quantized=False),
]

FORMATS_BY_ID = {f.ggml_type: f for f in FORMATS}
FORMATS_BY_NAME = {f.name: f for f in FORMATS}
