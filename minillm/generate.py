"""The generation loop: prefill the prompt, then sample one token at a time, streaming
small results (text piece, token, finish reason, timings) as they come."""
from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .errors import MinillmError
from .sampling import Sampler, SamplingParams

N_KEEP = 4  # attention-sink tokens kept when decoding runs past the context


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
class Chunk:
    """One step of a streamed generation."""
    text: str                          # new text (may be empty while a stop string is pending)
    token: int | None                  # the sampled token id (None on the final chunk)
    finish_reason: str | None = None   # "stop" (end token or stop string) or "length"
    timings: Timings = field(default_factory=Timings)
    logprobs: "TokenLogprobs | None" = None  # when the request asked for them (scheduler.Request.logprobs)


@dataclass
class TokenLogprobs:
    """The sampled token's log-probability under the model's distribution (the raw logits'
    softmax, before any sampler setting), and the most likely tokens with theirs."""
    logprob: float
    top: list[tuple[int, float]]       # (token id, logprob), best first


def token_logprobs(logits: np.ndarray, token: int, n_top: int) -> TokenLogprobs:
    """log-softmax of logits (n_vocab,) at token, and the n_top best tokens."""
    x = logits.astype(np.float64)
    shifted = x - x.max()
    log_z = np.log(np.exp(shifted).sum())
    top = []
    if n_top > 0:
        best = np.argpartition(-x, n_top - 1)[:n_top]
        best = best[np.argsort(-x[best], kind="stable")]
        top = [(int(i), float(shifted[i] - log_z)) for i in best]
    return TokenLogprobs(float(shifted[token] - log_z), top)


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


class Session:
    """A model, its tokenizer and one KV cache; keeps the evaluated tokens so that a new
    prompt sharing a prefix with them (the next chat turn) only evaluates what is new."""

    def __init__(self, model, n_ctx: int | None = None, batch_size: int = 512):
        self.model = model
        self.tokenizer = model.tokenizer
        self.n_ctx = n_ctx or min(4096, model.hp.n_ctx_train)
        self.batch_size = min(batch_size, self.n_ctx - N_KEEP)
        self.cache = model.new_cache(self.n_ctx, n_keep=N_KEEP, batch_size=self.batch_size)
        self.tokens: list[int] = []  # every token evaluated into the cache, in order

    def reset(self) -> None:
        self.cache.clear()
        self.tokens = []

    def check_prompt(self, ids: list[int], truncate: bool) -> list[int]:
        limit = self.n_ctx - 1
        if len(ids) > limit:
            if not truncate:
                raise MinillmError(f"the prompt is {len(ids)} tokens, {len(ids) - limit} more than the context "
                                   f"of {self.n_ctx} allows (at most {limit}); raise --ctx or use --truncate")
            ids = ids[len(ids) - limit:]
        return ids

    def prefill(self, ids: list[int]) -> np.ndarray:
        """Evaluate ids after the longest cached prefix; the logits of the last token."""
        reuse = 0
        if not self.cache.wrapped:
            while reuse < min(len(ids) - 1, len(self.tokens)) and ids[reuse] == self.tokens[reuse]:
                reuse += 1
        if reuse < len(self.tokens):
            if self.cache.wrapped:
                reuse = 0
                self.cache.clear()
            else:
                self.cache.truncate(reuse)
            del self.tokens[reuse:]
        logits = self.model.eval(ids[reuse:], self.cache, logits_from=len(ids) - reuse - 1,
                                 batch_size=self.batch_size)
        self.tokens.extend(ids[reuse:])
        self.n_evaluated = len(ids) - reuse
        return logits[-1]

    def generate(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams | None = None,
                 stop: list[str] = (), truncate: bool = False, ignore_eos: bool = False,
                 speculation=None) -> Iterator[Chunk]:
        """Stream the continuation of prompt_ids (see Chunk); the last chunk has a finish_reason.
        ignore_eos: keep going through end-of-generation tokens (for benchmarks). speculation:
        a speculative.Speculation that guesses tokens to verify several a pass."""
        params = params or SamplingParams()
        sampler = Sampler(params)
        prompt_ids = self.check_prompt(list(prompt_ids), truncate)
        timings = Timings()
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids)
        if speculation is not None:
            speculation.start(prompt_ids)  # a draft model evaluates the prompt too
        timings.n_prompt, timings.prompt_s = self.n_evaluated, time.perf_counter() - t0
        decoder = self.tokenizer.stream_decoder()
        stops = StopMatcher(list(stop))
        eog = set() if ignore_eos else self.tokenizer.eog_ids
        history = list(prompt_ids)
        rows = deque([(logits, None)])  # evaluated rows not sampled yet: (logits, the token guessed there)
        t1 = time.perf_counter()
        finish = "length"
        for n in range(max_tokens):
            logits, guess = rows.popleft()
            if guess is None:
                token = sampler(logits, history)
            else:
                token = sampler.verify(logits, history, guess)
                speculation.judged(token == guess)
                if token != guess:  # the rows after a replaced guess followed the wrong token
                    self._take_back(len(rows))
                    rows.clear()
            if token in eog:
                finish = "stop"
                break
            history.append(token)
            timings.n_generated += 1
            text, stopped = stops.push(decoder.feed(token))
            if stopped:
                self._settle(rows, timings, speculation, t1)
                yield Chunk(text, token, "stop", timings)  # the text before the stop string
                return
            self._settle((), timings, speculation, t1)
            yield Chunk(text, token, None, timings)
            if not rows and n + 1 < max_tokens:
                rows.extend(self._advance(history, max_tokens - n - 1, speculation))
        self._settle(rows, timings, speculation, t1)
        text, _ = stops.push(decoder.flush())
        yield Chunk(text + stops.flush(), None, finish, timings)

    def _settle(self, rows_left, timings: Timings, speculation, t1: float) -> None:
        """Bring timings up to date; rows_left (evaluated past the last token sampled) go."""
        self._take_back(len(rows_left))
        if speculation is not None:
            timings.n_drafted, timings.n_accepted = speculation.n_drafted, speculation.n_accepted
        timings.generate_s = time.perf_counter() - t1

    def _advance(self, history: list[int], n_left: int, speculation) -> list[tuple]:
        """Evaluate history's last token, and guesses after it when speculating: the rows
        (logits, the guess each row is to judge; None for the last)."""
        token = history[-1]
        guesses = []
        if speculation is not None:
            room = min(n_left, self.cache.headroom()) - 1  # the token itself takes a row
            guesses = speculation.guesses(history, room)
        ids = [token] + guesses
        t0 = time.perf_counter()
        if guesses:
            logits = self.model.backend.forward_each_alone(np.array(ids, np.int64), self.cache)
        else:
            logits = self.model.eval(ids, self.cache, batch_size=1)
        if speculation is not None:
            speculation.timed(len(ids), time.perf_counter() - t0)
        self.tokens.extend(ids)
        return list(zip(logits, guesses + [None]))

    def _take_back(self, n: int) -> None:
        """Forget the last n tokens evaluated (rows of guesses that were not taken)."""
        if n:
            del self.tokens[-n:]
            self.cache.rewind(len(self.tokens))


