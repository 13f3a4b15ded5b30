"""The thread governor (minillm/threads.py): the CPU's passes keep the thread count that is
fastest on the machine as it is, busy or idle, and the count never changes a result."""
import itertools

import numba
import numpy as np
import pytest

from conftest import loaded_model
from minillm import threads
from minillm.threads import OtherWork, ThreadGovernor, thread_choices


def drive(governor, passes: int, seconds_on, rows: int = 1) -> list[int]:
    """Run `passes` passes of `rows` rows, each taking seconds_on(threads, pass index); the
    counts chosen."""
    chosen = []
    for i in range(passes):
        n = governor.choose(rows)
        governor.record(rows, n, seconds_on(n, i))
        chosen.append(n)
    return chosen


def idle(n, i):
    return {2: 0.005, 1: 0.008}[n]


def one_core_busy(n, i):
    """All threads: mostly fast passes, and one in four waits 80 ms for a descheduled thread;
    one thread: steady."""
    return (0.080 if i % 4 == 0 else 0.005) if n == 2 else 0.009


def test_the_choices_start_with_every_core():
    assert thread_choices(1) == (1,)
    assert thread_choices(2) == (2, 1)
    assert thread_choices(16) == (16, 15, 8, 1)


def test_an_idle_machine_keeps_every_thread_and_probes_ever_more_rarely():
    governor = ThreadGovernor(2)
    chosen = drive(governor, 2000, idle)
    probes = [i for i, n in enumerate(chosen) if n == 1]
    assert governor.kept == 2 and governor.gap == threads.GAP_LAST
    assert 3 <= len(probes) <= 8, probes  # each lost after one pass
    assert all(later > earlier for earlier, later in zip(np.diff(probes), np.diff(probes)[1:]))  # the gaps grow


def test_a_busy_core_moves_decode_to_the_threads_that_run_and_back_when_it_is_free():
    governor = ThreadGovernor(2)
    drive(governor, 200, idle)
    kept = []
    busy = drive(governor, 400, lambda n, i: (kept.append(governor.kept), one_core_busy(n, i))[1])
    switched = kept.index(1)
    assert switched < 60 and set(kept[switched:]) == {1}  # probes of 2 threads see the long waits
    assert busy[-200:].count(2) < 20
    free = drive(governor, 1000, idle)  # the next probe of 2 threads comes within GAP_LAST seconds, and wins
    assert governor.kept == 2 and free[-300:].count(1) <= 2


def test_prompt_passes_never_probe_and_run_on_the_count_decode_settled_on():
    """... where the other programs' work is not known."""
    governor = ThreadGovernor(2, OtherWork(read=lambda: None))
    assert set(drive(governor, 300, idle, rows=512)) == {2}
    drive(governor, 400, one_core_busy)
    assert set(drive(governor, 50, lambda n, i: 0.2, rows=512)) == {1}


def test_a_prompt_pass_runs_on_the_cores_other_programs_left_free(monkeypatch):
    """The first long pass already: one core kept busy by another program since the last look
    (all CPUs' busy time grows by that core's and ours), one thread; both free, two; within
    LOOK_SECONDS of the last look, the count that look gave."""
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 2)
    clock = {"busy": 0.0, "own": 0.0, "wall": 0.0}
    governor = ThreadGovernor(2, OtherWork(read=lambda: (clock["busy"], clock["own"], clock["wall"])))

    def elapse(seconds, others_cores, own_cores):
        clock["wall"] += seconds
        clock["own"] += own_cores * seconds
        clock["busy"] += (others_cores + own_cores) * seconds

    elapse(0.5, 1.0, 0.3)
    assert governor.choose(512) == 1
    elapse(0.05, 0.0, 2.0)
    assert governor.choose(512) == 1  # too soon to look again
    elapse(0.5, 0.1, 1.0)
    assert governor.choose(512) == 2
    assert governor.choose(1) == governor.kept == 2  # decode keeps its own count


def test_other_work_reads_this_machine():
    """The look reads /proc/stat (Linux): this process spinning a core is its own work, not
    others' (at most the other test worker's core is counted)."""
    other_work = OtherWork()
    start = threads.time.monotonic()
    while threads.time.monotonic() - start < 0.3:
        pass
    others = other_work.busy_cores()
    assert others is not None and 0.0 <= others < 1.5


def test_one_thread_has_nothing_to_choose():
    governor = ThreadGovernor(1)
    assert set(drive(governor, 100, lambda n, i: 0.001)) == {1}


@pytest.mark.slow
def test_the_thread_count_never_changes_the_logits():
    """SmolLM2's decode on 1 and 2 threads, switching every pass: the logits are the fixed
    count's, bit for bit."""
    model = loaded_model("smollm2")
    ids = [1, 504, 3458, 314, 4649, 28, 29, 30]

    def decode(counts):
        cache, rows = model.new_cache(16), []
        saved, model.backend.governor = model.backend.governor, None
        try:
            for token, n in zip(ids, counts):
                numba.set_num_threads(n)
                rows.append(model.eval(np.array([token]), cache)[-1])
        finally:
            model.backend.governor = saved
            model.use_threads()
        return np.array(rows)

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("one thread here")
    fixed = decode(itertools.repeat(2))
    assert np.array_equal(decode(itertools.cycle([1, 2])), fixed)
    assert np.array_equal(decode(itertools.repeat(1)), fixed)


def test_the_cpu_backend_times_its_passes():
    model = loaded_model("smollm2")
    governor = model.backend.governor
    assert governor is not None and governor.choices == thread_choices(model.threads)
    timed = []
    record = governor.record
    governor.record = lambda rows, n, seconds: (timed.append((rows, n)), record(rows, n, seconds))
    try:
        cache = model.new_cache(8)
        model.eval(np.array([1, 2, 3]), cache)
        model.eval(np.array([4]), cache)
    finally:
        del governor.record
    assert [rows for rows, _ in timed] == [3, 1] and all(n in governor.choices for _, n in timed)
