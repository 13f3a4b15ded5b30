"""What the commands share that is cheap to import (the CLI starts without numpy or Numba)."""
from __future__ import annotations

import re
import sys

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
