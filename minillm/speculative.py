"""Speculative decoding: guess the next few tokens cheaply, then evaluate the last sampled
token and the guesses in one pass, each row computed as that token alone would be
(Backend.forward_each_alone), so every row's logits are those plain decoding would see.
Each guess is then accepted or replaced by the sampler (Sampler.verify), and the rows after
a replaced guess are dropped from the cache. Greedy output is token for token plain decoding's;
sampled output has its distribution.

Two kinds of guesses:
    PromptLookup  the last n tokens matched among the earlier ones (prompt and text so far):
                  what followed their latest occurrence
    DraftModel    a smaller model with the same vocabulary, decoding greedily

Speculation decides how many tokens to guess each step from the acceptance it has seen and the
measured cost of a pass (Speculation.n_to_guess), so that text which the guesses do not fit
costs little more than plain decoding.
"""
from __future__ import annotations

import time

import numpy as np

from .errors import MinillmError
from .params import SpeculationParams

PROBE_EVERY = 16  # when guessing does not pay, still guess one token this often, to notice a change


class PromptLookup:
    """Guesses from the token history itself: the last `ngram` tokens (then fewer, down to two:
    a single token's match guesses poorly) are looked up among the earlier ones, and the
    tokens that followed the best earlier occurrence are proposed: the one whose preceding
    tokens agree longest with the history's end (the latest among equals). How long that
    agreement is classes the guesses (`classify`): a passage being copied agrees for dozens of
    tokens and its guesses are nearly always kept; a short common phrase's often are not."""

    cost = 0.0  # guessing takes no time worth counting
    AGREEMENT_CLASSES = (3, 4, 8, 16)   # class c: agreement >= AGREEMENT_CLASSES[c - 1] (class 0: 2 tokens)
    # per class, the chances that a first guess is kept and a guess after a kept one (learned after)
    first_prior = (0.5, 0.6, 0.8, 0.9, 0.95)
    then_prior = (0.8, 0.8, 0.85, 0.9, 0.95)
    MAX_CANDIDATES = 64  # latest occurrences of an n-gram compared

    def __init__(self, ngram: int):
        self.ngram = ngram
        self.start([])

    def start(self, prompt_ids: list[int]) -> None:
        """A new generation: forget the history indexed."""
        # per n-gram size: n-gram -> the positions right after its occurrences that have a successor
        self.follows: list[dict[tuple, list[int]]] = [{} for _ in range(self.ngram + 1)]
        self.n_indexed = 0  # n-grams ending before this position are indexed
        self.last = (-1, None, 0)  # (history length, the match there): classify's, for propose

    def classify(self, history: list[int]) -> int | None:
        """The class of what propose would guess now (by the match's agreement); None: no match."""
        at, agreement = self._match(history)
        if at is None:
            return None
        return sum(agreement >= bound for bound in self.AGREEMENT_CLASSES)

    def propose(self, history: list[int], n: int) -> list[int]:
        at, _ = self._match(history)
        return [] if at is None else history[at:at + n]

    def _match(self, history: list[int]) -> tuple[int | None, int]:
        """(position after the best occurrence of the longest n-gram ending history, how many
        tokens before it agree with the history's end, at most the last class bound). The
        history only grows, so a match found at its length holds until it grows (Speculation
        classifies, then proposes)."""
        if self.last[0] != len(history):
            self.last = (len(history), *self._find(history))
        return self.last[1], self.last[2]

    def _find(self, history: list[int]) -> tuple[int | None, int]:
        self._index(history)
        for size in range(min(self.ngram, len(history) - 1), min(2, self.ngram) - 1, -1):  # longest first
            ends = self.follows[size].get(tuple(history[-size:]))
            if ends:
                candidates = ends[-self.MAX_CANDIDATES:]
                agreements = [self._agreement(history, end, size) for end in candidates]
                best = max(range(len(candidates)), key=lambda i: (agreements[i], i))
                return candidates[best], agreements[best]
        return None, 0

    def _agreement(self, history: list[int], end: int, size: int) -> int:
        """How many tokens before `end` equal the history's last ones (size already do)."""
        cap, n = self.AGREEMENT_CLASSES[-1], len(history)
        agree = size
        while agree < cap and agree < end and history[end - 1 - agree] == history[n - 1 - agree]:
            agree += 1
        return agree

    def _index(self, history: list[int]) -> None:
        for end in range(max(1, self.n_indexed), len(history)):  # n-grams ending at `end` (exclusive)
            for size in range(min(2, self.ngram), min(self.ngram, end) + 1):  # the sizes propose looks up
                self.follows[size].setdefault(tuple(history[end - size:end]), []).append(end)
        self.n_indexed = len(history)


