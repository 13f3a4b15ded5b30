"""quantize(): read a GGUF model, choose each tensor's type, convert, write the new file.

Test hook: the environment variable MINILLM_QUANTIZE_TENSOR_DELAY (seconds, default 0) makes
the writer sleep after each tensor it writes. It changes nothing in the output; the tests use
it to interrupt a run reliably in the middle.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from ..errors import MinillmError
from ..formats import Format
from ..gguf_file import GGUFFile
from ..imatrix_file import Imatrix, load as load_imatrix
from .ftypes import FileType, parse_file_type, parse_tensor_type
from .plan import Plan, PlanOptions, TensorPlan, make_plan
from .writer import AtomicOutput, build_header, write_array

DELAY_ENV = "MINILLM_QUANTIZE_TENSOR_DELAY"
MIB = 1024 * 1024


@dataclass
class QuantizeSummary:
    """What a run did (or, with dry_run, would do). Sizes are the sum of the tensors' bytes."""
    in_path: Path
    out_path: Path | None
    file_type: FileType
    tensors: list[TensorPlan]
    dry_run: bool
    seconds: float = 0.0
    file_bytes: int = 0                # size of the written file (0 for a dry run)
    warnings: list[str] = field(default_factory=list)
    n_fallback: int = 0

    @property
    def n_elements(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def bytes_before(self) -> int:
        return sum(t.src_bytes for t in self.tensors)

    @property
    def bytes_after(self) -> int:
        return sum(t.dst_bytes for t in self.tensors)

    @property
    def n_requantized(self) -> int:
        return sum(t.requantizes for t in self.tensors)

    def size_lines(self) -> list[str]:
        """llama-quantize's closing lines: model and quantized size in MiB and bits per weight."""
        n = max(self.n_elements, 1)
        return [f"model size = {self.bytes_before / MIB:8.2f} MiB ({self.bytes_before * 8 / n:.2f} BPW)",
                f"quant size = {self.bytes_after / MIB:8.2f} MiB ({self.bytes_after * 8 / n:.2f} BPW)"]

    def plan_lines(self) -> list[str]:
        """One line per tensor: name, shape, source type -> target type, size after."""
        width = max((len(t.name) for t in self.tensors), default=0)
        return [f"{t.name:<{width}}  {str(list(t.shape)):<14} {t.src.name:>5} -> {t.dst.name:<5} "
                f"{t.dst_bytes / MIB:9.3f} MiB" for t in self.tensors]


def parse_tensor_type_overrides(items: Iterable) -> tuple[tuple[re.Pattern, Format], ...]:
    """--tensor-type PATTERN=TYPE items (or (pattern, type) pairs) -> compiled overrides. The
    pattern is a regular expression searched in the tensor name, lower-cased like llama-quantize."""
    overrides = []
    for item in items:
        if isinstance(item, str):
            pattern, sep, type_name = item.partition("=")
            if not sep or not pattern or not type_name:
                raise MinillmError(f"bad tensor_types {item!r}: expected PATTERN=TYPE, e.g. attn_v=q8_0",
                                   ("tensor_types",))
        else:
            pattern, type_name = item
        try:
            regex = re.compile(pattern.lower())
        except re.error as exc:
            raise MinillmError(f"bad tensor_types pattern {pattern!r}: {exc}", ("tensor_types",)) from None
        overrides.append((regex, _tensor_type(type_name)))
    return tuple(overrides)


def _tensor_type(value) -> Format | None:
    if value is None or isinstance(value, Format):
        return value
    return parse_tensor_type(value)


def _check_paths(in_path: Path, out_path: Path) -> None:
    if out_path.is_dir():
        raise MinillmError(f"{out_path} is a directory")
    same = in_path.resolve() == out_path.resolve()
    if not same and out_path.exists() and in_path.exists():
        same = os.path.samefile(in_path, out_path)
    if same:
        raise MinillmError(f"input and output are the same file: {in_path}")
    if not out_path.parent.is_dir():
        raise MinillmError(f"{out_path.parent}: no such directory")


def _check_requantize(plan: Plan, allow: bool, log: Callable[[str], None]) -> None:
    """llama-quantize refuses to dequantize quantized tensors unless told to."""
    requantized = [t for t in plan.tensors if t.requantizes]
    if not requantized:
        return
    kinds = ", ".join(sorted({t.src.name for t in requantized}))
    if not allow:
        raise MinillmError(f"requantizing from type {kinds} is disabled ({len(requantized)} tensors are "
                           f"already quantized); pass allow_requantize to dequantize and requantize them",
                           ("allow_requantize",))
    log(f"warning: requantizing {len(requantized)} tensors from {kinds}: this can severely reduce "
        "quality compared to quantizing from 16 or 32 bit")


def quantize(in_path, out_path, type_name, *, allow_requantize: bool = False, pure: bool = False,
             leave_output_tensor: bool = False, output_tensor_type=None, token_embedding_type=None,
             tensor_types: Iterable = (), prune_layers: Iterable[int] = (), imatrix=None,
             threads: int | None = None, dry_run: bool = False, progress: bool = False,
             log: Callable[[str], None] | None = None) -> QuantizeSummary:
    """Quantize the GGUF model at in_path to out_path as type_name (llama-quantize's TYPE: a
    name such as "Q4_K_M" or its numeric id). Returns a QuantizeSummary. Raises MinillmError
    for a bad type, pattern or input, OUT equal to IN, or requantizing without permission.
    prune_layers: layer numbers to leave out (the rest renumbered in order).
    imatrix: an importance matrix file (llama-imatrix's GGUF or .dat, or minillm imatrix's):
    each column's rounding error is weighted by its importance, as llama-quantize --imatrix.
    OUT appears only when complete: an interrupted or failed run leaves no file behind."""
    log = log or (lambda message: None)
    file_type = parse_file_type(type_name)
    imat = imatrix if isinstance(imatrix, Imatrix) or imatrix is None else load_imatrix(imatrix)
    opts = PlanOptions(pure=pure, leave_output_tensor=leave_output_tensor,
                       output_tensor_type=_tensor_type(output_tensor_type),
                       token_embedding_type=_tensor_type(token_embedding_type),
                       tensor_types=parse_tensor_type_overrides(tensor_types),
                       prune_layers=tuple(sorted(set(prune_layers))), has_imatrix=imat is not None)
    in_path = Path(in_path)
    out_path = Path(out_path) if out_path is not None else None
    if not dry_run:
        if out_path is None:
            raise MinillmError("no output path given")
        _check_paths(in_path, out_path)
    start = time.perf_counter()
    with GGUFFile(in_path) as gf:
        plan = make_plan(gf, file_type, opts)
        summary = QuantizeSummary(in_path, out_path, file_type, plan.tensors, dry_run,
                                  warnings=plan.warnings, n_fallback=plan.n_fallback)
        weights = _imatrix_weights(plan, imat, log) if imat is not None else {}
        if not dry_run:
            _check_requantize(plan, allow_requantize, log)
            metadata = _imatrix_metadata(imatrix, imat) if imat is not None else ()
            summary.file_bytes = _write(gf, plan, out_path, threads, progress, weights, metadata)
    summary.seconds = time.perf_counter() - start
    return summary


def _imatrix_weights(plan: Plan, imat: Imatrix, log: Callable[[str], None]) -> dict[str, np.ndarray]:
    """Output tensor name -> its column importances, for the tensors being converted (looked up
    by their name in the input, as llama-quantize does after --prune-layers)."""
    weights, missing = {}, []
    for t in plan.tensors:
        if not t.converts:
            continue
        w = imat.weights(t.source)
        if w is None:
            missing.append(t.name)
        elif w.size != t.shape[0]:
            if t.source != "token_embd.weight":
                raise MinillmError(f"the importance matrix has {w.size} values for {t.source}, "
                                   f"whose rows hold {t.shape[0]}: it was computed for another model")
            log(f"warning: ignoring the importance matrix's {w.size} values for {t.source} ({t.shape[0]} columns)")
        else:
            weights[t.name] = w
    if missing:
        log(f"{len(missing)} tensors have no importance matrix entry and are quantized without one "
            f"(e.g. {missing[0]})")
    return weights


def _imatrix_metadata(source, imat: Imatrix) -> tuple:
    """llama-quantize's quantize.imatrix.* keys (strings cut at 127 bytes, as it copies them)."""
    def c_string(text: str) -> str:
        return text.encode("utf-8", "surrogateescape")[:127].decode("utf-8", "surrogateescape")

    path = os.fspath(imat.path or "" if isinstance(source, Imatrix) else source)   # as given
    keys = [("quantize.imatrix.file", c_string(path))]
    if imat.datasets:
        keys.append(("quantize.imatrix.dataset", c_string(imat.datasets[0])))
    keys.append(("quantize.imatrix.entries_count", len(imat.entries)))
    if imat.chunk_count > 0:
        keys.append(("quantize.imatrix.chunks_count", imat.chunk_count))
    return tuple(keys)


def _write(gf: GGUFFile, plan: Plan, out_path: Path, threads: int | None, progress: bool,
           weights: dict[str, np.ndarray], metadata: tuple) -> int:
    """Convert and write every tensor (with their importance matrices); returns the file size."""
    from .convert import TensorConverter, set_threads   # numba: imported only when needed

    set_threads(threads)
    alignment = gf.alignment
    delay = float(os.environ.get(DELAY_ENV, "0") or 0)
    bar = _progress_bar(len(plan.tensors), progress)
    convert = TensorConverter(gf, plan.tensors, weights)
    try:
        with AtomicOutput(out_path) as out:
            out.write(build_header(gf, plan.tensors, plan.file_type.ftype, alignment, plan.n_layer_kept, metadata))
            for t in plan.tensors:
                bar.set_postfix_str(t.name, refresh=False)
                write_array(out, convert(t), alignment)
                bar.update(1)
                if delay:
                    time.sleep(delay)
            out.commit()
            return out.written
    finally:
        bar.close()


def _progress_bar(total: int, enabled: bool):
    import sys

    from tqdm import tqdm

    return tqdm(total=total, unit="tensor", file=sys.stderr, disable=not enabled,
                leave=False, dynamic_ncols=True, mininterval=0.2)

