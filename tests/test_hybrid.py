"""Models with recurrent layers (Qwen3.5's gated delta nets, LFM2's short convolutions, Granite
4.0-H's Mamba2, beside attention): the state each sequence carries, wherever a KV cache is used, and what is refused
while the state cannot do it. The logits themselves are checked against llama.cpp in
test_architectures.py ("qwen35", "lfm2", "granitehybrid", ...)."""
import json
import subprocess
import sys

import numpy as np
import pytest

import minillm
from arch_cases import CASES, build
from conftest import DATA
from llama_ref.record_hybrid import PPL_CHUNKS, PPL_CTX, QUANT_TYPE, hybrid_text, tensor_hashes
from minillm.kernels.cpu.target import GGML_AVX512
from minillm.generate import Session, beam_search
from minillm.sampling import SamplingParams
from minillm.serving.scheduler import Request
from minillm.speculative import make_speculation
from synthetic import SyntheticModel, load_error

GREEDY = SamplingParams(temperature=0)
HYBRIDS = ["qwen35", "lfm2", "granitehybrid"]  # the small model of each architecture with recurrent layers (arch_cases)


def hybrid_path(tmp_path_factory, name):
    return build(name).write(tmp_path_factory.mktemp(name) / f"{name}.gguf")


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid_case(request, tmp_path_factory):
    """(case name, its file, the model), each architecture's in turn."""
    path = hybrid_path(tmp_path_factory, request.param)
    return request.param, path, minillm.load(path)


@pytest.fixture(scope="module")
def model(hybrid_case):
    return hybrid_case[2]


@pytest.fixture(scope="module")
def model_path(hybrid_case):
    return hybrid_case[1]


def ids(n: int, seed: int = 0) -> list[int]:
    return [int(i) for i in np.random.default_rng(seed).integers(3, 300, n)]


def greedy(session: Session, prompt: list[int], n: int) -> list[int]:
    return [c.token for c in session.generate(prompt, n, GREEDY, ignore_eos=True) if c.token is not None]


def alone(model, prompt: list[int], n: int) -> list[int]:
    """What a fresh session generates for the prompt: every token evaluated from the start."""
    return greedy(Session(model, n_ctx=256), prompt, n)


def test_the_state_carries_over_between_turns(model):
    session = Session(model, n_ctx=256)
    first = ids(40)
    reply = greedy(session, first, 6)
    # the next turn: the conversation so far (the reply's last token was never evaluated), then more
    second = first + reply + ids(10, seed=1)
    turn = greedy(session, second, 6)
    assert session.n_evaluated == len(second) - len(first) - len(reply) + 1
    assert turn == alone(model, second, 6)


def test_a_prompt_that_departs_from_the_cache_is_evaluated_again(model):
    session = Session(model, n_ctx=256)
    greedy(session, ids(40), 4)
    other = ids(40)[:25] + ids(15, seed=2)  # shares 25 tokens: no snapshot there
    tokens = greedy(session, other, 6)
    assert session.n_evaluated == len(other)
    assert tokens == alone(model, other, 6)


def test_the_state_at_a_prompts_end_is_reused(model):
    session = Session(model, n_ctx=256)
    prompt = ids(40)
    greedy(session, prompt, 5)
    retry = prompt + ids(8, seed=3)  # the same prompt, then other tokens than the reply's
    tokens = greedy(session, retry, 6)
    assert session.n_evaluated == 8
    assert tokens == alone(model, retry, 6)


def test_a_cut_back_cache_evaluates_from_its_snapshot_or_the_start(model):
    cache = model.new_cache(64)
    model.eval(ids(20), cache)
    cache.recurrent.save(20)
    model.eval(ids(5, seed=4), cache)
    assert cache.truncate(20) == 20 and cache.n_past == 20
    assert cache.truncate(10) == 0 and cache.n_past == 0
    with pytest.raises(ValueError, match="rewound"):
        model.eval(ids(3), cache)
        cache.rewind(1)


def test_generation_stops_at_a_full_context(model):
    """Recurrent state cannot forget its oldest tokens: generation ends there ("length"), and
    evaluating past the context is a clear error."""
    chunks = list(Session(model, n_ctx=32).generate(ids(20), 30, GREEDY, ignore_eos=True))
    assert sum(c.token is not None for c in chunks) == 13
    assert chunks[-1].finish_reason == "length"
    cache = model.new_cache(32)
    model.eval(ids(30), cache)
    with pytest.raises(minillm.MinillmError, match="context of 32 tokens is full.*n_ctx"):
        model.eval(ids(3), cache)


