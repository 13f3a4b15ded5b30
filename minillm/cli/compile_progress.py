"""What a first run shows while Numba compiles the kernels (once per machine: a few minutes for
the CPU's, less for a GPU's).

On a terminal: a spinner line (kept short for 80 columns) with the number of functions compiled
so far and the one being compiled now, from Numba's "numba:compile" events (numba-cuda sends
none for its kernels: there the line shows no count). Elsewhere (a log, a pipe): a line when it
starts and one when it ends.
"""
from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from typing import Callable

from numba.core import event

NOTICE = "Compiling the kernels for this machine (first run only, up to a few minutes)"


class _CompileCounter(event.Listener):
    """A Numba event listener: counts finished compilations, remembers the innermost one."""

    def __init__(self, show: Callable[[str], None]):
        self._show = show
        self._stack: list[str] = []
        self.done = 0

    def on_start(self, compile_event) -> None:
        dispatcher = compile_event.data["dispatcher"]
        self._stack.append(getattr(dispatcher, "__qualname__", None) or dispatcher.py_func.__name__)
        self._update()

    def on_end(self, compile_event) -> None:
        self._stack.pop()
        self.done += 1
        self._update()

    def _update(self) -> None:
        now = f", now {self._stack[-1]}" if self._stack else ""
        self._show(f"Compiling kernels, first run only: {self.done} done{now}")


@contextmanager
def compile_progress(log: Callable[[str], None]):
    """Show compilation progress while the block runs; log a summary when it is done."""
    from rich.console import Console

    console = Console(stderr=True)
    start = time.perf_counter()
    if not console.is_terminal:
        log(f"{NOTICE}...")
    with console.status(f"{NOTICE}...") if console.is_terminal else nullcontext() as status:
        counter = _CompileCounter(status.update if status is not None else lambda text: None)
        with event.install_listener("numba:compile", counter):
            yield
    counted = f"{counter.done} functions, " if counter.done else ""
    log(f"kernels compiled and cached ({counted}{time.perf_counter() - start:.0f} s)")