def beam_search(model, prompt_ids: list[int], max_tokens: int, n_beams: int, n_ctx: int | None = None,
                ignore_eos: bool = False) -> tuple[list[int], float]:
    """The most likely continuation (sum of token log-probabilities) among n_beams beams; each
    beam has its own KV cache. Returns (tokens, log-probability). Not streamed."""
    session = Session(model, n_ctx=n_ctx)
    prompt_ids = session.check_prompt(list(prompt_ids), truncate=False)
    eog = set() if ignore_eos else session.tokenizer.eog_ids
    beams = [([], 0.0, session.cache, session.prefill(prompt_ids))]  # (tokens, logp, cache, logits)
    finished: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        chosen = _best_extensions(beams, n_beams, eog, finished)
        if not chosen:
            break
        children = {}
        for _, _, parent in chosen:
            children[parent] = children.get(parent, 0) + 1
        extended = []
        for tokens, score, parent in chosen:
            children[parent] -= 1
            cache = beams[parent][2]
            if children[parent]:  # a parent's cache goes to its last child; the others copy it
                cache = copy.deepcopy(cache)
            extended.append((tokens, score, cache, model.eval([tokens[-1]], cache, batch_size=1)[-1]))
        beams = extended
    finished.extend((tokens, score) for tokens, score, _, _ in beams)
    return max(finished, key=lambda f: f[1])


def _best_extensions(beams, n_beams: int, eog: set[int], finished: list) -> list[tuple[list[int], float, int]]:
    """The n_beams best one-token extensions (tokens, logp, parent index); ends at an
    end-of-generation token move to finished."""
    candidates = []
    for parent, (tokens, score, _, logits) in enumerate(beams):
        logp = _log_softmax(logits)
        for tok in np.argpartition(-logp, n_beams)[:n_beams]:
            candidates.append((score + float(logp[tok]), parent, int(tok)))
    candidates.sort(key=lambda c: -c[0])
    chosen = []
    for score, parent, tok in candidates:
        if len(chosen) + len(finished) >= n_beams:
            break
        if tok in eog:
            finished.append((beams[parent][0], score))
        else:
            chosen.append((beams[parent][0] + [tok], score, parent))
    return chosen


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())
