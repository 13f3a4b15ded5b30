"""The generation loop: prefill the prompt, then sample one token at a time, streaming
small results (text piece, token, finish reason, timings) as they come."""
from __future__ import annotations

import copy
import time
from collections import deque
from typing import Iterator

import numpy as np

from .errors import MinillmError
from .sampling import SamplingParams
from .sequence import Chunk, Sequence, Timings, log_softmax

N_KEEP = 4  # attention-sink tokens kept when decoding runs past the context


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
        self._prompt_end = None     # recurrent state: where the last prompt's snapshot is
        self._pass_snapshot = None  # and the one before the last pass of guesses

    def reset(self) -> None:
        self.cache.clear()
        self.tokens = []

    def check_prompt(self, ids: list[int], truncate: bool) -> list[int]:
        limit = self.n_ctx - 1
        if len(ids) > limit:
            if not truncate:
                raise MinillmError(f"the prompt is {len(ids)} tokens, {len(ids) - limit} more than the context "
                                   f"of {self.n_ctx} allows (at most {limit}); raise n_ctx or use truncate",
                                   ("n_ctx", "truncate"))
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
            else:  # recurrent state: back to a snapshot there, or to the start
                reuse = self.cache.truncate(reuse)
            del self.tokens[reuse:]
        logits = self.model.eval(ids[reuse:], self.cache, logits_from=len(ids) - reuse - 1,
                                 batch_size=self.batch_size)
        self.tokens.extend(ids[reuse:])
        if self.cache.recurrent is not None:  # the next prompt may share this one whole
            self._prompt_end = len(self.tokens)
            self.cache.recurrent.save(self._prompt_end)
        self.n_evaluated = len(ids) - reuse
        return logits[-1]

    def generate(self, prompt_ids: list[int], max_tokens: int, params: SamplingParams | None = None,
                 stop: list[str] = (), truncate: bool = False, ignore_eos: bool = False,
                 speculation=None) -> Iterator[Chunk]:
        """Stream the continuation of prompt_ids (see Chunk); the last chunk has a finish_reason.
        ignore_eos: keep going through end-of-generation tokens (for benchmarks). speculation:
        a speculative.Speculation that guesses tokens to verify several a pass."""
        prompt_ids = self.check_prompt(list(prompt_ids), truncate)
        if self.cache.recurrent is not None:  # recurrent state cannot slide past the context: stop there
            max_tokens = min(max_tokens, self.n_ctx - len(prompt_ids) + 1)
        seq = Sequence(self.tokenizer, prompt_ids, max_tokens, params, stop, ignore_eos)
        timings = seq.timings
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids)
        if speculation is not None:
            speculation.start(prompt_ids)  # a draft model evaluates the prompt too
        timings.n_prompt, timings.prompt_s = self.n_evaluated, time.perf_counter() - t0
        rows = deque([(logits, None)])  # evaluated rows not sampled yet: (logits, the token guessed there)
        t1 = time.perf_counter()
        if max_tokens <= 0:
            self._settle(rows, timings, speculation, t1)
            yield seq.finish("length")
            return
        while True:
            logits, guess = rows.popleft()
            token = seq.choose(logits, guess)
            if guess is not None:
                speculation.judged(token == guess)
                if token != guess:  # the rows after a replaced guess followed the wrong token
                    self._take_back(len(rows))
                    rows.clear()
            chunks = seq.take(token)
            if seq.done:
                self._settle(rows, timings, speculation, t1)
                yield from chunks
                return
            self._settle((), timings, speculation, t1)
            yield from chunks
            if not rows:
                rows.extend(self._advance(seq.tokens, max_tokens - timings.n_generated, speculation))

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
        if guesses and self.cache.recurrent is not None:  # the state before them, to take guesses back
            self._snapshot_before_pass()
        if guesses:
            logits = self.model.backend.forward_each_alone(np.array(ids, np.int64), self.cache)
        else:
            logits = self.model.eval(ids, self.cache, batch_size=1)
        if speculation is not None:
            speculation.timed(len(ids), time.perf_counter() - t0)
        self.tokens.extend(ids)
        return list(zip(logits, guesses + [None]))

    def _take_back(self, n: int) -> None:
        """Forget the last n tokens evaluated (rows of guesses that were not taken). Recurrent
        state cannot be cut back: it returns to the snapshot before the pass, and the rows kept
        are evaluated again (each as alone, as the pass computed them)."""
        if not n:
            return
        del self.tokens[-n:]
        if self.cache.recurrent is None:
            self.cache.rewind(len(self.tokens))
            return
        kept = self.cache.truncate(len(self.tokens))
        if kept < len(self.tokens):
            self.model.backend.forward_each_alone(np.array(self.tokens[kept:], np.int64), self.cache)

    def _snapshot_before_pass(self) -> None:
        """Save the state after the tokens so far, in place of the last pass's snapshot (the
        prompt's own stays, for a next prompt that shares it)."""
        recurrent = self.cache.recurrent
        if self._pass_snapshot not in (None, len(self.tokens), self._prompt_end):
            recurrent.forget(self._pass_snapshot)
        self._pass_snapshot = len(self.tokens)
        recurrent.save(len(self.tokens))


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
        logp = log_softmax(logits)
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
