"""`minillm imatrix MODEL -f TEXT -o FILE`: llama-imatrix's importance matrix, for quantize --imatrix.

Progress (chunks, and the running perplexity) and the closing summary go to stderr; --json
prints the figures on stdout. The file appears only when complete.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from .errors import MinillmError


def register(app: typer.Typer) -> None:
    app.command("imatrix")(imatrix_command)


def imatrix_command(
    model: Path = typer.Argument(..., help="Path to a .gguf model file.", show_default=False),
    file: str = typer.Option(..., "-f", "--file", help="Calibration text (its path, as typed, is recorded).",
                             show_default=False),
    out: Path = typer.Option(Path("imatrix.gguf"), "-o", "--output", help="Where to write the matrix (GGUF)."),
    n_ctx: int = typer.Option(512, "-c", "--ctx", min=16, max=1 << 16, help="Tokens per chunk."),
    n_batch: int = typer.Option(2048, "-b", "--batch", min=1, max=1 << 20,
                                help="Tokens per batch: n_batch/n_ctx chunks are evaluated together, as llama-imatrix."),
    n_ubatch: int = typer.Option(512, "-ub", "--ubatch", min=1, max=1 << 20, help="Rows per step within a batch."),
    chunks: Optional[int] = typer.Option(None, "--chunks", min=1, help="Use only the first N chunks."),
    process_output: bool = typer.Option(False, "--process-output",
                                        help="Also collect the output (or tied embedding) tensor's inputs."),
    no_ppl: bool = typer.Option(False, "--no-ppl", help="Do not compute the perplexity along the way."),
    threads: Optional[int] = typer.Option(None, "-t", "--threads", min=1, max=1024, help="Threads."),
    as_json: bool = typer.Option(False, "--json", help="Print the figures as one JSON object."),
) -> None:
    """Compute an importance matrix over a text, as llama-imatrix (its file format and figures)."""
    from tqdm import tqdm

    from .cli import load_model
    from .imatrix import compute_imatrix
    from .imatrix_file import to_bytes
    from .quantize.writer import AtomicOutput

    try:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise MinillmError(f"cannot read {file}: {exc}") from None
        if out.is_dir():
            raise MinillmError(f"{out} is a directory")
        m = load_model(model, threads, "cpu")
        with tqdm(total=None, unit="chunk", file=sys.stderr, disable=as_json, leave=False) as bar:
            def progress(done, total, ppl):
                bar.total = total
                bar.update(done - bar.n)
                if ppl is not None:
                    bar.set_postfix(ppl=f"{ppl:.4f}")

            result = compute_imatrix(m, text, file, n_ctx, n_batch, n_ubatch, chunks, process_output,
                                     not no_ppl, progress)
        with AtomicOutput(out) as f:
            f.write(to_bytes(result.imatrix))
            f.commit()
    except MinillmError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(1)
    imatrix = result.imatrix
    ppl = f", PPL = {result.ppl:.4f}" if result.ppl is not None else ""
    print(f"saved {len(imatrix.entries)} entries computed on {imatrix.chunk_count} chunks of {n_ctx} tokens "
          f"to {out}{ppl}", file=sys.stderr)
    if as_json:
        print(json.dumps({"file": str(out), "entries": len(imatrix.entries), "chunks": imatrix.chunk_count,
                          "chunk_size": n_ctx, "ppl": result.ppl}))
