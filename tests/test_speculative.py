"""Speculative decoding: guesses verified in one pass give plain decoding's tokens (greedy) or
its distribution (sampled), whatever is guessed, accepted or rolled back."""
import json
import math
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

import minillm
from conftest import REPORT, loaded_model, model_path
from minillm.errors import MinillmError
from minillm.generate import Session
from minillm.quantize import quantize
from minillm.sampling import Sampler, SamplingParams
from minillm.speculative import DraftModel, PromptLookup, Speculation, SpeculationParams, make_speculation

GREEDY = SamplingParams(temperature=0)
FALSE_ALARM = 1e-3  # the statistical tests' chance of failing on a correct implementation


def chi2_critical(df: int, alpha: float = FALSE_ALARM) -> float:
    """The chi-square quantile 1 - alpha (Wilson-Hilferty; z for alpha = 1e-3)."""
    z = {1e-3: 3.0902}[alpha]
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


class FixedGuesses:
    """A guesser that proposes given tokens after given history lengths (tests)."""

    cost = 0.0
    first_prior, then_prior = (0.6,), (0.8,)

    def __init__(self, table):
        self.table = table  # len(history) -> guesses

    def start(self, prompt_ids):
        pass

    def classify(self, history):
        return 0

    def propose(self, history, n):
        return list(self.table.get(len(history), []))[:n]


class Always(Speculation):
    """Guess whenever the guesser has something, as many as it has (no adaptive count)."""

    def n_to_guess(self, cls=0):
        return self.params.draft_max


# ---- prompt lookup ------------------------------------------------------------------------

def test_lookup_proposes_what_followed_the_best_match():
    history = [1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4]
    assert PromptLookup(3).propose(history, 3) == [7, 8, 2]   # [2, 3, 4] last seen before 7
    assert PromptLookup(3).propose(history, 9) == [7, 8, 2, 3, 4]
    assert PromptLookup(3).propose([5, 6, 7, 1, 6, 7], 2) == [1, 6]  # only the 2-gram [6, 7] matches
    assert PromptLookup(3).propose([5, 6, 1, 6], 2) == []              # a single token is not matched
    assert PromptLookup(1).propose([5, 6, 1, 6], 2) == [1, 6]          # unless ngram is 1
    assert PromptLookup(3).propose([1, 2, 3], 4) == []
    # [2, 3, 4] occurs twice; before the first, [0, 1] agrees with the history's end too: it wins
    history = [0, 1, 2, 3, 4, 5, 6, 9, 2, 3, 4, 7, 0, 1, 2, 3, 4]
    assert PromptLookup(3).propose(history, 2) == [5, 6]


def test_lookup_classes_its_guesses_by_how_long_the_match_agrees():
    def classify(history):
        return PromptLookup(3).classify(history)

    assert classify([5, 6, 1, 6]) is None                 # no match
    assert classify([5, 6, 7, 1, 6, 7]) == 0              # a 2-gram
    assert classify([5, 6, 7, 1, 5, 6, 7]) == 1           # a 3-gram
    passage = list(range(100, 120))
    assert classify(passage + [0] + passage[:6]) == 2     # 6 tokens agree
    assert classify(passage + [0] + passage[:12]) == 3
    assert classify(passage + [0] + passage[:19]) == 4    # 16 or more


def test_guess_count_follows_each_class_acceptance():
    """Guesses of a class that keeps being rejected stop; another class still guesses."""
    spec = Speculation(PromptLookup(3), SpeculationParams())
    spec.timed(1, 0.01)
    assert spec.n_to_guess(4) > spec.n_to_guess(0) > 0
    for _ in range(20):
        spec.cls, spec.run = 0, 0
        spec.judged(False)
    assert spec.n_to_guess(0) == 0 and spec.n_to_guess(4) > 0
    spec.timed(5, 0.02)   # 4 guesses cost 2 lone steps: the slope and pass_cost[4] learn it
    assert spec.measured[4] and spec.pass_cost[4] == 2.0 and spec.slope < 0.3


def test_lookup_index_follows_a_growing_history():
    look = PromptLookup(2)
    history = [10, 11, 12, 13]
    assert look.propose(history, 2) == []
    history += [10, 11]
    assert look.propose(history, 2) == [12, 13]
    history += [14, 10, 11]
    assert look.propose(history, 1) == [14]  # of equal agreements, the latest occurrence wins
    look.start([])
    assert look.propose([1, 2, 3, 1, 2], 1) == [3]


