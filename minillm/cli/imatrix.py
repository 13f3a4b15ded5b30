"""`minillm imatrix`: llama-imatrix's importance matrix, for quantize --imatrix, with its options.

    minillm imatrix MODEL -f TEXT [-o imatrix.gguf]      compute one
    minillm imatrix MODEL -f TEXT --in-file A.gguf       ... added to earlier files
    minillm imatrix --in-file A.gguf --in-file B.gguf    combine files only
    minillm imatrix --in-file A.gguf --show-statistics   print their statistics

Progress (chunks, and the running perplexity) and the closing summary go to stderr; --json
prints the figures on stdout. Every file is written whole (it appears complete or not at all):
the output every --output-frequency chunks and at the end, a numbered copy OUT.at_N every
--save-frequency chunks, at the moments llama-imatrix writes them.
"""
from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import List, Optional

import click
import typer
from typer.core import TyperCommand

from .common import load_model, print_error
from .models import takes_model
from ..errors import MinillmError

try:                                # typer 0.2x carries its own copy of click
    from typer._click.exceptions import UsageError as _TyperUsageError
except ImportError:
    _TyperUsageError = click.UsageError


class _OneLineErrors(TyperCommand):
    """Bad options and values end in one `error:` line on stderr (status 2), not a usage box."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except (click.UsageError, _TyperUsageError) as exc:
            message = exc.format_message()
            print(f"error: {message[:1].lower()}{message[1:]} (see minillm imatrix --help)", file=sys.stderr)
            raise SystemExit(2) from None


def register(app: typer.Typer) -> None:
    app.command("imatrix", cls=_OneLineErrors)(takes_model(required=False)(imatrix_command))


class OutputFormat(str, Enum):
    gguf = "gguf"
    dat = "dat"


def parse_csv_row(value: str) -> list[str]:
    """The files of one --in-file value, as llama.cpp's arguments split it: at commas, except
    within double quotes ("" for a quote inside them)."""
    fields, field, quoted, i = [], "", False, 0
    while i < len(value):
        ch = value[i]
        if ch == '"':
            if not quoted:
                if field:
                    field += ch          # a quote within a field is plain text
                else:
                    quoted = True
            elif value[i + 1:i + 2] == '"':
                field += ch
                i += 1
            else:
                quoted = False
        elif ch == "," and not quoted:
            fields.append(field)
            field = ""
        else:
            field += ch
        i += 1
    fields.append(field)
    return fields


def copy_path(out: Path, n_chunk: int) -> Path:
    """llama-imatrix's name for the copy kept after n_chunk chunks."""
    return out.with_name(f"{out.name}.at_{n_chunk}")


