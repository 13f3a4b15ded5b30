"""Record llama.cpp's ids for the reference texts (tests/data/tok_smollm2_dev.jsonl) with each
vocabulary of models/vocab/ (one per pre-tokenizer kind; `make models` fetches them, and derives
the gpt-4o and deepseek-r1-qwen ones), into
tests/data/tok_vocabs.npz (run from the repository root, after build.sh):

    python tests/llama_ref/record_tok_vocabs.py /tmp/llama_ref

Per vocabulary: the ids of every text concatenated (`<vocab>/ids`) and where each text's start
(`<vocab>/offsets`, one more than the texts). Plain text: no BOS, special tokens not parsed."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "models"))
from fetch import DERIVED_VOCABS, VOCAB_DIR, VOCABS  # noqa: E402

SEPARATOR = "\x1e"  # vocab_dump's tokenize_many: texts split at the record separator


def texts() -> list[str]:
    with open(ROOT / "tests" / "data" / "tok_smollm2_dev.jsonl") as f:
        return [json.loads(line)["text"] for line in f]


def main(workdir: str) -> None:
    corpus = texts()
    assert not any(SEPARATOR in t for t in corpus)
    record = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "texts.txt").write_text(SEPARATOR.join(corpus), encoding="utf-8")
        for vocab in VOCABS + tuple(DERIVED_VOCABS):
            out = subprocess.run([str(Path(workdir) / "vocab_dump"), str(VOCAB_DIR / f"ggml-vocab-{vocab}.gguf"),
                                  "tokenize_many", str(Path(tmp) / "texts.txt")],
                                 capture_output=True, text=True, check=True).stdout.splitlines()
            ids = [list(map(int, line.split())) for line in out]
            assert len(ids) == len(corpus), (vocab, len(ids))
            record[f"{vocab}/ids"] = np.array([i for row in ids for i in row], np.int32)
            record[f"{vocab}/offsets"] = np.cumsum([0] + [len(row) for row in ids]).astype(np.int64)
            print(f"{vocab}: {len(record[f'{vocab}/ids'])} ids")
    np.savez_compressed(ROOT / "tests" / "data" / "tok_vocabs.npz", **record)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama_ref")
