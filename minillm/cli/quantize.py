"""`minillm quantize IN OUT TYPE`: llama-quantize's command, with its TYPE names and options.

Output on stderr: what is being done, a progress bar per tensor, warnings, and the sizes before
and after (MiB, bits per weight). --dry-run prints the plan (one line per tensor) on stdout and
writes nothing. Errors print `error: ...` and exit 1; an interrupted run exits 130 and leaves
no OUT and no temporary file.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import List, Optional

import typer

from .common import err, print_error
from .models import takes_model
from ..errors import MinillmError
from ..quantize.ftypes import TENSOR_TYPES, parse_file_type, type_help


def register(app: typer.Typer) -> None:
    """Add the `quantize` command to `app`."""
    epilog = ("TYPE is one of (id, name, bits per weight of its main tensor type, llama.cpp's note):"
              "\n\n" + "\n\n".join(type_help().splitlines()))
    app.command("quantize", epilog=epilog)(takes_model("in_path", shifts=("out_path", "type_name"))(quantize_command))


def _default_out(in_path: Path, type_name: str) -> Path:
    """llama-quantize's name when OUT is left out: ggml-model-TYPE.gguf beside IN."""
    from ..hub import in_cache

    folder = Path.cwd() if in_cache(in_path) else in_path.parent  # never inside the hub's cache
    return folder / f"ggml-model-{parse_file_type(type_name).name}.gguf"


def parse_layer_list(text: Optional[str]) -> list[int]:
    """--prune-layers 20,21 -> [20, 21]."""
    if text is None:
        return []
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        layers = [-1]
    if any(i < 0 for i in layers):
        raise MinillmError(f"bad --prune-layers {text!r}: expected layer numbers separated by commas, e.g. 20,21")
    return layers


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def quantize_command(
    in_path: Optional[Path] = typer.Argument(None, metavar="IN", help="Input .gguf model (F32, F16, BF16 or "
                                             "quantized), or REPO[:QUANT] on the Hugging Face Hub.",
                                   show_default=False),
    out_path: Optional[str] = typer.Argument(None, metavar="OUT", help="Output .gguf file (may be left out: "
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
    prune_layers: Optional[str] = typer.Option(
        None, "--prune-layers", metavar="L0,L1,...|auto:N",
        help="Leave these layers out; the rest are renumbered. auto:N measures every layer's cost "
             "(KL divergence when it is left out, on --calibration or --eval text) and drops the N cheapest."),
    imatrix: Optional[str] = typer.Option(  # a str: the file records the path as typed, as llama-quantize
        None, "--imatrix", metavar="FILE", show_default=False,
        help="Importance matrix (minillm imatrix or llama-imatrix, GGUF or .dat): weigh each column's "
             "rounding error by how much the model uses it, as llama-quantize --imatrix."),
    calibration: Optional[Path] = typer.Option(None, "--calibration", metavar="TEXT", show_default=False,
                                               help="Text for --prune-layers auto:N (default: the --eval text)."),
    eval_text: Optional[Path] = typer.Option(
        None, "--eval", metavar="TEXT", show_default=False,
        help="After writing, report perplexity, KL divergence from IN, top-1 agreement, size and decode "
             "speed on TEXT. TYPE may then list several types (Q8_0,Q6_K,Q4_K_M): OUT is a directory."),
    eval_ctx: int = typer.Option(512, "--eval-ctx", min=16, max=1 << 16,
                                 help="Tokens per chunk for --eval and --calibration."),
    eval_chunks: Optional[int] = typer.Option(None, "--eval-chunks", min=1,
                                              help="Score only the first N chunks (--calibration: 2)."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, max=1024, help="Threads."),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="Print each tensor's type and size; write nothing."),
    as_json: bool = typer.Option(False, "--json", help="With --eval: print the table as one JSON object."),
) -> None:
    """Quantize a GGUF model like llama-quantize, bit for bit."""
    # OpenMP threads that sleep between kernels instead of spinning: a few microseconds per
    # call when the machine is idle, but several times faster when another process is busy
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    gc.enable()  # off while the CLI starts (cli.main); a quantize run is long

    # SIGTERM ends the run like Ctrl-C: through the clean-up path (only the main thread may set it)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if in_main else None
    options = dict(allow_requantize=allow_requantize, pure=pure, leave_output_tensor=leave_output_tensor,
                   output_tensor_type=output_tensor_type, token_embedding_type=token_embedding_type,
                   tensor_types=tensor_type or (), threads=threads)
    if imatrix is not None:
        options["imatrix"] = imatrix
    try:
        if out_path is None:
            raise typer.BadParameter("missing TYPE: minillm quantize IN [OUT] TYPE")
        if type_name is None:                       # IN TYPE: llama-quantize's short form
            type_name, out_path = out_path, None
        jobs = _jobs(in_path, out_path, type_name, eval_text, dry_run)
        texts = {path: _read_text(path) for path in {eval_text, calibration} if path is not None}
        options["prune_layers"] = _layers_to_prune(in_path, prune_layers, texts.get(calibration or eval_text),
                                                   eval_ctx, eval_chunks or 2, threads)
        for file_type, out in jobs:
            _quantize_one(in_path, out, file_type, options, dry_run)
        if eval_text is not None and not dry_run:
            _report_eval(in_path, [out for _, out in jobs], texts[eval_text], eval_ctx, eval_chunks,
                         threads, as_json)
    except MinillmError as exc:
        print_error(exc)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        err("interrupted: nothing was written")
        raise typer.Exit(130)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    # the work is done: spare the interpreter's exit a garbage-collector pass over the many
    # objects Numba created (about 0.15 s, a seventh of a whole small-model run)
    gc.freeze()


