"""Perplexity with llama.cpp's protocol (llama-perplexity): tokenize the whole text once (the
model's default BOS, special-token text as plain text); split into n_ctx-token chunks, the first
token of each replaced by BOS when the model adds one; evaluate each chunk from an empty cache;
the logits at positions n_ctx/2 .. n_ctx-2 score the next token; PPL = exp(mean NLL).

With a base file (kl_divergence.py) the same run saves every scored position's log-probabilities,
and `kl_divergence` compares another model against them."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import MinillmError
from .kl_divergence import BaseFile, BaseWriter, KLDResult, KLDSums


@dataclass
class PerplexityResult:
    ppl: float
    n_chunks: int
    n_scored: int
    chunk_ppl: list[float]


def scored_chunks(model, tokens, n_ctx: int, n_chunks: int):
    """Yield (chunk index, logits (n_ctx/2 - 1, n_vocab) float32, targets (same,) int64): the
    positions n_ctx/2 .. n_ctx-2 of each chunk and the tokens they predict."""
    tok = model.tokenizer
    first = n_ctx // 2
    for c in range(n_chunks):
        chunk = [int(t) for t in tokens[c * n_ctx:(c + 1) * n_ctx]]
        if tok.add_bos and tok.bos_id is not None:
            chunk[0] = tok.bos_id
        logits = model.logits(chunk, start=first)[:-1]           # positions first .. n_ctx-2
        yield c, logits, np.asarray(chunk[first + 1:], dtype=np.int64)


def chunk_count(n_tokens: int, n_ctx: int, limit: int | None) -> int:
    n_chunks = n_tokens // n_ctx
    if n_chunks < 1:
        raise MinillmError(f"the text is {n_tokens} tokens; perplexity needs at least one chunk of {n_ctx}")
    return n_chunks if limit is None or limit < 1 else min(limit, n_chunks)


def perplexity(model, text: str, n_ctx: int = 512, progress=None, n_chunks: int | None = None,
               kld_base: str | Path | None = None) -> PerplexityResult:
    """PPL of the text; with kld_base, also write the base file of log-probabilities there."""
    ids = model.tokenizer.tokenize(text, special=False)
    n_chunks = chunk_count(len(ids), n_ctx, n_chunks)
    total_nll, n_scored, chunk_ppl = 0.0, 0, []
    with (BaseWriter(kld_base, n_ctx, model.n_vocab, np.asarray(ids[:n_chunks * n_ctx]))
          if kld_base else contextlib.nullcontext()) as base:
        for c, logits, targets in scored_chunks(model, ids, n_ctx, n_chunks):
            nll = _nll(logits, targets)
            if base is not None:
                base.add(logits)
            total_nll += nll.sum()
            n_scored += len(nll)
            chunk_ppl.append(float(np.exp(nll.mean())))
            if progress:
                progress(c + 1, n_chunks, float(np.exp(total_nll / n_scored)))
    return PerplexityResult(float(np.exp(total_nll / n_scored)), n_chunks, n_scored, chunk_ppl)


def kl_divergence(model, base, progress=None) -> KLDResult:
    """Compare the model with a base file's log-probabilities (a path or an open BaseFile) over
    the file's own tokens."""
    base = base if isinstance(base, BaseFile) else BaseFile.open(base)
    if base.n_vocab != model.n_vocab:
        raise MinillmError(f"{base.path} holds a vocabulary of {base.n_vocab} tokens, the model {model.n_vocab}")
    if base.n_chunk * base.rows_per_chunk < 100:
        raise MinillmError(f"{base.path} scores only {base.n_chunk * base.rows_per_chunk} positions; "
                           "the statistics need 100 (a longer text, or a larger n_ctx)", ("n_ctx",))
    sums = KLDSums()
    for c, logits, targets in scored_chunks(model, base.tokens, base.n_ctx, base.n_chunk):
        sums.add(logits, base.chunk_rows(c), targets)
        if progress:
            progress(c + 1, base.n_chunk, sums)
    return KLDResult(sums, base.n_chunk)


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    top = x.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(x - top).sum(axis=1)) + top[:, 0]
    return log_z - x[np.arange(len(targets)), targets]