@pytest.mark.parametrize("guesser", ["fixed", "draft"])
def test_speculative_decoding_takes_back_the_state_of_rejected_guesses(model, guesser, tmp_path, monkeypatch):
    """Guesses verified several a pass: a rejected guess's rows leave the state as the snapshot
    before the pass plus the rows kept, so the tokens are plain greedy decoding's. fixed: three
    passes each guessing two right tokens, then a wrong one; draft: another model of the architecture."""
    from minillm.speculative import Speculation, SpeculationParams
    from test_speculative import FixedGuesses

    prompt = ids(30)
    plain = alone(model, prompt, 16)
    monkeypatch.setattr(Speculation, "n_to_guess", lambda self, cls=0: self.params.draft_max)
    monkeypatch.setattr(Speculation, "expects_to_guess", lambda self: True)
    if guesser == "fixed":  # after history of len(prompt) + i: plain[i], plain[i + 1], then not plain[i + 2]
        table = {len(prompt) + i: [plain[i], plain[i + 1], plain[i + 2] % 299 + 1] for i in (1, 5, 9)}
        speculation = Speculation(FixedGuesses(table), SpeculationParams())
    else:
        draft_model = SyntheticModel(seed=1, vocab=True, **CASES[model.arch.name]).build()
        draft = minillm.load(draft_model.write(tmp_path / "draft.gguf"))
        speculation = make_speculation(model, 256, draft=draft, params=SpeculationParams(draft_max=4, p_min=0.0))
    session = Session(model, n_ctx=256)
    chunks = list(session.generate(prompt, 16, GREEDY, ignore_eos=True, speculation=speculation))
    assert [c.token for c in chunks if c.token is not None] == plain
    timings = chunks[-1].timings
    if guesser == "fixed":
        assert (timings.n_drafted, timings.n_accepted) == (9, 6)
    else:  # a draft of other weights: its guesses are mostly rejected
        assert timings.n_drafted > timings.n_accepted
    again = prompt + ids(5, seed=9)  # the prompt's snapshot outlived the passes' own
    assert greedy(session, again, 4) == alone(model, again, 4) and session.n_evaluated == 5


def test_scheduler_speculation_takes_back_the_state_of_rejected_guesses(model, monkeypatch):
    """Guesses in the batching scheduler, three sequences at once: a pass whose last guess is
    rejected leaves each slot's state as its kept tokens alone give it (the state before the
    pass, the kept rows evaluated again), so every request gets plain decoding's tokens."""
    from minillm.speculative import Speculation, SpeculationParams
    from test_speculative import FixedGuesses

    prompts = [ids(30, seed=20 + i) for i in range(3)]
    plain = [alone_in_scheduler(model, Request(p, 12, GREEDY, ignore_eos=True)).tokens for p in prompts]
    monkeypatch.setattr(Speculation, "n_to_guess", lambda self, cls=0: self.params.draft_max)
    monkeypatch.setattr(Speculation, "expects_to_guess", lambda self: True)
    # after i generated tokens: the next two right, then a wrong one
    tables = iter([{len(p) + i: [pl[i], pl[i + 1], pl[i + 2] % 299 + 1] for i in (1, 5)} for p, pl in zip(prompts, plain)])
    scheduler = model.scheduler(parallel=3, n_ctx=256, batch=64)
    monkeypatch.setattr(scheduler, "speculation_for",
                        lambda request: Speculation(FixedGuesses(next(tables)), SpeculationParams()))
    handles = [scheduler.submit(Request(p, 12, GREEDY, ignore_eos=True, lookup=True)) for p in prompts]
    results = [h.result() for h in handles]
    assert [r.tokens for r in results] == plain
    assert [(r.timings.n_drafted, r.timings.n_accepted) for r in results] == [(6, 4)] * 3


def test_what_the_state_cannot_do_yet_is_refused_by_name(model):
    from minillm.quality.imatrix import compute_imatrix

    with pytest.raises(minillm.MinillmError, match=f"does not run {model.arch.name} models yet"):
        compute_imatrix(model, "some text " * 200, "t.txt", n_ctx=64)


def test_beams_copy_the_state(model):
    """Each beam's cache is a copy of its parent's, recurrent state included: the winning beam's
    score is its tokens' log-probabilities as a fresh sequence gives them, token by token."""
    from minillm.sequence import log_softmax

    prompt = ids(20)
    tokens, score = beam_search(model, prompt, 5, 3, n_ctx=64, ignore_eos=True)
    cache = model.new_cache(64)
    logits = model.eval(prompt, cache, logits_from=len(prompt) - 1)[-1]
    total = 0.0
    for token in tokens:
        total += float(log_softmax(logits)[token])
        logits = model.eval([token], cache, batch_size=1)[-1]
    assert len(tokens) == 5 and total == score