def imatrix_command(
    model: Optional[Path] = typer.Argument(None, help="A .gguf model file, or REPO[:QUANT] on the Hugging Face Hub (needed with -f).",
                                           show_default=False),
    file: Optional[str] = typer.Option(None, "-f", "--file", show_default=False,
                                       help="Calibration text (its path, as typed, is recorded). Without it, "
                                            "--in-file files are only combined."),
    out: Path = typer.Option(Path("imatrix.gguf"), "-o", "--output", help="Where to write the matrix."),
    output_format: Optional[OutputFormat] = typer.Option(
        None, "--output-format", show_default=False,
        help="gguf (the default) or dat, the legacy format (no activation sums)."),
    in_files: Optional[List[str]] = typer.Option(
        None, "--in-file", metavar="FILE", show_default=False,
        help="An earlier importance matrix (GGUF or .dat) to add in; repeat it, or separate files with commas. "
             "Without -f the files are combined and written to -o."),
    show_statistics: bool = typer.Option(False, "--show-statistics",
                                         help="Print the statistics of the --in-file matrix per tensor and per "
                                              "layer (with --json, as data), and exit."),
    n_ctx: int = typer.Option(512, "-c", "--ctx", min=16, max=1 << 16,
                              help="Tokens per chunk (a .dat --in-file's chunks count as this many rows)."),
    n_batch: int = typer.Option(2048, "-b", "--batch", min=1, max=1 << 20,
                                help="Tokens per batch: n_batch/n_ctx chunks are evaluated together, as "
                                     "llama-imatrix."),
    n_ubatch: int = typer.Option(512, "-ub", "--ubatch", min=1, max=1 << 20, help="Rows per step within a batch."),
    chunks: Optional[int] = typer.Option(None, "--chunks", min=1, help="Use at most N chunks (from --chunk)."),
    first_chunk: int = typer.Option(0, "--chunk", "--from-chunk", min=0, metavar="N",
                                    help="Start from chunk N of the text (skip the first N)."),
    out_freq: int = typer.Option(10, "-ofreq", "--output-frequency", min=1, metavar="N",
                                 help="Also write the output every N chunks (counting those of --in-file files)."),
    save_freq: int = typer.Option(0, "--save-frequency", min=0, metavar="N",
                                  help="Keep a copy OUTPUT.at_<chunks> every N chunks (0: none)."),
    process_output: bool = typer.Option(False, "--process-output",
                                        help="Also collect the output (or tied embedding) tensor's inputs."),
    no_ppl: bool = typer.Option(False, "--no-ppl", help="Do not compute the perplexity along the way."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, max=1024, help="Threads."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as one JSON object."),
) -> None:
    """Compute an importance matrix over a text, combine earlier ones, or show their statistics,
    as llama-imatrix (its file formats and figures)."""
    try:
        files = []
        for value in in_files or []:
            files += parse_csv_row(value)
            if "" in files:
                raise MinillmError(f"--in-file {value!r} names a file without a name")
        _imatrix(model, file, out, output_format, files, show_statistics, n_ctx, n_batch, n_ubatch, chunks,
                 first_chunk, out_freq, save_freq, process_output, no_ppl, threads, as_json)
    except MinillmError as exc:
        print_error(exc)
        raise typer.Exit(1)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def _loaded(in_files: list[str], n_ctx: int):
    from ..imatrix_file import Collector, load

    collector = Collector(n_ctx, _warn)
    for path in in_files:
        collector.add(load(path))
    return collector


def _write(path: Path, imatrix, fmt: OutputFormat, final: bool = False) -> None:
    from ..imatrix_file import to_bytes, to_dat_bytes
    from ..quantize.writer import AtomicOutput

    if fmt is OutputFormat.dat:
        data, left_out = to_dat_bytes(imatrix)
        if final:
            for name in left_out:
                _warn(f"{name} counted nothing: left out of {path}")
    else:
        data = to_bytes(imatrix)
    with AtomicOutput(path) as f:
        f.write(data)
        f.commit()


def _show_statistics(in_files: list[str], n_ctx: int, as_json: bool) -> None:
    from ..quality.imatrix_stats import figures, format_table, report

    if not in_files:
        raise MinillmError("--show-statistics shows the statistics of --in-file FILE: pass the importance matrix")
    collector = _loaded(in_files, n_ctx)
    rep = report(collector.entries, collector.n_layer_nextn)
    if 0 < rep.n_legacy < len(rep.tensors):
        _warn(f"{rep.n_legacy} of {len(rep.tensors)} tensors have no activation sums: the legacy layout")
    if as_json:
        print(json.dumps({"files": in_files, **figures(rep)}))
    else:
        sys.stdout.write(format_table(rep, ", ".join(in_files)))
        sys.stdout.flush()
    if rep.gap is not None:
        raise MinillmError(rep.gap)


def _imatrix(model, file, out, output_format, in_files, show_statistics, n_ctx, n_batch, n_ubatch, chunks,
             first_chunk, out_freq, save_freq, process_output, no_ppl, threads, as_json) -> None:
    if show_statistics:
        return _show_statistics(in_files, n_ctx, as_json)
    if out.is_dir():
        raise MinillmError(f"{out} is a directory")
    fmt = output_format or OutputFormat.gguf
    if output_format is None and not str(out).endswith(".gguf"):
        _warn(f"{out} is written as GGUF, though its name does not end in .gguf (--output-format dat writes "
              f"the legacy format)")
    text = ""
    if file is not None:
        try:
            with open(file, encoding="utf-8", newline="") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise MinillmError(f"cannot read {file}: {exc}") from None
        text = text[:-1] if text.endswith("\n") else text        # as llama.cpp reads -f
    if not text and not in_files:
        raise MinillmError("nothing to do: pass MODEL -f TEXT to compute an importance matrix, or --in-file FILE "
                           "to combine earlier ones" + (f" ({file} is empty)" if file is not None else ""))
    collector = _loaded(in_files, n_ctx)
    if not text:                                                 # combine only
        imatrix = collector.imatrix(file)
        _write(out, imatrix, fmt, final=True)
        print(f"saved {len(imatrix.entries)} entries from {len(in_files)} file{'s' * (len(in_files) > 1)} "
              f"({imatrix.chunk_count} chunks of {imatrix.chunk_size} tokens) to {out}", file=sys.stderr)
        if as_json:
            print(json.dumps({"file": str(out), "format": fmt.value, "entries": len(imatrix.entries),
                              "chunks": imatrix.chunk_count, "chunk_size": imatrix.chunk_size,
                              "datasets": imatrix.datasets, "in_files": in_files, "copies": [], "ppl": None}))
        return
    if model is None:
        raise MinillmError("computing an importance matrix needs MODEL, the .gguf file to run over the text")
    from tqdm import tqdm

    from ..quality.imatrix import compute_imatrix

    copies: list[str] = []

    def on_chunks(n_chunk: int, step: int) -> None:
        """llama-imatrix's rule: write when the count passes a multiple of the frequency."""
        if (n_chunk % out_freq) // step == 0:
            _write(out, collector.imatrix(file), fmt)
        if save_freq > 0 and (n_chunk % save_freq) // step == 0:
            _write(copy_path(out, n_chunk), collector.imatrix(file), fmt)
            copies.append(str(copy_path(out, n_chunk)))

    collector.on_chunks = on_chunks
    m = load_model(model, threads, "cpu")
    with tqdm(total=None, unit="chunk", file=sys.stderr, disable=as_json, leave=False) as bar:
        def progress(done, total, ppl):
            bar.total = total
            bar.update(done - bar.n)
            if ppl is not None:
                bar.set_postfix(ppl=f"{ppl:.4f}")

        result = compute_imatrix(m, text, file, n_ctx, n_batch, n_ubatch, chunks, process_output, not no_ppl,
                                 progress, first_chunk, collector)
    imatrix = result.imatrix
    _write(out, imatrix, fmt, final=True)
    ppl = f", PPL = {result.ppl:.4f}" if result.ppl is not None else ""
    earlier = f" (with {len(in_files)} earlier file{'s' * (len(in_files) > 1)})" if in_files else ""
    print(f"saved {len(imatrix.entries)} entries computed on {imatrix.chunk_count} chunks of {n_ctx} tokens"
          f"{earlier} to {out}{ppl}", file=sys.stderr)
    if copies:
        print(f"kept copies {', '.join(copies)}", file=sys.stderr)
    if as_json:
        print(json.dumps({"file": str(out), "format": fmt.value, "entries": len(imatrix.entries),
                          "chunks": imatrix.chunk_count, "chunk_size": imatrix.chunk_size,
                          "datasets": imatrix.datasets, "in_files": in_files, "copies": copies, "ppl": result.ppl}))
