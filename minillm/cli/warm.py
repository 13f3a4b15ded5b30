"""`minillm warm MODEL`: compile the kernels a model needs ahead of its first run (for images,
CI and installs), so that the first `generate` or `chat` starts warm; `minillm warm --all`:
every architecture's (minillm/warm_all.py; `make install` runs it)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from .common import compile_notice, err
from .models import takes_model
from .options import CACHE_TYPE_K, CACHE_TYPE_V, MODEL, THREADS


def register(app: typer.Typer) -> None:
    """Add the `warm` command to `app`."""
    app.command("warm")(takes_model(required=False)(warm_command))


def warm_command(
    model: Optional[Path] = MODEL,
    threads: Optional[int] = THREADS,
    cache_type_k: str = CACHE_TYPE_K,
    cache_type_v: str = CACHE_TYPE_V,
    every: bool = typer.Option(False, "--all", help="Compile every architecture's kernels (no MODEL)."),
    common: bool = typer.Option(False, "--common", help="With --all: only the common architectures' kernels "
                                "(what `make install` runs; the others compile on a model's first use)."),
) -> None:
    """Compile the kernels a model needs ahead of its first run (for images and CI)."""
    from ..errors import MinillmError
    from ..model import Model

    if every == (model is not None):
        raise typer.BadParameter("give a MODEL or --all")
    if common and not every:
        raise typer.BadParameter("--common goes with --all")
    if every:
        from ..warm_all import CORE_TASKS, TASKS, warm_all

        if common:
            err("Compiling the common architectures' kernels for this machine (once)...")
            err(f"ready: the common architectures' kernels in {warm_all(err, CORE_TASKS):.0f} s")
            return
        err("Compiling every architecture's kernels for this machine (once)...")
        err(f"ready: every architecture's kernels in {warm_all(err, tuple(TASKS)):.0f} s")
        return
    start = time.perf_counter()
    m = Model(model, threads=threads, device="cpu", cache_types=(cache_type_k, cache_type_v), on_compile=compile_notice)
    m.warm_up(on_compile=compile_notice)
    try:
        m.tokenizer  # noqa: B018 (its kernels compile too)
    except MinillmError as exc:  # a file without a vocabulary still runs on token ids
        err(f"notice: no tokenizer: {exc}")
    err(f"ready: {m.path.name} ({m.arch.name}, KV cache {cache_type_k}/{cache_type_v}) in "
        f"{time.perf_counter() - start:.1f} s")
