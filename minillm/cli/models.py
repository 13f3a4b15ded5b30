"""Models by name: `-hf REPO[:QUANT]` (and a bare REPO[:QUANT]) on every command that takes a
model, and the store's commands `pull`, `ls` and `rm` (minillm/hub.py does the work)."""
from __future__ import annotations

import functools
import inspect
import json
import sys
import time
from typing import Optional

import typer

from .common import err, print_table

HF_REPO = typer.Option(None, "-hf", "--hf-repo", metavar="REPO[:QUANT]", show_default=False,
                       help="A model on the Hugging Face Hub, downloaded once into its cache. QUANT picks the "
                            "file (Q4_K_M, q8_0, ...); without it Q4_K_M, then Q8_0, then the first.")
HF_FILE = typer.Option(None, "-hff", "--hf-file", metavar="FILE", show_default=False,
                       help="With -hf: the repository's file to use, named outright.")


def takes_model(param: str = "model", required: bool = True, shifts: tuple[str, ...] = ()):
    """A command decorator: adds -hf/-hff, and turns the command's MODEL argument (`param`) into a
    local path before the command runs: a file as it is, REPO[:QUANT] fetched from the hub.
    required=False: the command runs without a model (e.g. with --server). shifts: the
    positional arguments after MODEL (strings), which move up one place when -hf stands for MODEL."""
    def decorate(command):
        signature = inspect.signature(command)

        @functools.wraps(command)
        def run(*args, hf_repo: Optional[str] = None, hf_file: Optional[str] = None, **kwargs):
            from ..hub import resolve_model

            if hf_repo is not None and shifts:  # -hf took MODEL's place: the positionals given are the next ones
                names = (param, *shifts)
                values = [kwargs[name] for name in names]
                if values[-1] is not None:
                    raise typer.BadParameter(f"with -hf, give {len(names) - 1} arguments, not {len(names)}")
                kwargs.update(zip(names, [None, *(None if v is None else str(v) for v in values[:-1])]))
            if kwargs[param] is not None or hf_repo is not None or hf_file is not None or required:
                quiet = bool(kwargs.get("as_json")) or not sys.stderr.isatty()
                kwargs[param] = resolve_model(kwargs[param], hf_repo, hf_file, quiet, log=err)
            return command(*args, **kwargs)

        extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=Optional[str])
                 for name, option in (("hf_repo", HF_REPO), ("hf_file", HF_FILE))]
        run.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *extra])
        run.__annotations__ = {**command.__annotations__, "hf_repo": Optional[str], "hf_file": Optional[str]}
        return run
    return decorate


def pull_command(
    model: str = typer.Argument(..., metavar="REPO[:QUANT]", show_default=False,
                                help="A model on the Hugging Face Hub, e.g. bartowski/SmolLM2-135M-Instruct-GGUF:Q8_0."),
    hf_file: Optional[str] = HF_FILE,
    as_json: bool = typer.Option(False, "--json", help="Print the path and facts as one JSON object."),
) -> None:
    """Download a model from the Hugging Face Hub without running it; prints its local path."""
    from ..hub import fetch, local_models, parse_ref

    path = fetch(parse_ref(model, hf_file), quiet=as_json or not sys.stderr.isatty(), log=err)
    if as_json:
        found = next((m for m in local_models() if m.path == path), None)
        print(json.dumps({"path": str(path), **({"repo": found.repo, "file": found.file, "size": found.size}
                                                if found else {})}))
    else:
        print(path)


def ls_command(as_json: bool = typer.Option(False, "--json", help="Print one JSON list.")) -> None:
    """List the models in the local store (the Hugging Face cache), most recently used first."""
    from ..hub import local_models

    models = local_models()
    if as_json:
        print(json.dumps([{"ref": m.ref(), "repo": m.repo, "file": m.file, "size": m.size,
                           "architecture": m.architecture, "quantization": m.quantization,
                           "last_used": m.last_used, "path": str(m.path)} for m in models], indent=2))
        return
    if not models:
        err("no models yet: `minillm pull REPO[:QUANT]` downloads one")
        return
    print_table([[m.ref(), m.file, _size(m.size), m.architecture, m.quantization, _ago(m.last_used)] for m in models],
                ["model", "file", "size", "architecture", "quantization", "last used"], right=(2,))


def rm_command(
    model: str = typer.Argument(..., metavar="REPO[:QUANT]", show_default=False,
                                help="What to delete: one quantization's files, or with no QUANT the whole "
                                     "repository's."),
    hf_file: Optional[str] = HF_FILE,
) -> None:
    """Delete a model from the local store."""
    from ..hub import parse_ref, remove

    for name, size in remove(parse_ref(model, hf_file)):
        err(f"deleted {name} ({_size(size)})")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _ago(when: float) -> str:
    seconds = max(0.0, time.time() - when)
    for unit, length in (("days", 86400), ("hours", 3600), ("minutes", 60)):
        if seconds >= length:
            return f"{seconds / length:.0f} {unit} ago"
    return "just now"


def register(app: typer.Typer) -> None:
    app.command("pull")(pull_command)
    app.command("ls")(ls_command)
    app.command("rm")(rm_command)