# ---- sampling: exact distribution ---------------------------------------------------------

@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02),
    SamplingParams(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.3),
])
def test_verify_draws_the_samplers_distribution(params):
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(60) * 2).astype(np.float32)
    history = [3, 3, 5, 8]
    ids, probs = Sampler(params).distribution(logits, history)
    n = 20000
    for guess in (int(ids[0]), int(ids[len(ids) // 2]), 59 if 59 not in ids else 58):
        sampler = Sampler(SamplingParams(**{**params.as_dict(), "seed": 11}))
        counts = Counter(sampler.verify(logits, history, guess) for _ in range(n))
        assert set(counts) <= set(ids.tolist())
        observed = np.array([counts[int(i)] for i in ids])
        expected = probs * n
        keep = expected >= 5  # pool the rare tokens
        obs = np.append(observed[keep], observed[~keep].sum())
        exp = np.append(expected[keep], expected[~keep].sum())
        obs, exp = obs[exp > 0], exp[exp > 0]
        chi2 = float(((obs - exp) ** 2 / exp).sum())
        assert chi2 < chi2_critical(len(obs) - 1), (guess, chi2)


def test_verify_greedy_is_the_argmax():
    logits = np.array([0.1, 2.0, 1.9, -1.0], np.float32)
    sampler = Sampler(GREEDY)
    assert sampler.verify(logits, [], 1) == 1
    assert sampler.verify(logits, [], 2) == 1


@pytest.mark.slow
def test_sampled_tokens_with_guesses_follow_plain_sampling():
    """The first two sampled tokens after a prompt, over many seeds: the second is judged on a
    guessed row (the third comes from the row after the guess). Their joint distribution with
    speculation and without must agree (chi-square homogeneity, the stated false-alarm rate)."""
    model = loaded_model("smollm2")
    ids = model.prompt_ids("I like to eat")
    params = dict(temperature=0.8, top_k=5, top_p=1.0, min_p=0.0)
    greedy = model.generate("I like to eat", 2, temperature=0).tokens
    session = Session(model, n_ctx=256)
    speculation = Always(FixedGuesses({len(ids) + 1: [greedy[1]]}), SpeculationParams(draft_max=1))
    samples = {"plain": Counter(), "guessed": Counter()}
    judged = Counter()
    for seed in range(200):
        for kind, spec in (("plain", None), ("guessed", speculation)):
            chunks = list(session.generate(ids, 3, SamplingParams(**params, seed=seed), speculation=spec))
            samples[kind][tuple(c.token for c in chunks if c.token is not None)[:2]] += 1
            judged.update(drafted=chunks[-1].timings.n_drafted, accepted=chunks[-1].timings.n_accepted)
    assert judged["drafted"] > 100 and 0 < judged["accepted"] < judged["drafted"]
    outcomes = sorted(set(samples["plain"]) | set(samples["guessed"]),
                      key=lambda o: -(samples["plain"][o] + samples["guessed"][o]))
    table = np.array([[samples[k][o] for o in outcomes] for k in ("plain", "guessed")], float)
    common = table.sum(axis=0) >= 10  # pool the rare outcomes
    table = np.column_stack([table[:, common], table[:, ~common].sum(axis=1)])
    table = table[:, table.sum(axis=0) > 0]
    expected = table.sum(axis=1, keepdims=True) * table.sum(axis=0) / table.sum()
    chi2 = float(((table - expected) ** 2 / expected).sum())
    assert table.shape[1] >= 3
    assert chi2 < chi2_critical(table.shape[1] - 1), (chi2, table)


# ---- greedy: the tokens of plain decoding -------------------------------------------------

PROMPTS = [
    [{"role": "user", "content": "Copy this sentence exactly: the quick brown fox jumps over the lazy dog, "
                                 "and the dog sleeps on in the sun."}],
    [{"role": "user", "content": "List the days of the week, then list them again in reverse order."}],
    "Once upon a time, in a small village by the sea,",
]


def greedy_pair(model, prompt, n, n_ctx, speculation):
    """(plain greedy tokens, the tokens with speculation, the latter's timings)."""
    ids = model.prompt_ids(prompt)
    plain = [c.token for c in Session(model, n_ctx=n_ctx).generate(ids, n, GREEDY, ignore_eos=True)
             if c.token is not None]
    session = Session(model, n_ctx=n_ctx)
    chunks = list(session.generate(ids, n, GREEDY, ignore_eos=True, speculation=speculation))
    assert session.cache.n_past == len(session.tokens)
    return plain, [c.token for c in chunks if c.token is not None], chunks[-1].timings


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_greedy_lookup_gives_plain_tokens(name):
    model = loaded_model(name)
    drafted = accepted = 0
    for prompt in PROMPTS:
        speculation = make_speculation(model, 4096, lookup=True)
        plain, guessed, t = greedy_pair(model, prompt, 48, 4096, speculation)
        assert guessed == plain, prompt
        drafted, accepted = drafted + t.n_drafted, accepted + t.n_accepted
    REPORT.append(f"{name}: greedy with prompt lookup identical to plain on {len(PROMPTS)} prompts; "
                  f"{accepted}/{drafted} guesses accepted")
    assert 0 < accepted < drafted  # guesses both accepted and rejected


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_scheduler_lookup_requests_give_plain_tokens(name):
    """Lookup as a per-request option of the batching scheduler, beside requests without it:
    each greedy request's tokens equal its plain run alone; guesses both accepted and rejected;
    the slot keeps only accepted guesses' cells (the next turn reuses them: only its new
    tokens are evaluated, and its tokens equal its run alone)."""
    from minillm.serving.scheduler import Request

    model = loaded_model(name)
    requests = [Request(p, 40, GREEDY, ignore_eos=True, lookup=i != 1, id=i) for i, p in enumerate(PROMPTS)]
    scheduler = model.scheduler(parallel=3)
    handles = [scheduler.submit(r) for r in requests]
    scheduler.run(handles)
    results = [h.result() for h in handles]
    drafted = accepted = 0
    for handle, request, result in zip(handles, requests, results):
        alone = model.scheduler(parallel=1).submit(replace(request, lookup=False)).result()
        assert result.tokens == alone.tokens, request.prompt
        drafted, accepted = drafted + handle.timings.n_drafted, accepted + handle.timings.n_accepted
    assert handles[1].timings.n_drafted == 0 and 0 < accepted < drafted
    REPORT.append(f"{name}: scheduler requests with lookup identical to plain; {accepted}/{drafted} guesses accepted")
    # the slot holds the prompt and every generated token but the last, accepted guesses included
    follow = handles[0].prompt_ids + results[0].tokens + model.tokenize(" Once more.", add_bos=False)
    evaluated = scheduler.stats()["evaluated"]
    again = scheduler.submit(Request(follow, 8, GREEDY, ignore_eos=True))
    tokens = again.result().tokens
    assert again.n_cached == len(handles[0].prompt_ids) + len(results[0].tokens) - 1
    assert scheduler.stats()["evaluated"] - evaluated == len(follow) - again.n_cached + 7
    assert tokens == model.scheduler(parallel=1).submit(Request(follow, 8, GREEDY, ignore_eos=True)).result().tokens


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_greedy_lookup_past_the_context(name):
    """With --ctx 256 generation runs past the context (the global ring wraps): guessing
    pauses where rolled-back rows would overwrite cells still attended to; tokens unchanged."""
    model = loaded_model(name)
    prompt = PROMPTS[1]
    n = 300 - len(model.prompt_ids(prompt))
    plain, guessed, t = greedy_pair(model, prompt, n, 256, Always(PromptLookup(3), SpeculationParams()))
    assert guessed == plain
    assert t.n_drafted > 0


@pytest.fixture(scope="module")
def requantized(tmp_path_factory):
    """name -> the model requantized to Q8_0 (a draft of the same vocabulary)."""
    out = {}
    for name in ("smollm2", "gemma3"):
        path = tmp_path_factory.mktemp("draft") / f"{name}-q8_0.gguf"
        quantize(model_path(name), path, "Q8_0", allow_requantize=True)
        out[name] = path
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_greedy_draft_model_gives_plain_tokens(name, requantized):
    model, draft = loaded_model(name), minillm.load(requantized[name])
    drafted = accepted = 0
    for prompt in PROMPTS:
        speculation = Always(DraftModel(draft, model, 4096, p_min=0.0), SpeculationParams(draft_max=6))
        plain, guessed, t = greedy_pair(model, prompt, 48, 4096, speculation)
        assert guessed == plain, prompt
        drafted, accepted = drafted + t.n_drafted, accepted + t.n_accepted
    REPORT.append(f"{name}: greedy with its Q8_0 as draft identical to plain; {accepted}/{drafted} guesses accepted")
    assert 0 < accepted < drafted
    # left to itself, a draft larger than the model is not used: no prompt read, no probe
    speculation = make_speculation(model, 4096, draft=draft)
    assert not speculation.active
    plain, guessed, t = greedy_pair(model, PROMPTS[0], 40, 4096, speculation)
    assert guessed == plain and t.n_drafted == 0 and speculation.guesser.session.tokens == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_scheduler_draft_requests_give_plain_tokens(name, requantized, monkeypatch):
    """A draft model as a per-request option of the batching scheduler: each slot decodes the
    draft in a session of its own, which reads the prompt chunk by chunk beside the model and
    follows whichever request runs in the slot. Guessing is forced every step (the adaptive
    count would switch a draft as costly as the model off), and every other pass's last guess
    is made wrong (a Q8_0 draft agrees with its model almost always), so that rows are
    rolled back. Each greedy request's tokens equal its plain run alone."""
    from minillm.serving.scheduler import Request

    model, draft = loaded_model(name), minillm.load(requantized[name])
    propose, calls = DraftModel.propose, []

    def sometimes_wrong(self, history, n):
        guesses = propose(self, history, n)
        calls.append(n)
        if len(calls) % 2 and guesses:
            guesses[-1] = (guesses[-1] + 1) % model.n_vocab
        return guesses

    follow, chunks = DraftModel.follow, []

    def counted_follow(self, tokens):
        chunks.append(len(tokens))
        follow(self, tokens)

    monkeypatch.setattr(Speculation, "n_to_guess", lambda self, cls=0: self.params.draft_max)
    monkeypatch.setattr(Speculation, "expects_to_guess", lambda self: True)
    monkeypatch.setattr(DraftModel, "propose", sometimes_wrong)
    monkeypatch.setattr(DraftModel, "follow", counted_follow)
    prompts = PROMPTS + [[{"role": "user", "content": "Name three rivers of Europe."}]]
    requests = [Request(p, 48, GREEDY, ignore_eos=True, draft=i != 1, id=i) for i, p in enumerate(prompts)]
    scheduler = model.scheduler(parallel=2, batch=16, draft=draft, speculation={"draft_max": 4, "p_min": 0.0})
    handles = [scheduler.submit(r) for r in requests]  # 4 requests, 2 slots: slots change hands
    scheduler.run(handles)
    drafted = accepted = 0
    for handle, request in zip(handles, requests):
        alone = model.scheduler(parallel=1).submit(replace(request, draft=False)).result()
        assert handle.result().tokens == alone.tokens, request.prompt
        drafted, accepted = drafted + handle.timings.n_drafted, accepted + handle.timings.n_accepted
    assert handles[1].timings.n_drafted == 0 and 0 < accepted < drafted
    sessions = [s.draft_session for s in scheduler.slots if s.draft_session is not None]
    assert 1 <= len(sessions) <= 2  # one per slot at most, not one per request
    assert len(chunks) >= 3 and min(chunks) <= 16  # prompts read in chunks of the step's 16 rows
    last = handles[-1]
    assert not last.running and sessions  # the draft read its prompt, chunk by chunk, then its tokens
    held = next(s for s in scheduler.slots if s.draft_session is not None and s.tokens[:5] == last.prompt_ids[:5])
    assert held.draft_session.tokens[:len(last.prompt_ids)] == last.prompt_ids
    REPORT.append(f"{name}: scheduler requests with a draft identical to plain; {accepted}/{drafted} guesses accepted")
    monkeypatch.undo()  # a draft larger than the model cannot pay: its requests decode plainly
    assert not scheduler.speculation_for(Request("Hello", 4, draft=True)).active
    with pytest.raises(MinillmError, match="no draft model"):
        model.scheduler(parallel=1).submit(Request("Hello", 4, draft=True))
    with pytest.raises(MinillmError, match="draft_max 0"):
        model.scheduler(parallel=1, speculation={"draft_max": 0})
    with pytest.raises(MinillmError, match="not both"):
        scheduler.submit(Request("Hello", 4, draft=True, lookup=True))
    other = loaded_model("gemma3" if name == "smollm2" else "smollm2")
    with pytest.raises(MinillmError, match="vocabulary"):
        model.scheduler(parallel=1, draft=other)


# ---- accounting, rollback, stops ----------------------------------------------------------

@pytest.mark.slow
def test_accounting_and_rollback():
    """Guesses right for two tokens then wrong, every step: two accepted a step, the rest rolled
    back; the cache holds exactly the tokens kept, and the session's next turn reuses it."""
    model = loaded_model("smollm2")
    prompt = PROMPTS[2]
    ids = model.prompt_ids(prompt)
    plain = model.generate(prompt, 30, temperature=0).tokens
    table = {}
    for at in range(1, 24, 3):  # after token at-1 was sampled: guess plain[at], plain[at+1], then a wrong one
        table[len(ids) + at] = [plain[at], plain[at + 1], (plain[at + 2] + 1) % model.n_vocab]
    session = Session(model)
    speculation = Always(FixedGuesses(table), SpeculationParams(draft_max=3))
    chunks = list(session.generate(ids, 30, GREEDY, speculation=speculation))
    assert [c.token for c in chunks if c.token is not None] == plain
    t = chunks[-1].timings
    assert (t.n_drafted, t.n_accepted) == (3 * len(table), 2 * len(table))
    assert session.cache.n_past == len(session.tokens) == len(ids) + 29
    assert session.tokens == ids + plain[:29]
    again = [c.token for c in session.generate(ids + plain[:10], 10, GREEDY) if c.token is not None]
    assert session.n_evaluated == 1 and again == plain[10:20]


@pytest.mark.slow
def test_end_token_and_stop_string_inside_accepted_guesses():
    model = loaded_model("smollm2")
    prompt = [{"role": "user", "content": "Say hello."}]
    ids = model.prompt_ids(prompt)
    plain = model.generate(prompt, 64, temperature=0)
    assert plain.finish_reason == "stop" and len(plain.tokens) > 4
    eos = int(np.argmax(model.logits(ids + plain.tokens)[-1]))  # the end token greedy decoding chose
    assert eos in model.tokenizer.eog_ids
    run = plain.tokens + [eos, 5, 6]
    guesses = {len(ids) + 1: run[1:]}  # all of it, end token included, after the first token
    session = Session(model)
    chunks = list(session.generate(ids, 64, GREEDY, speculation=Always(FixedGuesses(guesses), SpeculationParams())))
    assert [c.token for c in chunks if c.token is not None] == plain.tokens
    assert chunks[-1].finish_reason == "stop" and "".join(c.text for c in chunks) == plain.text
    assert session.cache.n_past == len(session.tokens) == len(ids) + len(plain.tokens)
    stop = plain.text[len(plain.text) // 2:][:3]
    cut = model.generate(prompt, 64, temperature=0, stop=[stop])
    session = Session(model)
    chunks = list(session.generate(ids, 64, GREEDY, stop=[stop],
                                   speculation=Always(FixedGuesses(guesses), SpeculationParams())))
    assert "".join(c.text for c in chunks) == cut.text and chunks[-1].finish_reason == "stop"
    assert session.cache.n_past == len(session.tokens)


@pytest.mark.slow
def test_draft_with_another_vocabulary_is_refused():
    with pytest.raises(MinillmError, match="vocabulary"):
        make_speculation(loaded_model("smollm2"), 4096, draft=loaded_model("gemma3"))
    with pytest.raises(MinillmError, match="not both"):
        make_speculation(loaded_model("smollm2"), 4096, draft=loaded_model("smollm2"), lookup=True)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_lookup_reports_guesses_and_keeps_the_output():
    common = ["generate", str(model_path("smollm2")), "--chat", "-p", PROMPTS[0][0]["content"], "--temp", "0",
              "-n", "40", "--json"]
    plain, guessed = json.loads(run_cli(*common).stdout), json.loads(run_cli(*common, "--lookup").stdout)
    assert guessed["tokens"] == plain["tokens"] and guessed["text"] == plain["text"]
    assert guessed["accepted_tokens"] > 0 and guessed["drafted_tokens"] >= guessed["accepted_tokens"]
    assert "drafted_tokens" not in plain
    out = run_cli("generate", str(model_path("smollm2")), "-p", "Hi", "-n", "8", "--lookup", "-v")
    assert out.returncode == 0 and "generated 8 tokens" in out.stderr


@pytest.mark.slow
def test_cli_batch_file_takes_draft_and_lookup_as_the_lines_defaults(tmp_path):
    """generate --batch-file with --draft (or --lookup): every line guesses unless it says
    otherwise, its record counts the guesses, and the texts are the plain run's (greedy)."""
    lines = tmp_path / "in.jsonl"
    lines.write_text("\n".join(json.dumps(item) for item in [
        {"id": "a", "prompt": "Copy this: one two three four five six."},
        {"id": "b", "prompt": "Count from one to ten:", "draft": False, "lookup": False},
        {"id": "c", "messages": [{"role": "user", "content": "Name the days of the week."}]}]) + "\n")
    common = ["generate", str(model_path("smollm2")), "--batch-file", str(lines), "--temp", "0", "-n", "24",
              "--parallel", "2"]
    plain = [json.loads(line) for line in run_cli(*common).stdout.splitlines()]
    for flags in (["--draft", str(model_path("smollm2")), "--draft-max", "4"], ["--lookup"]):
        out = run_cli(*common, *flags)
        assert out.returncode == 0, out.stderr
        records = [json.loads(line) for line in out.stdout.splitlines()]
        assert [r["text"] for r in records] == [r["text"] for r in plain]
        assert "drafted_tokens" in records[0] and "accepted_tokens" in records[2]
        assert "drafted_tokens" not in records[1] and "drafted_tokens" not in plain[0]
    out = run_cli(*common, "--lookup", "--draft", str(model_path("smollm2")))
    assert out.returncode == 2 and "choose one" in out.stderr


@pytest.mark.slow
def test_cli_draft_with_another_vocabulary_is_one_error_line():
    out = run_cli("generate", str(model_path("smollm2")), "-p", "Hi", "-n", "4", "--draft", str(model_path("gemma3")))
    assert out.returncode == 1 and out.stdout == ""
    assert "vocabulary" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_bench_lookup_reports_both_prompt_sets():
    out = run_cli("bench", str(model_path("smollm2")), "--lookup", "-n", "6", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert [s["prompts"] for s in result["sets"]] == ["copy", "open"]
    for s in result["sets"]:
        assert s["identical"] and s["tokens"] > 0 and s["plain_tokens_per_s"] > 0 and s["speedup"] > 0
    assert run_cli("bench", str(model_path("smollm2")), "--lookup", "--draft", "x.gguf").returncode == 2


def test_lookup_and_draft_are_fields_of_batch_lines_and_server_requests():
    from minillm.serving.batch_input import make_request
    from minillm.serving.protocol import ApiError, parse_completion

    assert make_request({"prompt": "Hi", "lookup": True}).lookup and not make_request({"prompt": "Hi"}).lookup
    with pytest.raises(MinillmError, match="'lookup' must be true or false"):
        make_request({"prompt": "Hi", "lookup": "yes"})
    # the command's --draft / --lookup are the lines' defaults; a line may say otherwise
    assert make_request({"prompt": "Hi"}, draft=True).draft and make_request("Hi", draft=True).draft
    assert not make_request({"prompt": "Hi", "draft": False}, draft=True).draft
    with pytest.raises(MinillmError, match="'draft' must be true or false"):
        make_request({"prompt": "Hi", "draft": 1})
    body = {"messages": [{"role": "user", "content": "Hi"}], "lookup": True}
    assert parse_completion(body, True, GREEDY, 2048).request.lookup
    with pytest.raises(ApiError, match="'lookup' must be true or false"):
        parse_completion(dict(body, lookup=1), True, GREEDY, 2048)
    # a server with a draft model uses it unless a request says "draft": false or asks for lookup
    plain = {"messages": body["messages"]}
    assert parse_completion(plain, True, GREEDY, 2048, draft=True).request.draft
    assert not parse_completion(plain, True, GREEDY, 2048).request.draft
    assert not parse_completion(dict(plain, draft=False), True, GREEDY, 2048, draft=True).request.draft
    assert not parse_completion(body, True, GREEDY, 2048, draft=True).request.draft
