"""Record llama.cpp's greedy runs on the reference prompts, as built for this CPU:

    python tests/llama_ref/record_greedy.py /tmp/llama_ref

ggml's vector code differs between its AVX2 and AVX-512 builds (8- or 16-lane sums, two
ggml_v_expf variants), and llama.cpp's logits follow by a few units in the last place, then,
through the int8 activations, by 0.1-0.3 here and there. The shared reference data
(greedy_<model>_dev.jsonl) came from an AVX-512 machine; this writes greedy_<model>_avx2.jsonl:
the same prompts and protocol (the prompt in one batch, then up to as many greedy steps as the
reference row has, an end-of-generation token ending it), top 10 logits at each step."""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from record_archs import dump  # run as a script: this folder is on the path

DATA = Path(__file__).resolve().parent.parent / "data"
MODELS = {"smollm2": "models/SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "models/gemma-3-270m-q4_k_m.gguf"}


def greedy_run(binary: Path, model: str, prompt: list[int], n_steps: int, tmp: Path) -> list[dict]:
    dump(binary, model, prompt, len(prompt), tmp / "out", n_steps)
    steps = []
    for line in (tmp / "out.greedy").read_text().splitlines():
        fields = line.split()
        top = [[int(fields[i]), float(fields[i + 1])] for i in range(1, len(fields), 2)]
        steps.append({"top": top, "next": int(fields[0])})
    return steps


def main(workdir: str, suffix: str = "avx2") -> None:
    dump = Path(workdir) / "dump"
    with tempfile.TemporaryDirectory() as tmp:
        for name, model in MODELS.items():
            rows = [json.loads(line) for line in open(DATA / f"greedy_{name}_dev.jsonl")]
            with open(DATA / f"greedy_{name}_{suffix}.jsonl", "w") as out:
                for row in rows:
                    steps = greedy_run(dump, model, row["prompt_ids"], len(row["steps"]), Path(tmp))
                    same = sum(a["next"] == b["next"] for a, b in zip(steps, row["steps"]))
                    print(f"{name}: {len(row['prompt_ids'])} prompt tokens, {len(steps)} steps, "
                          f"{same} with the reference's token")
                    out.write(json.dumps({"kind": row["kind"], "text": row["text"], "prompt_ids": row["prompt_ids"],
                                          "steps": steps}) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:2] or ["/tmp/llama_ref"])
