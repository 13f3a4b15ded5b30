"""The synthetic models of minillm/synthetic.py (re-exported here for the tests) and a plain
NumPy reference forward pass over their float values."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from minillm.synthetic import (ARCH_EXTRAS, CENTRE, F16_FIELDS, FUSED_QKV, FUSED_UP, QWEN35_SSM,  # noqa: F401
                               SyntheticModel, float_tensor, random_blocks, write_vocab)


# ---- plain NumPy reference forward (float64, no activation quantization) ----

def _rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, base, neox):
    T, H, D = x.shape
    inv = base ** (-np.arange(0, D, 2) / D)
    ang = positions[:, None] * inv[None, :]  # (T, D/2)
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    out = x.copy()
    if neox:
        a, b = x[..., :D // 2], x[..., D // 2:]
        out[..., :D // 2], out[..., D // 2:] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0::2], x[..., 1::2]
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def reference_logits(m: SyntheticModel, ids) -> np.ndarray:
    v = {k: val.astype(np.float64) for k, val in m.values.items()}
    T, D, H, Hkv = len(ids), m.head_dim, m.n_head, m.n_head_kv
    pos = np.arange(T, dtype=np.float64)
    x = v["token_embd.weight"][ids]
    gemma = m.arch == "gemma3"
    if gemma:
        x = x * math.sqrt(m.n_embd)
    for il in range(m.n_layer):
        p = f"blk.{il}."
        h = _rms(x, v[p + "attn_norm.weight"])
        q = (h @ v[p + "attn_q.weight"].T).reshape(T, H, D)
        k = (h @ v[p + "attn_k.weight"].T).reshape(T, Hkv, D)
        val = (h @ v[p + "attn_v.weight"].T).reshape(T, Hkv, D)
        local = gemma and il % 6 < 5
        if gemma:
            q, k = _rms(q, v[p + "attn_q_norm.weight"]), _rms(k, v[p + "attn_k_norm.weight"])
        base = (10000.0 if local else 1000000.0) if gemma else 10000.0
        q, k = _rope(q, pos, base, gemma), _rope(k, pos, base, gemma)
        k, val = np.repeat(k, H // Hkv, axis=1), np.repeat(val, H // Hkv, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(D)
        i, j = np.arange(T)[:, None], np.arange(T)[None, :]
        mask = (j > i) | ((i - j >= m.window) if local else False)
        scores = np.where(mask[None], -np.inf, scores)
        prob = np.exp(scores - scores.max(-1, keepdims=True))
        prob /= prob.sum(-1, keepdims=True)
        attn = np.einsum("hts,shd->thd", prob, val).reshape(T, H * D)
        o = attn @ v[p + "attn_output.weight"].T
        x = x + (_rms(o, v[p + "post_attention_norm.weight"]) if gemma else o)
        h = _rms(x, v[p + "ffn_norm.weight"])
        g, u = h @ v[p + "ffn_gate.weight"].T, h @ v[p + "ffn_up.weight"].T
        if gemma:
            act = 0.5 * g * (1 + np.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3))) * u
        else:
            act = g / (1 + np.exp(-g)) * u
        f = act @ v[p + "ffn_down.weight"].T
        x = x + (_rms(f, v[p + "post_ffw_norm.weight"]) if gemma else f)
    x = _rms(x, v["output_norm.weight"])
    return x @ v["token_embd.weight"].T


def synthetic_imatrix(model_path, seed: int = 7):
    """A deterministic importance matrix for every layer weight of a GGUF model (whatever ggml
    build computes the model): per column, in_sum2 = rows * a mean square spread over four
    orders of magnitude, with some dead (zero) columns; rows 1024. For testing the quantizers
    against llama-quantize --imatrix with the same file (tests/llama_ref/record_imatrix.py)."""
    from minillm.gguf_file import GGUFFile
    from minillm.imatrix_file import Entry, Imatrix

    rng = np.random.default_rng(seed)
    entries = {}
    with GGUFFile(model_path) as gf:
        for name in sorted(gf.tensors):
            info = gf.tensors[name]
            if not name.startswith("blk.") or len(info.shape) != 2:
                continue
            ne0 = info.shape[0]
            mean_sq = (10.0 ** rng.uniform(-3, 1, ne0)) * (rng.random(ne0) > 0.02)
            sum1 = rng.standard_normal(ne0) * np.sqrt(mean_sq) * 1024
            entries[name] = Entry((mean_sq * 1024).astype(np.float32), np.array([1024]), sum1.astype(np.float32))
    return Imatrix(entries, ["synthetic"], 2, 512)


def imatrix_inputs(model_path, folder) -> dict[str, Path]:
    """The importance matrices that tests/llama_ref/record_imatrix.py has llama-imatrix combine
    and show (and test_imatrix minillm), written into folder: a.gguf, synthetic_imatrix;
    b.gguf, another (seed 8) of another text, 1536 rows in chunks of 256, without blk.29's
    entries, one entry without activation sums, one counted as two matrices, and output and
    token_embd entries; c.dat, a third
    in the legacy format; bad.gguf, a.gguf with an entry of another size; gap.gguf, a.gguf
    without blk.10's entries."""
    from minillm.imatrix_file import Entry, to_bytes, to_dat_bytes

    folder = Path(folder)
    a = synthetic_imatrix(model_path)
    b = synthetic_imatrix(model_path, seed=8)
    b.datasets, b.chunk_size, b.chunk_count = ["other.txt"], 256, 6
    b.entries = {name: e for name, e in b.entries.items() if not name.startswith("blk.29.")}
    for e in b.entries.values():
        e.counts = np.array([1536])
    b.entries["blk.3.ffn_up.weight"].sum1 = None
    b.entries["blk.5.attn_q.weight"].counts = np.array([1536, 1024])
    for name in ("output.weight", "token_embd.weight"):             # outside the blocks
        e = b.entries["blk.7.attn_k.weight"]
        b.entries[name] = Entry(e.sum2 * np.float32(1.5), e.counts.copy(), e.sum1 * np.float32(0.5))
    c = synthetic_imatrix(model_path, seed=9)
    c.datasets = ["legacy.txt"]
    bad = synthetic_imatrix(model_path)
    e = bad.entries["blk.3.ffn_up.weight"]
    e.sum2, e.sum1 = e.sum2[:288], e.sum1[:288]
    gap = synthetic_imatrix(model_path)
    gap.entries = {name: e for name, e in gap.entries.items() if not name.startswith("blk.10.")}
    files = {"a.gguf": to_bytes(a), "b.gguf": to_bytes(b), "c.dat": to_dat_bytes(c)[0], "bad.gguf": to_bytes(bad),
             "gap.gguf": to_bytes(gap)}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return {name: folder / name for name in files}


def load_error(model: SyntheticModel, tmp_path: Path, drop: str | None = None) -> str:
    """The MinillmError minillm.load raises on the model's file, without tensor `drop` if given
    (none raised: AssertionError)."""
    import minillm

    if drop:
        del model.tensors[drop]
    try:
        minillm.load(model.write(tmp_path / "bad.gguf"))
    except minillm.MinillmError as e:
        return str(e)
    raise AssertionError("the file loaded")