class DraftModel:
    """Guesses by greedy decoding with a smaller model of the same vocabulary, in a session
    that follows the accepted tokens (its cache keeps the shared prefix): one of its own, or
    the one a batching scheduler lends the slot the request runs in (`session`, set on
    placement). The caller checks the vocabularies (check_same_vocabulary)."""

    # one class of guesses: the chances that a first guess is kept and a guess after a kept one
    first_prior, then_prior = (0.6,), (0.8,)

    def __init__(self, draft, target, n_ctx: int, p_min: float, own_session: bool = True):
        from .generate import Session

        self.session = Session(draft, n_ctx=n_ctx) if own_session else None
        self.p_min = p_min
        # a guess costs about a decode step of the draft: their weights' sizes, to start with
        self.cost = draft.path.stat().st_size / target.path.stat().st_size

    def start(self, prompt_ids: list[int]) -> None:
        """A new generation: the draft evaluates the prompt now, with the model's prompt
        (its session reuses the prefix it already holds); a lent session follows the prompt
        as the scheduler evaluates it (follow)."""
        if self.session is not None:
            self.session.prefill(prompt_ids)

    def follow(self, tokens: list[int]) -> None:
        """Evaluate what the session lacks of tokens (a prompt chunk the model just evaluated)."""
        if tokens:
            self.session.prefill(tokens)

    def classify(self, history: list[int]) -> int:
        return 0

    def propose(self, history: list[int], n: int) -> list[int]:
        logits = self.session.prefill(history)
        guesses = []
        while len(guesses) < n:
            token = int(np.argmax(logits))
            shifted = logits - logits[token]
            if 1.0 / np.exp(shifted, dtype=np.float64).sum() < self.p_min:
                break
            guesses.append(token)
            if len(guesses) == n or self.session.cache.headroom() < 1:
                break
            logits = self.session.model.eval([token], self.session.cache, batch_size=1)[-1]
            self.session.tokens.append(token)
        return guesses


def check_same_vocabulary(draft, target) -> None:
    """A draft must number the same tokens the same way, or its guesses mean other text."""
    a, b = draft.tokenizer.vocab, target.tokenizer.vocab
    if a.n_vocab != b.n_vocab or a.model != b.model:
        raise MinillmError(f"the draft model's vocabulary ({a.model}, {a.n_vocab} tokens) is not the model's "
                           f"({b.model}, {b.n_vocab} tokens): a draft must share the model's vocabulary")
    for i in range(a.n_vocab):
        if a.texts[i] != b.texts[i]:
            raise MinillmError(f"the draft model's token {i} is {a.texts[i]!r}, the model's {b.texts[i]!r}: "
                               "a draft must share the model's vocabulary")


class Speculation:
    """A session's guessing: the guesser, how many tokens to guess, the counts of a generation.

    The guess count k is the one with the most tokens per unit of time expected. A pass with k
    guesses yields 1 + a1 * (1 - ac^k) / (1 - ac) tokens, where a1 is the chance that the first
    guess is accepted and ac the chance that a guess is accepted after an accepted one (guesses
    come in runs: a copied passage, a draft in step with the model). Both are kept per class of
    guesses (the guesser's `classify`: for prompt lookup, how long the match agrees). A pass
    costs cost[k] times a lone step: the pass (measured for each k that has run; before that
    1 + slope * k, the slope learned from the passes that ran) plus the guessing (a draft
    model's steps: measured, and before that the ratio of the models' sizes). All are running
    averages, so the count follows the text: long runs while it copies, none where guesses do
    not pay (then one guess now and then, to notice a change)."""

    def __init__(self, guesser, params: SpeculationParams):
        self.guesser, self.params = guesser, params
        # (classes,) per class of guesses: acceptance of a first guess, of a guess after an accepted one
        self.first = np.array(guesser.first_prior, np.float64)
        self.then = np.array(guesser.then_prior, np.float64)
        self.counts = np.arange(params.draft_max + 1)  # (k,) the guess counts to choose from
        self.pass_cost = np.ones(len(self.counts))  # (k,) a pass of 1 + k rows / a lone step (read where measured)
        self.measured = self.counts == 0            # (k,) pass_cost[k] measured (k = 0: by definition)
        self.slope = 0.3                            # a guess row's cost / a lone step's, over all passes
        self.t_lone = None     # seconds of one plain decode step (measured)
        self.guess_cost = guesser.cost  # time to guess a token / a lone step (measured; a prior before)
        self.n_drafted = self.n_accepted = self.since_guess = self.run = 0
        self.cls = 0  # the class of the current pass's guesses
        self.n_streams = 1  # streams that wait while it guesses (a batching scheduler's step: all of them)
        self.active = True  # False: never guess (a draft not expected to pay: draft_speculation)

    def start(self, prompt_ids: list[int]) -> None:
        """A new generation: its counts start at zero (the estimates carry over)."""
        if self.active:
            self.guesser.start(prompt_ids)
        self.n_drafted = self.n_accepted = 0
        self.since_guess = 0
        self.run = 0  # guesses of the current pass judged so far

    def use_session(self, session) -> None:
        """A draft guesser decodes in this (generate.Session of the draft model) from now on:
        the batching scheduler lends each slot's own."""
        self.guesser.session = session

    def follow(self, tokens: list[int]) -> None:
        """The sequence has evaluated up to tokens (a prompt chunk): a draft reads them too."""
        if self.active:
            self.guesser.follow(tokens)

    def guesses(self, history: list[int], room: int) -> list[int]:
        """Tokens to evaluate after history's last one, at most room."""
        cls = self.guesser.classify(history) if room > 0 else None
        n = 0 if cls is None else min(self.n_to_guess(cls), room)
        if n <= 0 or n < self.params.draft_min:
            self.since_guess += 1
            return []
        t0 = time.perf_counter()
        guesses = self.guesser.propose(history, n)
        if guesses and self.guesser.cost and self.t_lone:
            spent = self.n_streams * (time.perf_counter() - t0) / len(guesses) / self.t_lone
            self.guess_cost = 0.8 * self.guess_cost + 0.2 * spent
        self.since_guess = self.run = 0
        if len(guesses) < max(1, self.params.draft_min):
            return []
        self.cls = cls
        self.n_drafted += len(guesses)
        return guesses

    def expects_to_guess(self) -> bool:
        """Whether guessing pays for some class of guesses, as far as it knows now (a draft that
        does not need not read a prompt beside the model)."""
        return bool(self._best_count(float(self.first.max()), float(self.then.max())))

    def n_to_guess(self, cls: int = 0) -> int:
        """The guess count with the most tokens per unit of time expected for guesses of class
        cls (see the class); 0 before a lone step has been timed."""
        if self.t_lone is None or not self.active:
            return 0
        best = self._best_count(self.first[cls], self.then[cls])
        if best == 0 and self.since_guess >= PROBE_EVERY and self._best_count(0.99, 0.99):
            return 1
        return best

    def _best_count(self, first: float, then: float) -> int:
        k = self.counts
        then = min(then, 0.99)
        tokens = 1 + first * (1 - then ** k) / (1 - then)
        passes = np.where(self.measured, self.pass_cost, 1.0 + self.slope * k)
        rate = tokens / (passes + k * self.guess_cost)
        best = int(np.argmax(rate))
        return best if rate[best] > 1.0 else 0

    def timed(self, n_rows: int, seconds: float) -> None:
        """Learn the cost of a pass of n_rows rows."""
        if n_rows == 1:
            self.t_lone = seconds if self.t_lone is None else 0.9 * self.t_lone + 0.1 * seconds
        elif self.t_lone:
            k, cost = n_rows - 1, seconds / self.t_lone
            self.pass_cost[k] = 0.7 * self.pass_cost[k] + 0.3 * cost if self.measured[k] else cost
            self.measured[k] = True
            self.slope = 0.8 * self.slope + 0.2 * max(cost - 1.0, 0.0) / k

    def judged(self, accepted: bool) -> None:
        """The sampler kept (accepted) or replaced the next guess of the pass."""
        self.n_accepted += accepted
        rates = self.first if self.run == 0 else self.then
        rates[self.cls] = 0.8 * rates[self.cls] + 0.2 * accepted
        self.run += 1