def requests() -> list[Request]:
    """Prompts of several lengths (some longer than a step's prompt budget), greedy and seeded."""
    out = []
    for i in range(7):
        sampling = GREEDY if i % 2 else SamplingParams(temperature=0.9, top_k=20, seed=100 + i)
        out.append(Request(ids(5 + 23 * i, seed=10 + i), 6 + i, sampling, ignore_eos=True, id=i))
    return out


def alone_in_scheduler(model, request):
    return model.scheduler(parallel=1, n_ctx=256, batch=64).submit(request).result()


def test_scheduler_batches_hybrid_sequences_each_as_alone(model):
    """Each slot keeps its own recurrent state: a request among others (more than the slots,
    prompts in chunks across steps) gets the tokens it gets alone."""
    scheduler = model.scheduler(parallel=3, n_ctx=256, batch=64)
    handles = [scheduler.submit(r) for r in requests()]
    together = [h.result() for h in handles]
    assert max(h.first_step for h in handles) > 0  # more requests than slots: some joined later
    for request, result in zip(requests(), together):
        assert result.tokens == alone_in_scheduler(model, request).tokens, request.id


def test_a_preempted_hybrid_sequence_starts_again_and_finishes_as_alone(model):
    low = Request(ids(30), 20, GREEDY, priority=5, ignore_eos=True)
    high = Request(ids(12, seed=3), 5, GREEDY, priority=0, ignore_eos=True)
    scheduler = model.scheduler(parallel=1, n_ctx=256, batch=64)
    h_low = scheduler.submit(low)
    for _ in range(4):
        scheduler.step()
    assert len(h_low.generated) >= 2
    h_high = scheduler.submit(high)
    scheduler.step()
    assert h_low.n_preempted == 1
    scheduler.run([h_low, h_high])
    assert h_low.result().tokens == alone_in_scheduler(model, low).tokens
    assert h_high.result().tokens == alone_in_scheduler(model, high).tokens


def test_a_hybrid_slot_is_reused_by_a_job_that_continues_all_of_it(model):
    """The pool keeps a slot's state after its last token: a next turn that begins with all the
    slot's tokens evaluates only its new ones; one that departs inside them starts again. Each
    gives the tokens it gives alone."""
    scheduler = model.scheduler(parallel=1, n_ctx=256, batch=64)
    prompt = ids(30)
    first = scheduler.submit(Request(prompt, 5, GREEDY, ignore_eos=True)).result()
    follow = Request(prompt + first.tokens + ids(6, seed=5), 4, GREEDY, ignore_eos=True)
    handle = scheduler.submit(follow)
    assert handle.result().tokens == alone_in_scheduler(model, follow).tokens
    assert handle.n_cached == len(prompt) + len(first.tokens) - 1  # (its last token was never evaluated)
    departing = Request(prompt[:20] + ids(12, seed=6), 4, GREEDY, ignore_eos=True)
    handle = scheduler.submit(departing)
    assert handle.result().tokens == alone_in_scheduler(model, departing).tokens
    assert handle.n_cached == 0


