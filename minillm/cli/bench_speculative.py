"""Speculative decoding's benchmark: greedy decode speed with guesses (prompt lookup or a draft
model) beside plain decoding, in the same run, on two sets of chat prompts: `copy`, whose
answers copy from the prompt (extract, correct, annotate or summarize a given text or code),
and `open` (open-ended answers). `minillm bench MODEL --lookup` / `--draft DRAFT` runs it on one
model; `make bench-speculative` on both real models and a draft pair, with llama.cpp's
llama-lookup and llama-speculative-simple on the same prompts when LLAMA_BIN names their folder:

    python -m minillm.cli.bench_speculative [--out bench-speculative.json] [--llama-bin DIR]
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from pathlib import Path

from ..model import Model

COPY = {
    "extract": "Here is a text:\n\nThe river town of Ashford grew up around a mill built in 1712. For a century the "
               "mill ground wheat for the farms of the valley, and the town's market was held every Thursday in the "
               "square beside it. In 1824 a canal reached Ashford, and barges began to carry flour to the cities of "
               "the coast. The canal brought workers, and the workers brought a school, a chapel and two inns. When "
               "the railway arrived in 1861, the canal trade declined within twenty years, but the town kept growing "
               "as a market for the surrounding farms.\n\nCopy the sentences of the text that mention the canal, word "
               "for word.",
    "correct": "Correct the spelling mistakes in this paragraph and write it out again:\n\nThe libary opens at nine in "
               "the morning and closes at six in the evning. Visitors can borow up to five books at a time, and "
               "childrens books can be kept for three weeks. The reading room on the secnd floor is quiet, and the "
               "cafe on the ground floor serves coffee and sandwiches until four.",
    "code": "Add a docstring to this Python function and return the whole function:\n\n```python\n"
            "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError(\"window must be "
            "positive\")\n    sums = [0]\n    for v in values:\n        sums.append(sums[-1] + v)\n    return "
            "[(sums[i + window] - sums[i]) / window for i in range(len(values) - window + 1)]\n```",
    "summarize": "Summarize this text in three sentences:\n\nThe first public library in the town opened in 1887 in "
                 "two rooms above the post office. It lent books for a penny a week and was open on Tuesday and "
                 "Saturday evenings. In 1902 a gift from a local mill owner paid for a new building on the high "
                 "street, with a reading room, a children's corner and space for twenty thousand books. The "
                 "library became free to use in 1919, and in 1965 it added records and a small gallery.",
}
OPEN = {
    "story": "Write a short story about a robot who learns to paint.",
    "habits": "What are three good habits for staying healthy?",
    "explain": "Explain why the sky is blue to a ten-year-old.",
    "letter": "Write a short letter thanking a neighbour for looking after my cat.",
}
SETS = {"copy": COPY, "open": OPEN}


def load(path, threads=None, on_compile=None) -> Model:
    model = Model(path, threads=threads, on_compile=on_compile)
    model.warm_up(on_compile)
    return model


def run_speculative_bench(model: Model, n_gen: int = 128, reps: int = 2, draft_model: Model | None = None,
                          lookup: bool = False) -> dict:
    """Plain and speculative greedy decoding on each prompt, reps times each in turn (the best
    time of each kept); per set, tokens/s over all its prompts, the speed-up, the guesses."""
    result = {"model": model.path.name, "draft": draft_model and draft_model.path.name, "lookup": lookup,
              "threads": model.threads, "n_gen": n_gen, "sets": []}
    for name, prompts in SETS.items():
        runs = [_one_prompt(model, draft_model, lookup, text, n_gen, reps) for text in prompts.values()]
        tokens = sum(r["tokens"] for r in runs)
        plain, spec = tokens / sum(r["plain_s"] for r in runs), tokens / sum(r["spec_s"] for r in runs)
        result["sets"].append({
            "prompts": name, "n": len(runs), "tokens": tokens, "plain_tokens_per_s": round(plain, 2),
            "tokens_per_s": round(spec, 2), "speedup": round(spec / plain, 3),
            "drafted": sum(r["drafted"] for r in runs), "accepted": sum(r["accepted"] for r in runs),
            "identical": all(r["identical"] for r in runs)})
    return result


def _one_prompt(model, draft_model, lookup, text, n_gen, reps) -> dict:
    prompt = [{"role": "user", "content": text}]
    best = {"plain_s": float("inf"), "spec_s": float("inf")}
    for _ in range(reps):
        plain = model.generate(prompt, n_gen, temperature=0)
        spec = model.generate(prompt, n_gen, temperature=0, draft=draft_model, lookup=lookup)
        best["plain_s"] = min(best["plain_s"], plain.timings.generate_s)
        best["spec_s"] = min(best["spec_s"], spec.timings.generate_s)
    return dict(best, tokens=len(plain.tokens), drafted=spec.timings.n_drafted, accepted=spec.timings.n_accepted,
                identical=plain.tokens == spec.tokens)


def llama_cpp_speed(binary: Path, model: Model, n_gen: int, draft=None) -> dict:
    """llama-lookup (draft None) or llama-speculative-simple (-md draft): decode tokens/s per set,
    on the same chat-formatted prompts, greedy."""
    out = {}
    for name, prompts in SETS.items():
        tokens = seconds = 0.0
        for text in prompts.values():
            with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
                f.write(model.apply_chat_template([{"role": "user", "content": text}]))
                f.flush()
                args = [str(binary), "-m", str(model.path), "-f", f.name, "-n", str(n_gen), "--temp", "0",
                        "-t", str(model.threads), "-c", "4096"]
                if draft:
                    args += ["-md", str(draft), "--spec-type", "draft-simple"]
                log = subprocess.run(args, capture_output=True, text=True, timeout=600).stderr
            found = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
            if not found:
                raise SystemExit(f"{binary.name} gave no timing:\n{log[-2000:]}")
            tokens, seconds = tokens + int(found.group(1)), seconds + float(found.group(2))
        out[name] = round(tokens / seconds, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench-speculative.json")
    ap.add_argument("--llama-bin", help="folder with llama-lookup and llama-speculative-simple")
    ap.add_argument("-n", type=int, default=128)
    args = ap.parse_args()
    models = Path("models")
    q8 = models / "SmolLM2-135M-Instruct.Q8_0.gguf"
    small = models / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not q8.exists():
        from ..quantize import quantize

        quantize(small, q8, "Q8_0", allow_requantize=True)
    cases = [(small, None), (models / "gemma-3-270m-q4_k_m.gguf", None), (q8, small)]
    results = []
    for path, draft in cases:
        model = load(path)
        r = run_speculative_bench(model, args.n, draft_model=draft and load(draft), lookup=draft is None)
        if args.llama_bin:
            tool = Path(args.llama_bin) / ("llama-speculative-simple" if draft else "llama-lookup")
            r["llama_cpp"] = {"tool": tool.name, **llama_cpp_speed(tool, model, args.n, draft)}
        results.append(r)
        print_result(r)
    Path(args.out).write_text(json.dumps(results, indent=2))


def print_result(r: dict) -> None:
    how = f"draft {r['draft']}" if r["draft"] else "prompt lookup"
    print(f"{r['model']}, {how}, greedy, {r['n_gen']} tokens a prompt")
    for s in r["sets"]:
        peer = ""
        if "llama_cpp" in r:
            peer = f"   llama.cpp {r['llama_cpp']['tool']}: {r['llama_cpp'][s['prompts']]:.1f} tok/s"
        print(f"  {s['prompts']:>5}: plain {s['plain_tokens_per_s']:6.1f} tok/s, speculative {s['tokens_per_s']:6.1f} "
              f"(x{s['speedup']:.2f}), accepted {s['accepted']}/{s['drafted']}, identical {s['identical']}{peer}")


if __name__ == "__main__":
    main()