def guess_summary(timings) -> str:
    """'; guessed N tokens, accepted M (P%)' for the verbose lines, when tokens were guessed."""
    if not timings.n_drafted:
        return ""
    n, k = timings.n_drafted, timings.n_accepted
    return f"; guessed {n} tokens, accepted {k} ({100 * k / n:.0f}%)"


def check_params(params: SpeculationParams) -> None:
    """MinillmError naming the parameter when one is out of its range."""
    if params.draft_max < 1 or not 0 <= params.draft_min <= params.draft_max:
        raise MinillmError(f"draft_min {params.draft_min} and draft_max {params.draft_max}: "
                           "need 0 <= draft_min <= draft_max and draft_max >= 1", ("draft_min", "draft_max"))
    if not 0.0 <= params.p_min <= 1.0:
        raise MinillmError(f"p_min {params.p_min}: a probability, between 0 and 1", ("p_min",))
    if params.lookup_ngram < 1:
        raise MinillmError(f"lookup_ngram {params.lookup_ngram}: at least 1", ("lookup_ngram",))


def make_speculation(model, n_ctx: int, draft=None, lookup: bool = False,
                     params: SpeculationParams | None = None) -> Speculation | None:
    """A Speculation for one generation on model: guesses from a draft Model, or from prompt
    lookup; None when neither is asked for."""
    params = params or SpeculationParams()
    if draft is None and not lookup:
        return None
    if draft is not None and lookup:
        raise MinillmError("choose a draft model or prompt lookup, not both")
    model.backend.check_supports("speculation")
    check_params(params)
    if lookup:
        return Speculation(PromptLookup(params.lookup_ngram), params)
    check_same_vocabulary(draft, model)
    return draft_speculation(draft, model, n_ctx, params)


def draft_speculation(draft, model, n_ctx: int, params: SpeculationParams, own_session: bool = True) -> Speculation:
    """Guessing with a draft Model (the vocabularies checked). A draft that is not expected to
    pay even before anything is measured (its size against the model's: see Speculation) stays
    off (active False): it reads no prompt and never probes, since every probe would first
    catch up on the tokens it skipped, so decoding runs at plain speed."""
    spec = Speculation(DraftModel(draft, model, n_ctx, params.p_min, own_session), params)
    spec.active = spec.expects_to_guess()
    return spec
