"""`minillm tokenize MODEL`: show how a model's tokenizer splits text.

Reads only the GGUF metadata (no weights). Text comes from -p/--prompt or stdin. For people it
prints one line per token: the id and the piece the token stands for; with --ids it prints only
a JSON list of ids (for scripts).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .common import print_error
from .models import takes_model
from ..errors import MinillmError


def register(app: typer.Typer) -> None:
    """Add the `tokenize` command to `app`."""
    app.command("tokenize")(takes_model()(tokenize_command))


def tokenize_command(
    model: Optional[Path] = typer.Argument(None, help="A .gguf model file, or REPO[:QUANT] on the Hugging Face "
                                           "Hub.", show_default=False),
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt",
                                         help="Text to tokenize (default: read stdin)."),
    ids_only: bool = typer.Option(False, "--ids", help="Print only a JSON list of token ids."),
    special: bool = typer.Option(False, "--special",
                                 help="Parse special-token text such as <|im_start|> as tokens."),
    no_bos: bool = typer.Option(False, "--no-bos", help="Do not add the model's BOS token."),
) -> None:
    """Split text into the model's tokens (llama.cpp-compatible ids)."""
    from ..gguf_file import GGUFFile
    from ..tokenizer import Tokenizer

    text = prompt if prompt is not None else sys.stdin.read()
    try:
        with GGUFFile(model) as gguf:
            tokenizer = Tokenizer.from_gguf(gguf)
        ids = tokenizer.tokenize(text, add_bos=False if no_bos else None, special=special)
    except MinillmError as exc:
        print_error(exc)
        raise typer.Exit(1) from None
    if ids_only:
        print(json.dumps(ids))
        return
    width = len(str(tokenizer.n_vocab - 1))
    for token_id in ids:
        print(f"{token_id:>{width}}  {describe_piece(tokenizer, token_id)}")


def describe_piece(tokenizer, token_id: int) -> str:
    """A readable, quoted form of what a token stands for: its text with escapes, a byte
    token as b'\\xNN' when it is not a character on its own, control tokens by name."""
    piece = tokenizer.token_piece(token_id, render_special=True)
    try:
        return repr(piece.decode("utf-8"))
    except UnicodeDecodeError:
        return repr(piece)
