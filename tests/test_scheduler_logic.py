"""The batching scheduler's logic over a scripted model (tests/fake_model.py): admission order,
priorities and preemption, cancel, the prompt budget, memory pressure, finish reasons and
prefix reuse, with no kernels. tests/test_scheduler.py runs the real models (batch invariance,
parity with llama.cpp)."""
import pytest

from fake_model import EOS, FakeModel, continuation
from minillm.errors import MinillmError
from minillm.sampling import SamplingParams
from minillm.serving.scheduler import SETTLED_TOKENS, STREAM_SHARE, Request, Scheduler

GREEDY = SamplingParams(temperature=0)


def request(prompt, max_tokens=6, **kwargs) -> Request:
    return Request(list(prompt), max_tokens, GREEDY, **kwargs)


def test_admission_by_priority_then_arrival_or_first_come_first_served():
    priorities = [3, 3, 1, 0, 1]
    scheduler = Scheduler(FakeModel(), parallel=2)
    handles = [scheduler.submit(request([10 + k], priority=p, id=k)) for k, p in enumerate(priorities)]
    scheduler.run(handles)
    starts = sorted(handles, key=lambda h: (h.first_step, h.request.priority))
    assert [h.request.id for h in starts] == [3, 2, 4, 0, 1]
    fcfs = Scheduler(FakeModel(), parallel=2, policy="fcfs")
    handles = [fcfs.submit(request([10 + k], priority=p, id=k)) for k, p in enumerate(priorities)]
    fcfs.run(handles)
    assert [h.request.id for h in sorted(handles, key=lambda h: (h.first_step, h.arrival))] == [0, 1, 2, 3, 4]


def test_a_better_request_preempts_and_the_preempted_one_resumes_where_it_was():
    scheduler = Scheduler(FakeModel(), parallel=1)
    low = scheduler.submit(request([5, 6, 7], 20, priority=5))
    for _ in range(4):
        scheduler.step()
    assert len(low.generated) == 4
    highs = [scheduler.submit(request([30 + k], 3, priority=0)) for k in range(3)]
    scheduler.step()
    assert low.n_preempted == 1 and not low.running
    finished = []
    scheduler.run([low, *highs], on_finish=finished.append)
    assert finished == [*highs, low]
    assert low.result().tokens == continuation([5, 6, 7], 20)
    assert [h.result().tokens for h in highs] == [continuation([30 + k], 3) for k in range(3)]


def test_cancel_ends_running_and_queued_requests_and_frees_their_slots():
    scheduler = Scheduler(FakeModel(), parallel=1)
    running = scheduler.submit(request([1, 2], 50))
    queued = scheduler.submit(request([3, 4], 50))
    chunks = iter(running)
    for _ in range(3):
        next(chunks)
    running.cancel()
    queued.cancel()
    assert list(chunks)[-1].finish_reason == "cancelled"
    assert queued.result().finish_reason == "cancelled" and queued.generated == []
    assert scheduler.stats()["running"] == scheduler.stats()["queued"] == 0
    assert scheduler.submit(request([9], 2)).result().tokens == continuation([9], 2)


def test_finish_reasons_end_token_max_tokens_context_and_zero():
    model = FakeModel()
    model.backend.eos_after = {12}
    scheduler = Scheduler(model, parallel=2, n_ctx=32)
    assert scheduler.submit(request([9], 10)).result().tokens == [10, 11, 12]  # then the end token
    assert scheduler.submit(request([9], 10)).result().finish_reason == "stop"
    assert scheduler.submit(request([20], 4)).result().finish_reason == "length"
    full = scheduler.submit(request(range(20, 50), 10)).result()  # 30 prompt tokens in a context of 32
    assert (full.finish_reason, len(full.tokens)) == ("length", 2)
    empty = scheduler.submit(request([20], 0)).result()
    assert (empty.finish_reason, empty.tokens, empty.text) == ("length", [], "")
    with pytest.raises(MinillmError, match="the prompt is 40 tokens, 9 more than the context of 32"):
        scheduler.submit(request(range(40), 4))


