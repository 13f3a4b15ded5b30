"""What the commands share that is cheap to import (the CLI starts without numpy or Numba)."""
from __future__ import annotations

import gc
import re
import sys
from pathlib import Path
from typing import Optional

from ..errors import MinillmError

# the library's parameters, as the engine's messages name them -> the flags that set them
FLAGS = {
    "n_ctx": "--ctx", "truncate": "--truncate", "threads": "--threads",
    "cache_types[0]": "--cache-type-k", "cache_types[1]": "--cache-type-v",
    "draft_max": "--draft-max", "draft_min": "--draft-min", "p_min": "--draft-p-min",
    "lookup_ngram": "--lookup-ngram",
    "prune_layers": "--prune-layers", "tensor_types": "--tensor-type", "allow_requantize": "--allow-requantize",
    "kld_base": "--kl-divergence-base",
}


def err(message: str) -> None:
    """A line on stderr, where logs and notices go (stdout carries only the answer)."""
    print(message, file=sys.stderr, flush=True)


def error_message(exc: MinillmError) -> str:
    """exc's message in the CLI's words: the parameters it names (exc.params) become flags.
    Only whole words: a name inside a path, a file name or a quoted value stays as it is."""
    message = str(exc)
    for param in exc.params:
        if param in FLAGS:
            whole_word = rf"(?<![\w\-/.'\"]){re.escape(param)}(?![\w\-/'\"]|\.\w)"
            message = re.sub(whole_word, FLAGS[param], message)
    return message


def print_error(exc: MinillmError) -> None:
    """The one line a command prints for an engine error: `error: ...`."""
    err(f"error: {error_message(exc)}")


def compile_notice():
    """What the warm-up shows while the kernels compile (first run only): see compile_progress."""
    from .compile_progress import compile_progress

    return compile_progress(err)


def load_model(path: Path, threads: Optional[int], device: str, cache_types: Optional[tuple[str, str]] = None):
    """A command's start: the model loaded and warmed up, its tokenizer built. Python's cycle
    collector is off until then (main): starting creates ~10^5 long-lived objects (Numba's
    registries, the vocabulary) and each full collection over them cost 20-50 ms of a cold
    start. They are then frozen out of later collections, and collection resumes. cache_types:
    (K, V) as -ctk/-ctv name them; None: both F16."""
    from ..kv_cache import F16_CACHE
    from ..model import Model

    try:
        m = Model(path, threads=threads, device=device, cache_types=cache_types or F16_CACHE, on_compile=compile_notice)
        if m.device_notice:
            err(f"notice: {m.device_notice}")
        m.warm_up(on_compile=compile_notice)
        m.tokenizer  # noqa: B018 (built while the collector is off)
    finally:
        gc.freeze()
        gc.enable()
    return m


def print_table(rows: list[list[str]], header: Optional[list[str]] = None, right: tuple[int, ...] = ()) -> None:
    """rows on stdout in aligned columns (right: the columns aligned right). On a terminal, rich's
    table, which fits the screen; otherwise (a pipe, a file) plain text that never cuts a cell:
    one row a line, columns padded with spaces and two between them, so grep and cut see
    whole names."""
    if sys.stdout.isatty():
        from rich.console import Console
        from rich.table import Table

        table = Table(box=None, pad_edge=False, show_header=header is not None)
        for i, name in enumerate(header or [""] * len(rows[0])):
            table.add_column(name, justify="right" if i in right else "left",
                             style="bold" if header is None and i == 0 else None)
        for row in rows:
            table.add_row(*row)
        Console().print(table)
        return
    lines = ([header] if header else []) + rows
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    for line in lines:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))]
        print("  ".join(cells).rstrip())
