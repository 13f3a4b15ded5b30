"""One generation's engine-side state: its tokens, its sampler (or verifier of guessed tokens),
end of generation, the incremental detokenizer with stop-string hold-back, and its timings.

`Session.generate` (one sequence over its own cache) and the batching scheduler (many sequences
over a shared pool) both decode through a Sequence, so a request streams the same Chunks
whichever runs it: the same tokens, the same text, the same finish.

    seq = Sequence(tokenizer, prompt_ids, max_tokens, sampling, stop)
    token = seq.choose(logits)            # or seq.choose(logits, guess): keep or replace a guess
    for chunk in seq.take(token): ...     # its text (stop strings held back); the last one of
                                          # the sequence has a finish_reason
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .sampling import Sampler, SamplingParams


@dataclass
class Timings:
    n_prompt: int = 0          # prompt tokens evaluated (after reuse of the cache)
    n_generated: int = 0
    prompt_s: float = 0.0
    generate_s: float = 0.0
    n_drafted: int = 0         # speculative decoding: tokens guessed, and how many were accepted
    n_accepted: int = 0

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.n_prompt / self.prompt_s if self.prompt_s else 0.0

    @property
    def generate_tokens_per_s(self) -> float:
        return self.n_generated / self.generate_s if self.generate_s else 0.0


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability under the model's distribution (the raw logits'
    softmax, before any sampler setting), and the most likely tokens with theirs."""
    logprob: float
    top: list[tuple[int, float]]       # (token id, logprob), best first


@dataclass
class Chunk:
    """One step of a streamed generation."""
    text: str                          # new text (may be empty while a stop string is pending)
    token: int | None                  # the sampled token id (None on the final chunk)
    finish_reason: str | None = None   # "stop" (end token or stop string), "length" or "cancelled"
    timings: Timings = field(default_factory=Timings)
    logprobs: TokenLogprobs | None = None  # when the request asked for them


class Result:
    """A whole (non-streamed) generation."""

    def __init__(self, text: str, tokens: list[int], finish_reason: str, timings: Timings):
        self.text, self.tokens, self.finish_reason, self.timings = text, tokens, finish_reason, timings

    @classmethod
    def collect(cls, chunks) -> "Result":
        parts, tokens, last = [], [], None
        for last in chunks:
            parts.append(last.text)
            if last.token is not None:
                tokens.append(last.token)
        return cls("".join(parts), tokens, last.finish_reason, last.timings)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log-softmax of logits (n_vocab,) in float64."""
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def token_logprobs(logits: np.ndarray, token: int, n_top: int) -> TokenLogprobs:
    """The log-probability of token under logits (n_vocab,), and the n_top best tokens."""
    logp = log_softmax(logits)
    top = []
    if n_top > 0:
        best = np.argpartition(-logp, n_top - 1)[:n_top]
        best = best[np.argsort(-logp[best], kind="stable")]
        top = [(int(i), float(logp[i])) for i in best]
    return TokenLogprobs(float(logp[token]), top)


class StopMatcher:
    """Holds back text that could still become a stop string; reports when one appears."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was found)."""
        self.pending += text
        for stop in self.stops:
            at = self.pending.find(stop)
            if at >= 0:
                out, self.pending = self.pending[:at], ""
                return out, True
        hold = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.pending)), 0, -1):
                if self.pending.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Sequence:
    """A generation's state from its prompt to its finish (see the module's docstring).
    max_tokens: tokens to generate at most; max_length: tokens (prompt and generated) the
    sequence may hold, None for no limit (a ring cache slides); n_logprobs: None, or each
    Chunk carries its token's log-probability and the n best."""

    def __init__(self, tokenizer, prompt_ids: list[int], max_tokens: int, sampling: SamplingParams | None = None,
                 stop=(), ignore_eos: bool = False, n_logprobs: int | None = None, max_length: int | None = None):
        self.tokens = list(prompt_ids)     # prompt and generated tokens, in order
        self.n_prompt = len(self.tokens)
        self.max_tokens, self.max_length = max_tokens, max_length
        self.sampler = Sampler(sampling or SamplingParams())
        self.eog = set() if ignore_eos else tokenizer.eog_ids
        self.n_logprobs = n_logprobs
        self.timings = Timings()
        self.finish_reason: str | None = None
        self._decoder = tokenizer.stream_decoder()
        self._stops = StopMatcher(list(stop))

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.n_prompt:]

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def choose(self, logits: np.ndarray, guess: int | None = None) -> int:
        """The next token from logits (n_vocab,): sampled, or, for a guessed token, the guess
        kept or replaced so that the tokens follow the sampler's distribution (Sampler.verify)."""
        if guess is None:
            return self.sampler(logits, self.tokens)
        return self.sampler.verify(logits, self.tokens, guess)

    def take(self, token: int, logits: np.ndarray | None = None) -> list[Chunk]:
        """The Chunks a chosen token streams: its text, and when it ends the sequence (an end
        token, a stop string, max_tokens or max_length) a finish_reason on the last one.
        logits: the row it was chosen from (for logprobs)."""
        if token in self.eog:
            return [self.finish("stop")]
        self.tokens.append(token)
        self.timings.n_generated += 1
        text, stopped = self._stops.push(self._decoder.feed(token))
        logprobs = None if self.n_logprobs is None else token_logprobs(logits, token, self.n_logprobs)
        if stopped:
            self.finish_reason = "stop"
            return [Chunk(text, token, "stop", self.timings, logprobs)]
        chunks = [Chunk(text, token, None, self.timings, logprobs)]
        if self.timings.n_generated >= self.max_tokens or (self.max_length and len(self.tokens) >= self.max_length):
            chunks.append(self.finish("length"))
        return chunks

    def finish(self, reason: str) -> Chunk:
        """End the sequence: the last Chunk, with the text held back so far."""
        text, _ = self._stops.push(self._decoder.flush())
        self.finish_reason = reason
        return Chunk(text + self._stops.flush(), None, reason, self.timings)
