"""What a quantization or a pruning costs, measured on a text.

* `evaluate_files`: the source model's perplexity and log-probabilities (a temporary base file,
  llama-perplexity's), then for each quantized file its perplexity, KL divergence from the
  source, top-1 agreement, size and decode speed: the rows of `quantize --eval`'s table.
* `layer_importance`: the KL divergence from the whole model when one layer is left out of the
  forward, for every layer (`quantize --prune-layers auto:N` drops the N cheapest). Leaving a
  layer out is what pruning does, except that a pruned Gemma's layers are renumbered, which moves
  its sliding-window pattern; the evaluation of the written file shows the real cost.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import MinillmError
from .kl_divergence import KLDResult, KLDSums, encode_log_probs

MIB = 1024 * 1024


@dataclass
class EvalRow:
    """One line of the trade-off table."""
    name: str
    file_bytes: int
    bits_per_weight: float
    ppl: float
    kld: float | None = None            # None for the source itself
    kld_p99: float | None = None
    same_top: float | None = None
    tg_tokens_per_s: float | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _decode_speed(model, n_gen: int = 64) -> float:
    from ..timing import time_decode

    rng = np.random.default_rng(0)
    model.eval(rng.integers(0, model.n_vocab, size=4), model.new_cache(8))   # warm
    return round(n_gen / min(time_decode(model, rng, n_gen) for _ in range(2)), 2)


def _bits_per_weight(path) -> float:
    from ..gguf_file import GGUFFile

    with GGUFFile(path) as gf:
        n = sum(t.n_elements for t in gf.tensors.values())
        size = sum(t.n_elements // t.format.block_size * t.format.type_size for t in gf.tensors.values())
    return 8 * size / max(n, 1)


class Evaluator:
    """Scores files against a source model over one text: `row(path)` per file."""

    def __init__(self, source, text: str, n_ctx: int = 512, n_chunks: int | None = None,
                 threads: int | None = None, speed: bool = True, progress=None):
        from ..model import Model
        from .perplexity import perplexity

        self.threads, self.speed, self.progress = threads, speed, progress
        self.tmp = tempfile.TemporaryDirectory(prefix="minillm-eval-")
        self.base_path = Path(self.tmp.name) / "base.kld"
        model = Model(source, threads=threads, device="cpu")
        result = perplexity(model, text, n_ctx, self._step(f"{Path(source).name}"), n_chunks=n_chunks,
                            kld_base=self.base_path)
        self.source = EvalRow(Path(source).name, os.path.getsize(source), _bits_per_weight(source), result.ppl,
                              tg_tokens_per_s=_decode_speed(model) if speed else None)

    def _step(self, label: str):
        if self.progress is None:
            return None
        return lambda done, total, *_: self.progress(label, done, total)

    def row(self, path) -> EvalRow:
        from ..model import Model
        from .perplexity import kl_divergence

        model = Model(path, threads=self.threads, device="cpu")
        figures = kl_divergence(model, self.base_path, self._step(Path(path).name)).figures()
        return EvalRow(Path(path).name, os.path.getsize(path), _bits_per_weight(path), figures["ppl"],
                       figures["kld"], figures["kld_quantiles"]["99.0%"], figures["same_top"],
                       _decode_speed(model) if self.speed else None)

    def close(self) -> None:
        self.tmp.cleanup()

    def __enter__(self) -> "Evaluator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def table_lines(source: EvalRow, rows: list[EvalRow]) -> list[str]:
    """The trade-off table, one line per file, the source first."""
    width = max(len(r.name) for r in [source, *rows])

    def opt(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)
    head = (f"{'file':<{width}} {'MiB':>8} {'BPW':>6} {'size':>7} {'PPL':>9} {'ΔPPL':>8} "
            f"{'KLD':>9} {'KLD p99':>9} {'same top':>9} {'tg tok/s':>9}")
    lines = [head, "-" * len(head)]
    for r in [source, *rows]:
        change = None if r is source else r.ppl / source.ppl - 1
        lines.append(f"{r.name:<{width}} {r.file_bytes / MIB:8.2f} {r.bits_per_weight:6.2f} "
                     f"{r.file_bytes / source.file_bytes:7.1%} {r.ppl:9.4f} {opt(change, '+.2%'):>8} "
                     f"{opt(r.kld, '.5f'):>9} {opt(r.kld_p99, '.5f'):>9} {opt(r.same_top, '.2%'):>9} "
                     f"{opt(r.tg_tokens_per_s, '.1f'):>9}")
    return lines


@dataclass
class LayerCost:
    layer: int
    kld: float          # mean KL divergence from the whole model with this layer left out
    same_top: float
    ppl: float


def layer_importance(path, text: str, n_ctx: int = 512, n_chunks: int = 2, threads: int | None = None,
                     progress=None) -> list[LayerCost]:
    """Every layer's cost when it alone is left out, on the text's first n_chunks chunks."""
    from ..model import Model
    from .perplexity import chunk_count, scored_chunks

    model = Model(path, threads=threads, device="cpu")
    ids = model.tokenizer.tokenize(text, special=False)
    n_chunks = chunk_count(len(ids), n_ctx, n_chunks)
    if n_chunks * (n_ctx - 1 - n_ctx // 2) < 100:
        raise MinillmError(f"the calibration text gives {n_chunks} chunk(s) of {n_ctx} tokens; "
                           "at least 100 scored positions are needed")
    reference = [(encode_log_probs(logits), targets)
                 for _, logits, targets in scored_chunks(model, ids, n_ctx, n_chunks)]
    n_layer = model.arch.hp.n_layer
    costs = []
    try:
        for il in range(n_layer):
            model.backend.skipped_layers = frozenset((il,))
            sums = KLDSums()
            for c, logits, targets in scored_chunks(model, ids, n_ctx, n_chunks):
                sums.add(logits, reference[c][0], targets)
            f = KLDResult(sums, n_chunks).figures()
            costs.append(LayerCost(il, f["kld"], f["same_top"], f["ppl"]))
            if progress:
                progress(il + 1, n_layer)
    finally:
        model.backend.skipped_layers = frozenset()
    return costs


def cheapest_layers(costs: list[LayerCost], n: int) -> list[int]:
    """The n layers whose absence costs least (smallest KL divergence)."""
    if not 0 < n < len(costs):
        raise MinillmError(f"cannot leave out the {n} cheapest of the model's {len(costs)} layers: "
                           f"choose 1 to {len(costs) - 1}")
    return sorted(c.layer for c in sorted(costs, key=lambda c: c.kld)[:n])
