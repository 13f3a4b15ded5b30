"""How many threads the CPU's forward passes run on, chosen from what the machine gives.

Every parallel region of a layer ends when its slowest thread ends. When another program keeps
a core busy, the thread that shares it is descheduled for whole time slices, and each of the
hundreds of regions a token opens may wait for it: SmolLM2's decode fell from ~130 to ~30 tok/s
on 2 cores with one busy, where one thread alone decodes ~80. So the passes are timed, and now
and then some of them run on another thread count (a probe, 50 ms of passes: many time slices);
the count whose passes are faster on average is kept. A probe clearly slower than the kept
count ends after one pass; probes that lose come ever more rarely (0.1 s of passes apart,
doubling to 4 s); a sudden slowdown of the kept count's passes brings the next probe soon.

Probes run only in passes of a few rows (decode steps, alone or batched), which repeat. A
prompt's pass is one long pass, often the first (a probe inside it would cost an idle machine
more than it saves): it runs on the cores other programs left free since the last look
(`OtherWork`: all CPUs' busy time less this process's own), or, where that is not known, on
the count decode settled on. Results do not depend on the count: the kernels split their work
into shares fixed at import (kernels/cpu/ops.THREADS), whatever number of threads runs them.
"""
from __future__ import annotations

import os
import time
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
LOOK_SECONDS = 0.2               # OtherWork's shortest interval (/proc/stat counts in 10 ms ticks)


def thread_choices(threads: int) -> tuple[int, ...]:
    """The thread counts worth trying on `threads` cores, all of them first: one core busy
    (threads - 1), half of them, one."""
    return tuple(sorted({threads, max(1, threads - 1), max(1, threads // 2), 1}, reverse=True))


class ThreadGovernor:
    """The thread count for each forward pass (`choose`), from the times of earlier passes of
    about as many rows (`record`). Means over many time slices decide, not single passes: on
    a busy machine most passes on all the threads are fast and some wait whole slices."""

    def __init__(self, threads: int, other_work: "OtherWork | None" = None):
        self.choices = thread_choices(threads)
        self.other_work = other_work if other_work is not None else OtherWork()
        self.long_threads = None    # the count of the last long pass chosen by OtherWork
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
        if rows > PROBE_ROWS:
            threads = self._long_pass_threads()
        if numba.get_num_threads() != threads:  # (Numba's count is per calling thread)
            numba.set_num_threads(threads)
        return threads

    def _long_pass_threads(self) -> int:
        """A long pass's count: the cores other programs left free, rounded (at least one, at
        most every thread); the decode's kept count where that is not known."""
        others = self.other_work.busy_cores()
        if others is not None:
            free = (os.cpu_count() or 1) - others
            self.long_threads = max(1, min(self.choices[0], int(free + 0.5)))
        return self.long_threads if self.long_threads is not None else self.kept

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


class OtherWork:
    """How many cores programs other than this one kept busy since the last look: the busy
    time of all CPUs (/proc/stat: user, nice, system, irq, softirq, steal) less this process's
    own CPU time, over the wall time between. read() gives (busy seconds, own seconds, wall
    seconds), or None where it cannot be known (no /proc/stat)."""

    def __init__(self, read=None):
        self.read = read if read is not None else read_cpu_times
        self.last = self.read()

    def busy_cores(self) -> float | None:
        """Cores kept busy by others since the last look, or None: not known, or less than
        LOOK_SECONDS since then (the next look spans both)."""
        now = self.read()
        if now is None or self.last is None or now[2] - self.last[2] < LOOK_SECONDS:
            return None
        busy, own, wall = (a - b for a, b in zip(now, self.last))
        self.last = now
        return max(0.0, (busy - own) / wall)


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_cpu_times() -> tuple[float, float, float] | None:
    """(all CPUs' busy seconds, this process's CPU seconds, monotonic seconds), or None."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if len(fields) < 9 or fields[0] != b"cpu":
        return None
    user, nice, system, _, _, irq, softirq, steal = map(int, fields[1:9])
    busy = (user + nice + system + irq + softirq + steal) / _TICK
    return busy, time.process_time(), time.monotonic()
