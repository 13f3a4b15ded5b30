"""`minillm chat`: the terminal chat (or, with stdin not a terminal, one answer to the piped text)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from .cli_generate import (
    CHAT_TEMPLATE, CTX, DEVICE, FREQUENCY_PENALTY, MIN_P, MODEL, PRESENCE_PENALTY, REPEAT_LAST_N, REPEAT_PENALTY, SEED,
    SYSTEM, TEMP, THREADS, TOP_K, TOP_P, sampling_options,
)


def register(app: typer.Typer) -> None:
    @app.command()
    def chat(
        model: Path = MODEL,
        n_predict: int = typer.Option(512, "-n", "--n-predict", min=1, max=1 << 24, help="Tokens per reply at most."),
        temp: float = TEMP,
        top_k: int = TOP_K,
        top_p: float = TOP_P,
        min_p: float = MIN_P,
        repeat_penalty: float = REPEAT_PENALTY,
        repeat_last_n: int = REPEAT_LAST_N,
        presence_penalty: float = PRESENCE_PENALTY,
        frequency_penalty: float = FREQUENCY_PENALTY,
        seed: Optional[int] = SEED,
        ctx: Optional[int] = CTX,
        threads: Optional[int] = THREADS,
        device: str = DEVICE,
        system: Optional[str] = SYSTEM,
        chat_template: Optional[Path] = CHAT_TEMPLATE,
        verbose: bool = typer.Option(False, "-v", "--verbose", help="Show tokens/s after each reply."),
    ):
        """Chat with a model in the terminal."""
        from .chat import Chat, repl
        from .cli import load_model
        from .sampling import SamplingParams

        params = SamplingParams(**sampling_options(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
                                                   presence_penalty, frequency_penalty, seed))
        m = load_model(model, threads, device)
        session = Chat(m, params, n_predict=n_predict, n_ctx=ctx, system=system,
                       template_path=chat_template, verbose=verbose)
        if not sys.stdin.isatty():
            text = sys.stdin.read().strip()
            if text:
                session.reply(text)
            return
        repl(session)
