"""Record what llama.cpp's tools give on the small mixture-of-experts models (tests/arch_cases.py
"qwen3moe") into tests/data/moe_reference.json, as record_hybrid.py does for the hybrids (run from
the repository root, after build.sh and build.sh --avx2):

    python tests/llama_ref/record_moe.py /tmp/llama_ref
"""
from __future__ import annotations

import sys

from record_hybrid import record

CASES = ("qwen3moe",)

if __name__ == "__main__":
    record(sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama_ref", CASES, "moe_reference.json")
