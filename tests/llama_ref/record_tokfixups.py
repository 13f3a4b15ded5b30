"""Record how llama.cpp re-types tokens by their text (Gemma 3's "</s>", typed USER_DEFINED in
its file, is made CONTROL and end-of-generation), into tests/data/tokfixups.jsonl: per model,
the tokens whose type llama.cpp changes and its end-of-generation set, then its ids for texts
that hold such tokens (run from the repository root, after build.sh):

    python tests/llama_ref/record_tokfixups.py /tmp/llama_ref"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = {"smollm2": "models/SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "models/gemma-3-270m-q4_k_m.gguf"}
TEXTS = {
    "gemma3": ["plain </s> in text", "a</s>b</s>", "</s>", "<end_of_turn> and <eos> written out",
               "<unused3> then </s><start_of_turn>user", "tail </s>\n</s> x"],
    "smollm2": ["<|im_end|> written out", "a<reponame>b", "<|endoftext|></s>", "x <|im_start|>user\nhi<|im_end|>"],
}


# llama_token_attr bits -> tokenizer.ggml.token_type values (the bit that decides behaviour first)
ATTR_TYPES = ((1, 2), (8, 3), (16, 4), (32, 6), (2, 5), (4, 1))


def retyped(binary: Path, model: str) -> tuple[list, list]:
    """([id, type] for tokens whose type llama.cpp changes, the end-of-generation ids)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from minillm.gguf_file import GGUFFile

    file_types = list(GGUFFile(model).metadata["tokenizer.ggml.token_type"])
    lines = subprocess.run([str(binary), model, "attrs"], capture_output=True, text=True, check=True).stdout
    changed, eog = [], []
    attrs = {int(i): (int(a), int(e)) for i, a, e in (line.split() for line in lines.splitlines())}
    for token_id, file_type in enumerate(file_types):
        attr, is_eog = attrs.get(token_id, (4, 0))
        kind = next(t for bit, t in ATTR_TYPES if attr & bit)
        if kind != file_type and not (kind == 3 and file_type == 5):  # CONTROL|UNUSED: as the file's UNUSED
            changed.append([token_id, kind])
        if is_eog:
            eog.append(token_id)
    return changed, eog


def main(workdir: str) -> None:
    binary = Path(workdir) / "vocab_dump"
    out = Path(__file__).resolve().parent.parent / "data" / "tokfixups.jsonl"
    with tempfile.TemporaryDirectory() as tmp, open(out, "w") as f:
        for name, model in MODELS.items():
            changed, eog = retyped(binary, model)
            f.write(json.dumps({"model": name, "retyped": changed, "eog": eog}) + "\n")
        for name, texts in TEXTS.items():
            for text in texts:
                (Path(tmp) / "t.txt").write_text(text)
                for kind, flags in (("tok", ["0", "0"]), ("tokspecial", ["1", "1"])):
                    ids = subprocess.run([str(binary), MODELS[name], "tokenize", str(Path(tmp) / "t.txt"), *flags],
                                         capture_output=True, text=True, check=True).stdout.split()
                    f.write(json.dumps({"model": name, "kind": kind, "text": text, "ids": list(map(int, ids))}) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/llama_ref")
