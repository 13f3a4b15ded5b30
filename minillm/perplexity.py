"""Perplexity with llama.cpp's protocol (llama-perplexity): tokenize the whole text once (the
model's default BOS, special-token text as plain text); split into n_ctx-token chunks, the first
token of each replaced by BOS when the model adds one; evaluate each chunk from an empty cache;
the logits at positions n_ctx/2 .. n_ctx-2 score the next token; PPL = exp(mean NLL)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import MinillmError


@dataclass
class PerplexityResult:
    ppl: float
    n_chunks: int
    n_scored: int
    chunk_ppl: list[float]


def perplexity(model, text: str, n_ctx: int = 512, progress=None) -> PerplexityResult:
    tok = model.tokenizer
    ids = tok.tokenize(text, special=False)
    n_chunks = len(ids) // n_ctx
    if n_chunks < 1:
        raise MinillmError(f"the text is {len(ids)} tokens; perplexity needs at least one chunk of {n_ctx}")
    first = n_ctx // 2
    total_nll, n_scored, chunk_ppl = 0.0, 0, []
    for c in range(n_chunks):
        chunk = list(ids[c * n_ctx:(c + 1) * n_ctx])
        if tok.add_bos and tok.bos_id is not None:
            chunk[0] = tok.bos_id
        logits = model.logits(chunk, start=first)[:-1]          # positions first .. n_ctx-2
        targets = np.asarray(chunk[first + 1:], dtype=np.int64)   # the tokens they predict
        nll = _nll(logits, targets)
        total_nll += nll.sum()
        n_scored += len(nll)
        chunk_ppl.append(float(np.exp(nll.mean())))
        if progress:
            progress(c + 1, n_chunks, float(np.exp(total_nll / n_scored)))
    return PerplexityResult(float(np.exp(total_nll / n_scored)), n_chunks, n_scored, chunk_ppl)


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(x - top).sum(axis=1)) + top[:, 0]
    return log_z - x[np.arange(len(targets)), targets]
