"""`minillm chat`: the terminal chat (or, with stdin not a terminal, one answer to the piped text)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from .cli_generate import sampling_options


def register(app: typer.Typer) -> None:
    @app.command()
    def chat(
        model: Path = typer.Argument(..., help="Path to a .gguf model file.", show_default=False),
        n_predict: int = typer.Option(512, "-n", "--n-predict", min=1, max=1 << 24, help="Tokens per reply at most."),
        temp: float = typer.Option(0.8, "--temp", min=0.0, max=100.0, help="Temperature; 0 is greedy."),
        top_k: int = typer.Option(40, "--top-k", min=0, help="Top-k (0: off)."),
        top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0, help="Top-p (1: off)."),
        min_p: float = typer.Option(0.05, "--min-p", min=0.0, max=1.0, help="Min-p (0: off)."),
        repeat_penalty: float = typer.Option(1.0, "--repeat-penalty", min=0.0, help="Repetition penalty."),
        repeat_last_n: int = typer.Option(64, "--repeat-last-n", min=-1, help="Tokens the penalties look back."),
        presence_penalty: float = typer.Option(0.0, "--presence-penalty", help="Presence penalty."),
        frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help="Frequency penalty."),
        seed: Optional[int] = typer.Option(None, "--seed", min=0, max=2**63 - 1, help="Random seed."),
        ctx: Optional[int] = typer.Option(None, "-c", "--ctx", min=16, max=1 << 20, help="Context size."),
        threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, max=1024, help="Threads."),
        system: Optional[str] = typer.Option(None, "--system", help="System message."),
        chat_template: Optional[Path] = typer.Option(None, "--chat-template", help="Jinja chat template file."),
        verbose: bool = typer.Option(False, "-v", "--verbose", help="Show tokens/s after each reply."),
    ):
        """Chat with a model in the terminal."""
        from .chat import Chat, repl
        from .model import Model
        from .sampling import SamplingParams

        params = SamplingParams(**sampling_options(temp, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
                                                   presence_penalty, frequency_penalty, seed))
        m = Model(model, threads=threads)
        m.warm_up(log=lambda text: print(text, file=sys.stderr))
        session = Chat(m, params, n_predict=n_predict, n_ctx=ctx, system=system,
                       template_path=chat_template, verbose=verbose)
        if not sys.stdin.isatty():
            text = sys.stdin.read().strip()
            if text:
                session.reply(text)
            return
        repl(session)