def _jobs(in_path: Path, out_path: Optional[str], type_names: str, eval_text, dry_run: bool):
    """[(file type name, output path or None for a dry run)]: one type, or with --eval several
    (comma-separated), each written into the directory OUT as IN's stem + type."""
    names = [name.strip() for name in type_names.split(",")]
    if len(names) == 1:
        name = parse_file_type(names[0]).name
        out = None if dry_run else Path(out_path) if out_path is not None else _default_out(in_path, name)
        return [(names[0], out)]
    if eval_text is None:
        raise MinillmError("several types need --eval TEXT (they are written to compare them)")
    if out_path is None:
        raise MinillmError("with several types, OUT is the directory to write them to")
    folder = Path(out_path)
    if folder.exists() and not folder.is_dir():
        raise MinillmError(f"with several types, OUT is a directory; {folder} is a file")
    types = [parse_file_type(name).name for name in names]
    if not dry_run:
        folder.mkdir(parents=True, exist_ok=True)
    return [(name, None if dry_run else folder / f"{in_path.stem}-{name}.gguf") for name in types]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise MinillmError(f"cannot read {path}: {exc}") from None


def _quantize_one(in_path: Path, out: Optional[Path], type_name: str, options: dict, dry_run: bool) -> None:
    from ..quantize import quantize

    name = parse_file_type(type_name).name
    err(f"planning {in_path} as {name}" if dry_run else f"quantizing {in_path} to {out} as {name}")
    summary = quantize(in_path, out, type_name, dry_run=dry_run, progress=not dry_run, log=err, **options)
    if dry_run:
        print("\n".join(summary.plan_lines()), flush=True)
    if summary.n_fallback:
        err(f"warning: {summary.n_fallback} of {len(summary.tensors)} tensors needed a fallback type "
            "(row length not divisible by the block size)")
    for line in summary.size_lines():
        err(line)
    if not dry_run:
        err(f"wrote {out} ({summary.file_bytes / 2**20:.2f} MiB) in {summary.seconds:.2f} s")


def _layers_to_prune(in_path: Path, spec: Optional[str], text: Optional[str], n_ctx: int, n_chunks: int,
                     threads) -> list[int]:
    """--prune-layers: the listed layers, or for auto:N the N whose absence costs least."""
    if spec is None or not spec.startswith("auto:"):
        return parse_layer_list(spec)
    try:
        n = int(spec[5:])
    except ValueError:
        raise MinillmError(f"bad --prune-layers {spec!r}: expected auto:N, e.g. auto:2") from None
    if text is None:
        raise MinillmError("--prune-layers auto:N measures the layers on a text: "
                           "pass --calibration TEXT or --eval TEXT")
    from tqdm import tqdm

    from ..quality.evaluate import cheapest_layers, layer_importance

    err(f"measuring the cost of leaving out each layer of {in_path} ({n_chunks} chunks of {n_ctx} tokens)")
    with tqdm(total=None, unit="layer", file=sys.stderr, leave=False) as bar:
        def progress(done, total):
            bar.total = total
            bar.update(1)

        costs = layer_importance(in_path, text, n_ctx, n_chunks, threads, progress)
    chosen = cheapest_layers(costs, n)
    err(f"{'layer':>5} {'KLD':>9} {'same top':>9} {'PPL':>10}")
    for c in sorted(costs, key=lambda c: c.kld):
        mark = "  <- pruned" if c.layer in chosen else ""
        err(f"{c.layer:>5} {c.kld:9.5f} {100 * c.same_top:8.2f}% {c.ppl:10.4f}{mark}")
    err(f"pruning layers {','.join(map(str, chosen))}")
    return chosen


def _report_eval(in_path: Path, outputs: list[Path], text: str, n_ctx: int, n_chunks, threads, as_json: bool):
    from tqdm import tqdm

    from ..quality.evaluate import Evaluator, table_lines

    with tqdm(total=None, unit="chunk", file=sys.stderr, leave=False) as bar:
        def progress(label, done, total):
            if done == 1:
                bar.reset(total)
            bar.set_description_str(label, refresh=False)
            bar.update(1)

        with Evaluator(in_path, text, n_ctx, n_chunks, threads, progress=progress) as ev:
            rows = [ev.row(out) for out in outputs]
    if as_json:
        print(json.dumps({"source": ev.source.as_dict(), "files": [r.as_dict() for r in rows],
                          "n_ctx": n_ctx}))
    else:
        print("\n".join(table_lines(ev.source, rows)), flush=True)