def test_a_stop_string_ends_the_text_where_it_starts():
    scheduler = Scheduler(FakeModel(), parallel=1)
    result = scheduler.submit(request([9], 10, stop=["t12"])).result()
    assert (result.text, result.tokens, result.finish_reason) == (" t10 t11 ", [10, 11, 12], "stop")


def test_prompts_read_whole_beside_young_streams_and_paced_beside_settled_ones():
    model = FakeModel()
    scheduler = Scheduler(model, parallel=2)
    stream = scheduler.submit(request([1, 2, 3], 64))
    scheduler.step()
    prompt = list(range(100, 100 + 40))
    prompt = [t % 60 + 1 for t in prompt]
    scheduler.submit(request(prompt, 4))
    scheduler.step()
    assert model.backend.steps[-1] == 1 + len(prompt)  # a young stream: the new prompt whole
    while stream.timings.n_generated < SETTLED_TOKENS:
        scheduler.step()
    scheduler.submit(request(prompt[::-1], 4))
    for _ in range(3):
        scheduler.step()
    assert model.backend.steps[-3:] == [1 + STREAM_SHARE] * 3  # beside a settled stream: paced
    stream.cancel()
    scheduler.step()


def test_memory_pressure_preempts_instead_of_failing():
    # 4 slots of 256 positions, cells for 320: the requests cannot all hold their cells at once
    scheduler = Scheduler(FakeModel(), parallel=4, n_ctx=256, kv_cells=320)
    prompts = [[7] * 150] + [[k + 1, k + 2, k + 3] for k in range(4)]
    handles = [scheduler.submit(request(p, 60)) for p in prompts]
    scheduler.run(handles)
    assert sum(h.n_preempted for h in handles) > 0
    assert [h.result().tokens for h in handles] == [continuation(p, 60) for p in prompts]
    assert scheduler.pool.free_cells == scheduler.pool.n_cells - sum(
        scheduler.pool.blocks_held(s.index) for s in scheduler.slots) * 16


def test_a_finished_prompt_is_reused_and_only_new_tokens_are_evaluated():
    model = FakeModel()
    scheduler = Scheduler(model, parallel=2)
    first = scheduler.submit(request([1, 2, 3, 4, 5], 4)).result()
    follow = [1, 2, 3, 4, 5] + first.tokens + [40, 41]
    evaluated = scheduler.stats()["evaluated"]
    handle = scheduler.submit(request(follow, 3))
    assert handle.result().tokens == continuation(follow, 3)
    assert handle.n_cached == 5 + 3  # the first prompt and the generated tokens it evaluated
    assert scheduler.stats()["evaluated"] - evaluated == len(follow) - handle.n_cached + 2


def test_a_failed_forward_fails_its_requests_and_the_scheduler_goes_on():
    model = FakeModel()
    scheduler = Scheduler(model, parallel=2)
    handles = [scheduler.submit(request([k + 1], 5)) for k in range(2)]
    model.backend.fail_next = RuntimeError("kernel failure")
    for handle in handles:
        with pytest.raises(RuntimeError, match="kernel failure"):
            handle.result()
    assert scheduler.stats()["running"] == 0
    assert scheduler.submit(request([7], 2)).result().tokens == continuation([7], 2)


def test_a_backend_without_batched_rows_is_refused_at_once():
    model = FakeModel()
    model.backend.check_supports = lambda feature: (_ for _ in ()).throw(MinillmError("no rows here"))
    with pytest.raises(MinillmError, match="no rows here"):
        Scheduler(model)


def test_an_end_token_prompt_is_not_special():
    """The end token inside a prompt is just a token; only a generated one ends the request."""
    scheduler = Scheduler(FakeModel(), parallel=1)
    assert scheduler.submit(request([EOS, 3], 2)).result().tokens == [4, 5]
