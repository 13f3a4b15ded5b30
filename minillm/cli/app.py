"""The `minillm` command line: the typer app, assembled from one module per command. Heavy
imports (numba, kernels) happen inside commands, so `minillm --help` starts fast and never
compiles anything."""
from __future__ import annotations

import gc
import os
import sys

import typer

from .common import err, load_model, print_error  # noqa: F401 (load_model re-exported: minillm.cli.app.load_model)
from ..errors import MinillmError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Run quantized GGUF language models locally.",
)


def _register_commands() -> None:
    """Every command, in the order `minillm --help` lists them."""
    from . import chat, generate, imatrix, info, measure, models, quantize, serve, tokenize, warm

    for register in (info.register, measure.register_bench, generate.register, chat.register, serve.register,
                     quantize.register, imatrix.register, tokenize.register, models.register,
                     measure.register_perplexity, warm.register):
        register(app)


_register_commands()


def main() -> None:
    gc.disable()  # until the command has started: load_model, or at once in bench and quantize
    code = _run_app()
    # Skip the interpreter's teardown: unloading Numba's compiled code takes ~0.2 s and there is
    # nothing left to finish (every file the commands write is closed by now).
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _run_app() -> int:
    """The exit status of one command."""
    try:
        app()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        err(str(exc.code))
        return 1
    except MinillmError as exc:
        print_error(exc)
        return 1
    except KeyboardInterrupt:
        err("interrupted")
        return 130
    except BrokenPipeError:
        sys.stderr.close()
        return 0
    return 0
