"""`minillm info`: a model file described (architecture, sizes, quant types, tokenizer), read
without loading its weights."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from .common import print_table
from .models import takes_model
from .options import MODEL


def register(app: typer.Typer) -> None:
    """Add the `info` command to `app`."""
    app.command("info")(takes_model()(info_command))


def info_command(model: Optional[Path] = MODEL, as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")):
    """Describe a model file: architecture, sizes, quant types, tokenizer."""
    from .inspect import describe

    facts = describe(model)
    if as_json:
        print(json.dumps(facts, indent=2))
        return
    rows = []
    for key, value in facts.items():
        if isinstance(value, dict):
            value = ", ".join(f"{k}: {v}" for k, v in value.items())
        elif isinstance(value, list):
            value = "; ".join(value) or "nothing beyond the architecture"
        rows.append([key.replace("_", " "), str(value)])
    print_table(rows)
