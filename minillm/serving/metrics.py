"""The server's counters and latency histograms, and their Prometheus text form (GET /metrics)."""
from __future__ import annotations

import bisect
import threading

# upper bounds in seconds (Prometheus's `le`), +Inf implied
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
GAP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


class Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def merge(self, other: dict) -> None:
        """Add another histogram's state (`state()`) of the same bounds."""
        self.counts = [a + b for a, b in zip(self.counts, other["counts"])]
        self.sum += other["sum"]
        self.count += other["count"]

    def state(self) -> dict:
        return {"counts": list(self.counts), "sum": self.sum, "count": self.count}

    def lines(self, name: str) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.bounds, self.counts):
            running += n
            out.append(f'{name}_bucket{{le="{bound}"}} {running}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum:.6f}")
        out.append(f"{name}_count {self.count}")
        return out


COUNTERS = {
    "requests_finished": "Requests that ended with a finish reason (stop or length).",
    "requests_cancelled": "Requests that ended early: the client left, or the server was stopping.",
    "requests_rejected": "Requests refused with an error status (bad input, full queue, auth).",
    "prompt_tokens": "Prompt tokens of the requests submitted.",
    "generated_tokens": "Tokens generated.",
}


class Metrics:
    """Counted from the event loop and read by /metrics; a lock keeps the two consistent."""

    def __init__(self):
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.gap = Histogram(GAP_BUCKETS)
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft.observe(seconds)

    def observe_gap(self, seconds: float) -> None:
        with self._lock:
            self.gap.observe(seconds)

    def state(self) -> dict:
        """The counters and histograms as plain data (what a replica reports, `merge` adds up)."""
        with self._lock:
            return {"counts": dict(self.counts), "ttft": self.ttft.state(), "gap": self.gap.state()}

    def merge(self, state: dict) -> None:
        with self._lock:
            for name, n in state["counts"].items():
                self.counts[name] += n
            self.ttft.merge(state["ttft"])
            self.gap.merge(state["gap"])

    def render(self, running: int, queued: int, extra: tuple[tuple[str, str, int], ...] = ()) -> str:
        """Prometheus's text exposition format; extra: more gauges, (name, help, value)."""
        lines = []

        def metric(name: str, kind: str, help_text: str, values: list[str]) -> None:
            lines.extend([f"# HELP minillm_{name} {help_text}", f"# TYPE minillm_{name} {kind}"])
            lines.extend(f"minillm_{v}" for v in values)

        with self._lock:
            metric("requests_running", "gauge", "Requests decoding now.", [f"requests_running {running}"])
            metric("requests_queued", "gauge", "Requests waiting for a slot.", [f"requests_queued {queued}"])
            for name, help_text, value in extra:
                metric(name, "gauge", help_text, [f"{name} {value}"])
            for name, help_text in COUNTERS.items():
                metric(f"{name}_total", "counter", help_text, [f"{name}_total {self.counts[name]}"])
            metric("time_to_first_token_seconds", "histogram", "From a request's arrival to its first token.",
                   self.ttft.lines("time_to_first_token_seconds"))
            metric("inter_token_seconds", "histogram", "Gaps between a stream's tokens.",
                   self.gap.lines("inter_token_seconds"))
        return "\n".join(lines) + "\n"
