"""Generation: stops, sampling, the ring-buffer cache, chat-turn reuse, and the CLI."""
import json
import subprocess
import sys

import numpy as np
import pytest

import minillm
from conftest import REPORT, golden_rows, loaded_model, model_path
from minillm.generate import Session
from minillm.sequence import StopMatcher
from minillm.kv_cache import CacheGroup
from minillm.sampling import Sampler, SamplingParams
from synthetic import SyntheticModel


# ---- pieces -------------------------------------------------------------------------------

def test_stop_matcher_holds_back_possible_stops():
    m = StopMatcher(["</s>", "STOP"])
    assert m.push("Hello <") == ("Hello ", False)
    assert m.push("/") == ("", False)
    assert m.push("x") == ("</x", False)          # not a stop after all: released
    assert m.push(" and ST") == (" and ", False)
    assert m.push("OP more") == ("", True)         # the stop string and what follows are dropped
    m = StopMatcher([])
    assert m.push("abc") == ("abc", False)


def test_sampler_greedy_filters_and_seed():
    logits = np.array([1.0, 3.0, 2.0, -1.0], np.float32)
    assert Sampler(SamplingParams(temperature=0))(logits, []) == 1
    assert Sampler(SamplingParams(temperature=1.0, top_k=1))(logits, []) == 1
    assert Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.9))(logits, []) == 1
    draws = lambda seed: [Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed))(
        logits, []) for _ in range(1)] + list(_draw_many(seed, logits))
    assert draws(7) == draws(7)
    assert len(set(_draw_many(3, logits))) > 1


def _draw_many(seed, logits):
    s = Sampler(SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
    return [s(logits, []) for _ in range(50)]


def test_repetition_penalties_follow_llama_cpp():
    logits = np.array([2.0, -2.0, 1.0], np.float32)
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    out = s._penalize(logits, [0, 1, 1])
    np.testing.assert_allclose(out, [2.0 / 2 - 0.25 - 0.5, -2.0 * 2 - 0.5 - 0.5, 1.0])


def test_ring_slots_keep_sinks():
    g = CacheGroup(n_slots=8, n_keep=2)
    slots = g.slots_for(np.arange(20))
    assert slots[:8].tolist() == list(range(8))
    assert slots[8:14].tolist() == [2, 3, 4, 5, 6, 7]   # wraps past the 2 sink slots
    assert set(slots.tolist()) == set(range(8))


def test_local_ring_gives_the_same_logits_as_a_full_cache(tmp_path):
    # gemma3's local layers (window 8) keep a ring of window + batch slots: exact, not approximate
    sm = SyntheticModel("gemma3", "Q8_0", n_layer=7, window=8).build()
    model = minillm.load(sm.write(tmp_path / "g.gguf"))
    ids = np.random.default_rng(3).integers(0, sm.n_vocab, 40)
    full = model.logits(ids)
    cache = model.new_cache(64, batch_size=1)
    assert cache.groups["local"].n_slots == 9
    step = np.concatenate([model.eval(ids[i:i + 1], cache, batch_size=1) for i in range(40)])
    np.testing.assert_allclose(step, full, rtol=0, atol=1e-4 * np.abs(full).max())


def test_decoding_past_the_context_keeps_memory_flat(tmp_path):
    sm = SyntheticModel("llama", "Q4_0", n_layer=2).build()
    model = minillm.load(sm.write(tmp_path / "l.gguf"))
    cache = model.new_cache(16, n_keep=4, batch_size=1)
    before = [a.nbytes for a in cache.k]
    rng = np.random.default_rng(0)
    for tok in rng.integers(0, sm.n_vocab, 50):
        logits = model.eval([tok], cache, batch_size=1)
        assert np.isfinite(logits).all()
    assert [a.nbytes for a in cache.k] == before and cache.n_past == 50
    pos = np.sort(cache.groups["global"].kv_pos)
    assert pos.tolist() == [0, 1, 2, 3] + list(range(38, 50))   # sinks + the last 12 tokens


# ---- the real models ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_greedy_generation_against_llama_cpp(model):
    m = loaded_model(model)
    identical, first_gaps = 0, []
    rows = golden_rows(model)
    for row in rows:
        session = Session(m, n_ctx=4096)
        tokens = [c.token for c in session.generate(row["prompt_ids"], len(row["steps"]),
                                                    SamplingParams(temperature=0)) if c.token is not None]
        theirs = [s["next"] for s in row["steps"]]
        # an end-of-generation token ends our run where it ended theirs
        if tokens == theirs[:len(tokens)] and len(tokens) >= len(theirs) - 1:
            identical += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(tokens, theirs)) if a != b)
        top = dict((tok, val) for tok, val in row["steps"][i]["top"])
        assert tokens[i] in top, "our token is not even in llama.cpp's top 10"
        first_gaps.append(top[theirs[i]] - top[tokens[i]])
    REPORT.append(f"{model}: greedy generation identical to llama.cpp for {identical}/{len(rows)} prompts; "
                  f"llama.cpp's logit gap at the first difference: {[round(g, 3) for g in first_gaps]}")
    # both models reproduce llama.cpp's logits exactly; issue 4 asks for 90% identical
    # sequences, first differences at near-ties (within 0.1)
    assert identical == len(rows)
    assert all(g <= 0.1 for g in first_gaps)


@pytest.mark.slow
def test_same_seed_same_text():
    m = loaded_model("smollm2")
    a = m.generate("Once upon a time", max_tokens=24, temperature=0.9, seed=123)
    b = m.generate("Once upon a time", max_tokens=24, temperature=0.9, seed=123)
    c = m.generate("Once upon a time", max_tokens=24, temperature=0.9, seed=124)
    assert a.text == b.text and a.tokens == b.tokens and len(a.tokens) == 24
    assert a.finish_reason == "length"
    assert c.tokens != a.tokens


