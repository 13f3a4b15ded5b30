"""Where does minillm depart from llama.cpp? Compares every layer's tensors of one reference
prompt (tests/data/greedy_<model>_dev.jsonl row) with llama.cpp's, dumped by dump.cpp:

    tests/llama_ref/build.sh /tmp/llama_ref
    python tests/llama_ref/compare_layers.py gemma3 5 /tmp/llama_ref/dump [--evals 0,1]

Prints, per layer, how many values of each tensor differ (0 everywhere: bit-identical).
A debugging aid, not a test; llama.cpp is never a dependency of the package.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import minillm  # noqa: E402
from minillm.kernels.cpu import layers as cpu_layers  # noqa: E402

MODELS = {"smollm2": "models/SmolLM2-135M-Instruct.Q4_1.gguf", "gemma3": "models/gemma-3-270m-q4_k_m.gguf"}
# what each operation of a layer function returns, in call order, and llama.cpp's name for it
OPS = {
    "llama": ["attn_norm", "qkv", "kqv_out", "wo", "add", "ffn_norm", "gateup", "ffn_swiglu", "ffn_out", "l_out"],
    "gemma3": ["attn_norm", "qkv", "q_normed", "k_normed", "kqv_out", "wo", "attn_post_norm", "sa_out",
               "ffn_norm", "gateup", "ffn_geglu", "ffn_out", "ffn_post_norm", "l_out"],
}
COMPARED = ("attn_norm", "kqv_out", "attn_post_norm", "sa_out", "ffn_norm", "ffn_gate", "ffn_up",
            "ffn_swiglu", "ffn_geglu", "ffn_out", "ffn_post_norm", "l_out")


def read_dump(path: str) -> dict[int, dict[str, np.ndarray]]:
    """eval index -> tensor name -> values (flat; a prompt's ubatches concatenated)."""
    data = Path(path).read_bytes()
    out: dict[int, dict[str, np.ndarray]] = {}
    o = 0
    while o < len(data):
        ev, n_name, *ne = np.frombuffer(data, np.int32, 6, o)
        o += 24
        name = data[o:o + n_name].decode()
        o += n_name
        n = int(np.prod(ne))
        values = np.frombuffer(data, np.float32, n, o)
        o += 4 * n
        d = out.setdefault(int(ev), {})
        d[name] = np.concatenate([d[name], values]) if name in d else values
    return out


def run_minillm(model, ids: list[int], n_prompt: int) -> list[list[dict[str, np.ndarray]]]:
    """Per eval (the prompt, then one token each): per layer, name -> (T, C) values."""
    log: list = []
    ops = types.SimpleNamespace(**{k: getattr(cpu_layers, k) for k in dir(cpu_layers) if not k.startswith("_")})
    for name in ("norm", "linear", "linear2", "linear3", "head_norm", "rope_attend", "add", "geglu", "swiglu"):
        def recorded(*args, _fn=getattr(cpu_layers, name)):
            result = _fn(*args)
            log.append(result)
            return result
        setattr(ops, name, recorded)
    arch = model.arch
    model.backend.layer_function = model.backend.layer_with_ops(ops)
    names = OPS[arch.name]
    cache = model.new_cache(4096)
    evals = []
    for chunk in [ids[:n_prompt]] + [[t] for t in ids[n_prompt:]]:
        log.clear()
        model.eval(chunk, cache, len(chunk) - 1)
        n_fw = len(log) // (len(names) * arch.hp.n_layer)  # forwards: ubatches of the prompt
        layers = []
        for il in range(arch.hp.n_layer):
            parts: dict[str, list] = {}
            for fw in range(n_fw):
                at = (fw * arch.hp.n_layer + il) * len(names)
                for name, value in zip(names, log[at:at + len(names)]):
                    if name == "qkv":  # (llama.cpp's Vcur is a view in another layout)
                        continue
                    if name == "gateup":
                        parts.setdefault("ffn_gate", []).append(value[0])
                        parts.setdefault("ffn_up", []).append(value[1])
                    else:
                        parts.setdefault(name, []).append(np.asarray(value))
            layers.append({k: np.concatenate(v) for k, v in parts.items()})
        evals.append(layers)
    return evals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", choices=sorted(MODELS))
    ap.add_argument("row", type=int)
    ap.add_argument("dump", help="the dump program built by build.sh")
    ap.add_argument("--evals", default="0", help="which evals to compare (0: the prompt)")
    args = ap.parse_args()
    evals = [int(e) for e in args.evals.split(",")]
    rows = [json.loads(line) for line in open(ROOT / f"tests/data/greedy_{args.model}_dev.jsonl")]
    row = rows[args.row]
    n_prompt = len(row["prompt_ids"])
    ids = row["prompt_ids"] + [s["next"] for s in row["steps"][:max(evals)]]
    path = str(ROOT / MODELS[args.model])
    with tempfile.TemporaryDirectory() as tmp:
        ids_file, out = os.path.join(tmp, "ids.txt"), os.path.join(tmp, "dump.bin")
        Path(ids_file).write_text(" ".join(map(str, ids)))
        subprocess.run([args.dump, path, ids_file, out, str(n_prompt), "2"], check=True,
                       env=dict(os.environ, DUMP_EVALS=str(max(evals) + 1)), stderr=subprocess.DEVNULL)
        ref = read_dump(out)
    mine = run_minillm(minillm.load(path), ids, n_prompt)
    for ev in evals:
        print(f"== eval {ev}: differing values per tensor")
        for il, layer in enumerate(mine[ev]):
            cells = []
            for name in COMPARED:
                theirs = ref[ev].get(f"{name}-{il}")
                if theirs is None or name not in layer:
                    continue
                ours = layer[name].reshape(-1)
                if theirs.size != ours.size:  # the last layer's rows after llama.cpp's get_rows
                    theirs = theirs[-ours.size:] if theirs.size > ours.size else None
                if theirs is None:
                    continue
                cells.append(f"{name}:{int(np.sum(theirs != ours))}")
            print(il, " ".join(cells))


if __name__ == "__main__":
    main()
