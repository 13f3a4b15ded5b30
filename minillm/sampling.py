"""Token sampling, in llama.cpp's default order:
penalties -> top-k -> top-p -> min-p -> temperature -> draw (greedy when temperature <= 0)."""
from __future__ import annotations

from collections import Counter

import numpy as np

from .kernels.cpu.ops import top_k_indices
from .params import SamplingParams


class Sampler:
    """Chooses the next token from logits (n_vocab,), reproducibly for a given seed."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: list[int]) -> int:
        if self.params.temperature <= 0:
            return int(np.argmax(self._penalize(logits, history)))
        ids, probs = self.distribution(logits, history)
        return int(ids[self.rng.choice(len(ids), p=probs)])

    def distribution(self, logits: np.ndarray, history: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The tokens the chain leaves (ids) and their probabilities, for temperature > 0."""
        p = self.params
        logits = self._penalize(logits, history)
        if 0 < p.top_k < logits.shape[0]:
            ids = top_k_indices(logits, p.top_k)
        else:
            ids = np.arange(logits.shape[0])
        order = np.argsort(-logits[ids], kind="stable")
        ids = ids[order]
        values = logits[ids].astype(np.float64)
        probs = _softmax(values)
        if p.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            ids, values, probs = ids[:keep], values[:keep], probs[:keep]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            ids, values = ids[keep], values[keep]
        return ids, _softmax(values / p.temperature)

    def verify(self, logits: np.ndarray, history: list[int], draft: int) -> int:
        """The next token given a guessed one (speculative decoding), distributed exactly as
        __call__'s: greedy, the argmax; else the guess with its probability p, and otherwise a
        draw from the other tokens (the residual of a guess made with certainty)."""
        if self.params.temperature <= 0:
            return self(logits, history)
        ids, probs = self.distribution(logits, history)
        at = np.flatnonzero(ids == draft)
        p_draft = float(probs[at[0]]) if at.size else 0.0
        if p_draft > 0 and self.rng.random() < p_draft:
            return draft
        residual = probs.copy()
        residual[at] = 0.0
        return int(ids[self.rng.choice(len(ids), p=residual / residual.sum())])

    def _penalize(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        p = self.params
        if p.repeat_last_n == 0 or not history or (
                p.repeat_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0):
            return logits
        window = history[-p.repeat_last_n:] if p.repeat_last_n > 0 else history
        counts = Counter(window)
        logits = logits.copy()
        ids = np.fromiter(counts.keys(), dtype=np.int64)
        n = np.fromiter(counts.values(), dtype=np.float32)
        seen = logits[ids]
        seen = np.where(seen > 0, seen / p.repeat_penalty, seen * p.repeat_penalty)
        logits[ids] = seen - n * p.frequency_penalty - p.presence_penalty
        return logits


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()