@pytest.mark.slow
def test_chat_turns_reuse_the_cache():
    m = loaded_model("smollm2")
    session = Session(m, n_ctx=512)
    conv = [{"role": "user", "content": "Name a colour."}]
    first = list(session.generate(m.prompt_ids(conv), 8, SamplingParams(temperature=0)))
    reply = "".join(c.text for c in first)
    conv += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Another one?"}]
    ids = m.prompt_ids(conv)
    second = list(session.generate(ids, 8, SamplingParams(temperature=0)))
    evaluated = second[-1].timings.n_prompt
    assert evaluated < len(ids) // 2, (evaluated, len(ids))


@pytest.mark.slow
def test_long_generation_past_the_context_keeps_memory_flat():
    m = loaded_model("smollm2")
    session = Session(m, n_ctx=128)
    rss = []
    for i, chunk in enumerate(session.generate(m.prompt_ids("Tell me a story."), 700,
                                               SamplingParams(temperature=1.0, seed=1), ignore_eos=True)):
        if i in (150, 699):
            rss.append(_rss_mib())
    assert session.cache.n_past > 600 and len(rss) == 2
    REPORT.append(f"smollm2: 700 tokens with ctx 128: RSS {rss[0]:.1f} MiB after the first window, "
                  f"{rss[1]:.1f} MiB at the end")
    assert rss[1] - rss[0] < 8


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


# ---- the CLI --------------------------------------------------------------------------------

def cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "minillm", *args], capture_output=True, text=True,
                          timeout=300, **kw)


@pytest.mark.slow
def test_generate_cli_prompt_sources_agree(tmp_path):
    model = str(model_path("smollm2"))
    prompt = "The three primary colours are"
    (tmp_path / "p.txt").write_text(prompt)
    flags = ["-n", "12", "--temp", "0.7", "--seed", "5"]
    a = cli("generate", model, "-p", prompt, *flags)
    b = cli("generate", model, "-f", str(tmp_path / "p.txt"), *flags)
    c = cli("generate", model, *flags, input=prompt)
    assert a.returncode == b.returncode == c.returncode == 0, a.stderr
    assert a.stdout == b.stdout == c.stdout and len(a.stdout.strip()) > 0
    assert a.stderr == ""  # stdout only carries the text, and nothing else is printed


@pytest.mark.slow
def test_generate_cli_json_and_stop():
    out = cli("generate", str(model_path("smollm2")), "-p", "1, 2, 3, 4,", "-n", "30", "--temp", "0",
              "--stop", " 7", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["finish_reason"] == "stop" and " 7" not in result["text"]
    assert result["text"].startswith(" 5, 6,")
    for key in ("generated_tokens", "prompt_tokens", "prompt_tokens_per_s", "generate_tokens_per_s", "seed"):
        assert key in result


@pytest.mark.slow
def test_generate_cli_errors():
    model = str(model_path("smollm2"))
    long_prompt = "word " * 400
    out = cli("generate", model, "-p", long_prompt, "--ctx", "64", "-n", "4")
    assert out.returncode == 1 and "more than the context of 64 allows" in out.stderr
    assert out.stderr.rstrip().endswith("raise --ctx or use --truncate")  # the engine's n_ctx and truncate
    assert "Traceback" not in out.stderr
    out = cli("generate", model, "-p", long_prompt, "--ctx", "64", "-n", "4", "--truncate", "--temp", "0")
    assert out.returncode == 0 and out.stdout.strip()
    out = cli("generate", model, "-p", "hi", "--temp", "hot")
    assert out.returncode == 2 and "Traceback" not in out.stderr


@pytest.mark.slow
def test_generate_cli_closed_pipe_is_quiet():
    cmd = f"{sys.executable} -m minillm generate {model_path('smollm2')} -p 'Count:' -n 200 --temp 0 | head -c 5"
    out = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True, text=True, timeout=300)
    assert "Traceback" not in out.stderr and "Error" not in out.stderr
    assert len(out.stdout) == 5


@pytest.mark.slow
def test_beam_search_finds_a_sequence_at_least_as_likely_as_greedy():
    from minillm.generate import beam_search
    from minillm.sequence import log_softmax

    m = loaded_model("smollm2")
    ids = m.prompt_ids("The capital of France is")
    greedy = m.generate("The capital of France is", max_tokens=8, temperature=0).tokens

    def logprob(tokens):
        logits = m.logits(ids + tokens, start=len(ids) - 1)
        return sum(float(log_softmax(logits[i])[t]) for i, t in enumerate(tokens))

    tokens, score = beam_search(m, ids, 8, 4)
    assert len(tokens) == 8
    assert abs(score - logprob(tokens)) < 0.05
    assert score >= logprob(greedy) - 0.05
    out = cli("generate", str(model_path("smollm2")), "-p", "The capital of France is", "-n", "8",
              "--beams", "4", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)["tokens"] == tokens


def test_top_k_indices_matches_a_full_sort():
    from minillm.kernels.cpu.ops import top_k_indices

    rng = np.random.default_rng(9)
    x = rng.standard_normal(5000).astype(np.float32)
    for k in (1, 7, 40):
        assert sorted(top_k_indices(x, k).tolist()) == sorted(np.argsort(-x)[:k].tolist())
    assert sorted(top_k_indices(x[:5], 40).tolist()) == [0, 1, 2, 3, 4]
