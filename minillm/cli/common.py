"""What the commands share that is cheap to import (the CLI starts without numpy or Numba)."""
from __future__ import annotations

import sys


def err(message: str) -> None:
    """A line on stderr, where logs and notices go (stdout carries only the answer)."""
    print(message, file=sys.stderr, flush=True)
