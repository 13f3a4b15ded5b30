"""How many threads the CPU's forward passes run on, chosen from what the machine gives.

Every parallel region of a layer ends when its slowest thread ends. When another program keeps
a core busy, the thread that shares it is descheduled for whole time slices, and each of the
hundreds of regions a token opens may wait for it: SmolLM2's decode fell from ~130 to ~30 tok/s
on 2 cores with one busy, where one thread alone decodes ~80. So the passes are timed, and now
and then some of them run on another thread count (a probe, 50 ms of passes: many time slices);
the count whose passes are faster on average is kept. A probe clearly slower than the kept
count ends after one pass; probes that lose come ever more rarely (0.1 s of passes apart,
doubling to 4 s); a sudden slowdown of the kept count's passes brings the next probe soon.

Probes run only in passes of a few rows (decode steps, alone or batched), which repeat; a
prompt's pass runs on the count they settled on (a probe inside a single long pass would cost
an idle machine more than it saves). Results do not depend on the count: the kernels split
their work into shares fixed at import (kernels/cpu/ops.THREADS), whatever number of threads
runs them.
"""
from __future__ import annotations

from collections import deque

import numba

PROBE_ROWS = 16                  # probes run in passes of at most this many rows
GAP_FIRST, GAP_LAST = 0.1, 4.0   # seconds of kept passes between probes: the first gap, the longest
PROBE_SECONDS = 0.05             # a winning probe's passes, at least
BASELINE_PASSES = 8              # the last kept passes of a size a probe compares with (all of them)
LOSES_ABOVE = 1.1                # a probe this much slower than the kept count ends at once
WINS_BELOW = 0.9                 # a probe wins below this fraction of the kept count's average
SMOOTHING = 0.1                  # weight of a new pass's time in the kept count's running average
SLOWDOWN = 1.5                   # that average past this multiple of its best: probe soon


def thread_choices(threads: int) -> tuple[int, ...]:
    """The thread counts worth trying on `threads` cores, all of them first: one core busy
    (threads - 1), half of them, one."""
    return tuple(sorted({threads, max(1, threads - 1), max(1, threads // 2), 1}, reverse=True))


class ThreadGovernor:
    """The thread count for each forward pass (`choose`), from the times of earlier passes of
    about as many rows (`record`). Means over many time slices decide, not single passes: on
    a busy machine most passes on all the threads are fast and some wait whole slices."""

    def __init__(self, threads: int):
        self.choices = thread_choices(threads)
        self.kept = self.choices[0]
        self.gap = GAP_FIRST        # seconds of kept passes between probes now
        self.since_probe = 0.0      # seconds of kept passes since the last probe
        self.probes = 0             # probes so far (the other counts are tried in turn)
        self.probe = None           # the running probe: [threads, rows bucket, passes, seconds]
        self.recent: dict[int, deque] = {}   # rows bucket -> seconds of its last kept passes since the last probe
        self.average: dict[int, float] = {}  # rows bucket -> the kept count's running average a pass
        self.best: dict[int, float] = {}     # rows bucket -> the lowest of that average
        self.seen: set[int] = set()          # rows buckets of a pass so far

    def choose(self, rows: int) -> int:
        """The thread count for a pass over `rows` rows, set as Numba's."""
        bucket = _bucket(rows)
        if self.probe is not None and self.probe[1] != bucket:  # passes of another size now: start again
            self.probe = None
        if (self.probe is None and rows <= PROBE_ROWS and self.since_probe >= self.gap and len(self.choices) > 1
                and len(self.recent.get(bucket, ())) == BASELINE_PASSES):
            others = [c for c in self.choices if c != self.kept]
            self.probe = [others[self.probes % len(others)], bucket, 0, 0.0]
        threads = self.kept if self.probe is None else self.probe[0]
        if numba.get_num_threads() != threads:  # (Numba's count is per calling thread)
            numba.set_num_threads(threads)
        return threads

    def record(self, rows: int, threads: int, seconds: float) -> None:
        """A pass over `rows` rows took `seconds` on `threads` threads."""
        bucket = _bucket(rows)
        probe = self.probe
        if probe is not None and (probe[0], probe[1]) == (threads, bucket):
            probe[2] += 1
            probe[3] += seconds
            self._judge(probe)
        elif threads == self.kept:  # (else the kept count changed since this pass began)
            self._kept_pass(bucket, seconds)

    def _kept_pass(self, bucket: int, seconds: float) -> None:
        if bucket not in self.seen:  # a size's first pass pays one-time costs (compiling, new pages)
            self.seen.add(bucket)
            return
        self.recent.setdefault(bucket, deque(maxlen=BASELINE_PASSES)).append(seconds)
        self.since_probe += seconds
        average = self.average.get(bucket, seconds)
        average += SMOOTHING * (seconds - average)
        self.average[bucket] = average
        best = self.best.setdefault(bucket, average)
        if average > SLOWDOWN * best:  # the machine got busier: look for a better count soon
            self.gap = min(self.gap, GAP_FIRST)
            self.best[bucket] = average
        elif average < best:
            self.best[bucket] = average

    def _judge(self, probe: list) -> None:
        """End the probe once it has run long enough, or at once when it is clearly slower."""
        threads, bucket, passes, seconds = probe
        recent = self.recent[bucket]
        ratio = (seconds / passes) / (sum(recent) / len(recent))
        if ratio > LOSES_ABOVE:
            won = False
        elif seconds >= PROBE_SECONDS and passes >= 2:
            won = ratio < WINS_BELOW
        else:
            return
        self.probe, self.since_probe, self.recent = None, 0.0, {}
        self.probes += 1
        if won:
            self.kept, self.gap, self.average, self.best = threads, GAP_FIRST, {}, {}
        else:
            self.gap = min(2 * self.gap, GAP_LAST)


def _bucket(rows: int) -> int:
    """Passes are compared with passes of about as many rows: the power of two at or below."""
    return 1 << (rows.bit_length() - 1)
