"""`minillm quantize IN OUT TYPE`: llama-quantize's command, with its TYPE names and options.

Output on stderr: what is being done, a progress bar per tensor, warnings, and the sizes before
and after (MiB, bits per weight). --dry-run prints the plan (one line per tensor) on stdout and
writes nothing. Errors print `error: ...` and exit 1; an interrupted run exits 130 and leaves
no OUT and no temporary file.
"""
from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from pathlib import Path
from typing import List, Optional

import typer

from .errors import MinillmError
from .quantize.ftypes import TENSOR_TYPES, parse_file_type, type_help


def register(app: typer.Typer) -> None:
    """Add the `quantize` command to `app`."""
    epilog = ("TYPE is one of (id, name, bits per weight of its main tensor type, llama.cpp's note):"
              "\n\n" + "\n\n".join(type_help().splitlines()))
    app.command("quantize", epilog=epilog)(quantize_command)


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _default_out(in_path: Path, type_name: str) -> Path:
    """llama-quantize's name when OUT is left out: ggml-model-TYPE.gguf beside IN."""
    return in_path.parent / f"ggml-model-{parse_file_type(type_name).name}.gguf"


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def quantize_command(
    in_path: Path = typer.Argument(..., metavar="IN", help="Input .gguf model (F32, F16, BF16 or quantized).",
                                   show_default=False),
    out_path: str = typer.Argument(..., metavar="OUT", help="Output .gguf file (may be left out: "
                                   "then ggml-model-TYPE.gguf beside IN).", show_default=False),
    type_name: Optional[str] = typer.Argument(None, metavar="TYPE", show_default=False,
                                              help="Quantization type: a name or id from the list below."),
    allow_requantize: bool = typer.Option(False, "--allow-requantize",
                                          help="Allow requantizing tensors that are already quantized "
                                               "(can severely reduce quality)."),
    pure: bool = typer.Option(False, "--pure", help="Disable the k-quant mixtures: every weight gets TYPE."),
    leave_output_tensor: bool = typer.Option(False, "--leave-output-tensor",
                                             help="Leave output.weight un(re)quantized."),
    output_tensor_type: Optional[str] = typer.Option(None, "--output-tensor-type", metavar="T",
                                                     help="Tensor type for output.weight."),
    token_embedding_type: Optional[str] = typer.Option(None, "--token-embedding-type", metavar="T",
                                                       help="Tensor type for token_embd.weight."),
    tensor_type: Optional[List[str]] = typer.Option(None, "--tensor-type", metavar="PATTERN=T",
                                                    help="Type for tensors whose name matches the regular "
                                                         "expression PATTERN, e.g. attn_v=q8_0 (repeatable). "
                                                         f"T: {', '.join(TENSOR_TYPES)}."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, max=1024, help="Threads."),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="Print each tensor's type and size; write nothing."),
) -> None:
    """Quantize a GGUF model like llama-quantize, bit for bit."""
    # OpenMP threads that sleep between kernels instead of spinning: a few microseconds per
    # call when the machine is idle, but several times faster when another process is busy
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from .quantize import quantize

    gc.enable()  # off while the CLI starts (cli.main); a quantize run is long

    # SIGTERM ends the run like Ctrl-C: through the clean-up path (only the main thread may set it)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if in_main else None
    try:
        if type_name is None:                       # IN TYPE: llama-quantize's short form
            type_name, out = out_path, (None if dry_run else _default_out(in_path, out_path))
        else:
            out = Path(out_path)
        if dry_run:
            _err(f"planning {in_path} as {parse_file_type(type_name).name}")
        else:
            _err(f"quantizing {in_path} to {out} as {parse_file_type(type_name).name}")
        summary = quantize(in_path, out, type_name, allow_requantize=allow_requantize, pure=pure,
                           leave_output_tensor=leave_output_tensor, output_tensor_type=output_tensor_type,
                           token_embedding_type=token_embedding_type, tensor_types=tensor_type or (),
                           threads=threads, dry_run=dry_run, progress=not dry_run, log=_err)
    except MinillmError as exc:
        _err(f"error: {exc}")
        raise typer.Exit(1)
    except KeyboardInterrupt:
        _err("interrupted: nothing was written")
        raise typer.Exit(130)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    if dry_run:
        print("\n".join(summary.plan_lines()), flush=True)
    if summary.n_fallback:
        _err(f"warning: {summary.n_fallback} of {len(summary.tensors)} tensors needed a fallback type "
             "(row length not divisible by the block size)")
    for line in summary.size_lines():
        _err(line)
    if not dry_run:
        _err(f"wrote {out} ({summary.file_bytes / 2**20:.2f} MiB) in {summary.seconds:.2f} s")
    # the work is done: spare the interpreter's exit a garbage-collector pass over the many
    # objects Numba created (about 0.15 s, a seventh of a whole small-model run)
    gc.freeze()