def test_generate_and_batch_files_from_the_command_line(model_path, tmp_path):
    cli = [sys.executable, "-m", "minillm"]
    out = subprocess.run(cli + ["generate", str(model_path), "-p", "t1 t2 t3", "-n", "5", "--temp", "0",
                                "--ignore-eos"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip()
    batch = tmp_path / "b.jsonl"
    batch.write_text('{"prompt": "t1 t2", "max_tokens": 3}\n{"prompt": "t3", "max_tokens": 2}\n')
    out = subprocess.run(cli + ["generate", str(model_path), "--batch-file", str(batch)], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert [(r["id"], r["tokens"]) for r in map(json.loads, out.stdout.splitlines())] == [(1, 3), (2, 2)]


# the small models of each architecture the bad files are made from (keys: the file's, over these)
SMALL = dict(qwen35=dict(rope_dims=8, keys={"rope.dimension_sections": [2, 1, 1, 0]}), lfm2={},
             granitehybrid=dict(ssm=dict(N=16, G=1, Hs=4)))


def small(arch="qwen35", keys=None, **changes) -> SyntheticModel:
    base = SMALL[arch]
    return SyntheticModel(arch=arch, fmt="Q8_0", n_layer=4, n_embd=64, head_dim=16, n_ff=64, n_vocab=40,
                          **{k: v for k, v in base.items() if k != "keys"}, keys={**base.get("keys", {}), **(keys or {})},
                          **changes).build()


@pytest.mark.parametrize("arch,keys,drop,named", [
    ("qwen35", {"ssm.state_size": None}, None, "qwen35.ssm.state_size"),
    ("qwen35", {"ssm.inner_size": 100}, None, "qwen35.ssm.inner_size"),
    ("qwen35", {"ssm.group_count": 3}, None, "qwen35.ssm.time_step_rank"),
    ("qwen35", {"rope.dimension_sections": None}, None, "qwen35.rope.dimension_sections"),
    ("qwen35", {"rope.dimension_sections": [9, 9, 9, 0]}, None, "qwen35.rope.dimension_sections"),
    ("qwen35", {}, "blk.1.ssm_a", "blk.1.ssm_a"),
    ("qwen35", {}, "blk.0.ssm_conv1d.weight", "blk.0.ssm_conv1d.weight"),
    ("qwen35", {}, "blk.3.attn_q_norm.weight", "blk.3.attn_q_norm.weight"),
    ("lfm2", {"shortconv.l_cache": None}, None, "lfm2.shortconv.l_cache"),
    ("lfm2", {"attention.head_count_kv": [0, 0, 2]}, None, "lfm2.attention.head_count_kv"),
    ("lfm2", {"attention.head_count_kv": [0, 4, 2, 0]}, None, "lfm2.attention.head_count_kv"),
    ("lfm2", {}, "blk.1.shortconv.conv.weight", "blk.1.shortconv.conv.weight"),
    ("lfm2", {}, "token_embd_norm.weight", "token_embd_norm.weight"),
    ("lfm2", {}, "blk.2.attn_k_norm.weight", "blk.2.attn_k_norm.weight"),
    ("granitehybrid", {"ssm.inner_size": 384}, None, "granitehybrid.ssm.inner_size"),
    ("granitehybrid", {"ssm.time_step_rank": 3}, None, "granitehybrid.ssm.time_step_rank"),
    ("granitehybrid", {"ssm.state_size": None}, None, "granitehybrid.ssm.state_size"),
    ("granitehybrid", {"attention.head_count_kv": None}, None, "granitehybrid.attention.head_count_kv"),
    ("granitehybrid", {}, "blk.0.ssm_d", "blk.0.ssm_d"),
    ("granitehybrid", {}, "blk.1.ssm_conv1d.bias", "blk.1.ssm_conv1d.bias"),
    ("granitehybrid", {}, "blk.3.ssm_norm.weight", "blk.3.ssm_norm.weight"),
])
def test_a_bad_file_gets_one_error_naming_the_key_or_tensor(tmp_path, arch, keys, drop, named):
    assert named in load_error(small(arch, keys), tmp_path, drop)


def test_mtp_blocks_are_left_unread(tmp_path):
    """A file whose last block is a next-token-prediction block loads the others and runs them."""
    m = small(keys={"nextn_predict_layers": 1})
    m.extra_tensors = {}
    m.tensors["blk.4.nextn.eh_proj.weight"] = (np.zeros((64, 128), np.float32), "F32", (64, 128))
    m.n_layer = 5
    path = m.write(tmp_path / "mtp.gguf")
    model = minillm.load(path)
    assert model.hp.n_layer == 4
    assert np.isfinite(model.logits(np.arange(3, 11))).all()


REFERENCE = json.loads((DATA / "hybrid_reference.json").read_text())


def test_perplexity_equals_llama_perplexity(model):
    """llama-perplexity's protocol with batches of whole chunks (tests/llama_ref/record_hybrid.py),
    each ggml build's figure to its 4 decimals."""
    from minillm.quality.perplexity import perplexity

    result = perplexity(model, hybrid_text(), n_ctx=PPL_CTX, n_chunks=PPL_CHUNKS)
    ref = REFERENCE[model.arch.name]["ppl"]["avx512" if GGML_AVX512 else "avx2"]
    assert f"{result.ppl:.4f}" == f"{ref:.4f}"


def test_quantize_equals_llama_quantize(hybrid_case, tmp_path):
    """Every tensor of minillm's Q4_K_M file (the recurrent layers' tensors' types included) has
    the type and bytes of llama-quantize's."""
    name, path, _ = hybrid_case
    out = tmp_path / "q.gguf"
    minillm.quantize(path, out, QUANT_TYPE, allow_requantize=True)
    assert tensor_hashes(out) == REFERENCE[name]["quantized"]


def test_the_server_serves_a_hybrid_model_to_several_clients(model_path):
    """Two clients at once over HTTP (two slots, each its own state) get what each gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    from test_server import LiveServer

    server = LiveServer("--parallel", "2", "--ctx", "256", model=model_path)
    try:
        bodies = [{"prompt": " ".join(f"t{i}" for i in range(k, k + 9)), "max_tokens": 6, "temperature": 0}
                  for k in (3, 11)]

        def complete(body):
            status, _, payload = server.request("POST", "/v1/completions", body)
            assert status == 200, payload
            return payload["choices"][0]["text"]

        alone = [complete(b) for b in bodies]
        with ThreadPoolExecutor(2) as pool:
            together = list(pool.map(complete, bodies))
        assert together == alone and all(alone)
    finally:
        assert server.stop() == 0
