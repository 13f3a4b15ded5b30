"""llama-imatrix --show-statistics: per weight tensor, the statistics of its mean activations
(mean, spread, skewness, kurtosis), of its mean squares (their sum, ∑ E[A²], and the entropy of
their distribution, normalised: H Norm), and how it changed from the same tensor one block
earlier (gain in RMS, L2 distance, Pearson correlation, covariance); then the same per block,
over its tensors. The figures are llama.cpp b11434's, computed in the same order and precision,
and the table is printed as it prints it. A legacy `.dat` file has no activation sums: its
statistics are those of the mean squares, in a table without the L2 distance.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import MinillmError
from ..imatrix_file import _INT_MAX, Entry, TensorStats, _f32, nextn_start, split_name, stoi, tensor_statistics

_NAN = float("nan")


@dataclass
class TensorRow:
    name: str
    layer: str          # as the table shows it: the block, "-" for none, "mtp0".. for NextN blocks
    stats: TensorStats


@dataclass
class LayerRow:
    layer: str
    sum_sq: float       # ∑ E[A²] of its tensors, summed in float32 as llama-imatrix does
    gain: float = _NAN
    l2_dist: float = _NAN
    cossim: float = _NAN
    pearson: float = _NAN
    covariance: float = _NAN


@dataclass
class Report:
    tensors: list[TensorRow]
    layers: list[LayerRow] | None     # None where the blocks have a gap (no layer statistics)
    n_layers: int
    legacy: bool                      # some tensors have no activation sums: the legacy layout
    n_legacy: int
    gap: str | None = None            # why layers is None


def _layer_label(blk: int, first_nextn: int) -> str:
    if blk < 0 or blk == _INT_MAX:
        return "-"
    if blk >= first_nextn:
        return f"mtp{blk - first_nextn}"
    return str(blk)


def _block(name: str, tensor_layer: str, no_block: int) -> int:
    blk = stoi(tensor_layer)
    if blk is not None:
        return blk
    return _INT_MAX if "output" in name else no_block


@dataclass
class _LayerSums:
    dot_prod: float = 0.0
    norm1_sq: float = 0.0
    norm2_sq: float = 0.0
    l2_dist_sq: float = 0.0
    cov: float = 0.0
    var_c: float = 0.0
    var_p: float = 0.0
    energy_curr: float = 0.0
    energy_prev: float = 0.0
    elements_curr: int = 0
    elements_prev: int = 0
    n_features: int = 0
    n_tensors: int = 0


def _layer_statistics(rows: list[TensorRow]) -> dict[int, dict[str, float]]:
    """compute_layer_statistics: per block > 0, its tensors' sums against the block before."""
    sums: dict[int, _LayerSums] = {}
    for row in rows:
        st = row.stats
        blk = stoi(split_name(row.name)[0])
        if blk is None or blk <= 0:
            continue
        if st.norm1_sq == 0.0 and st.norm2_sq == 0.0 and st.l2_dist_sq == 0.0:
            continue
        a = sums.setdefault(blk, _LayerSums())
        a.dot_prod += st.dot_prod
        a.norm1_sq += st.norm1_sq
        a.norm2_sq += st.norm2_sq
        a.l2_dist_sq += st.l2_dist_sq
        a.cov += st.cov_sum
        a.var_c += st.var_c_sum
        a.var_p += st.var_p_sum
        a.n_tensors += 1
        if st.n_features > 0:
            a.n_features += st.n_features
        if st.elements_prev > 0:
            a.energy_curr += st.total
            a.energy_prev += st.total_prev
            a.elements_curr += st.elements
            a.elements_prev += st.elements_prev
    out = {}
    for blk, a in sorted(sums.items()):
        if a.n_tensors == 0:
            continue
        cossim = 0.0
        if a.norm1_sq > 0.0 and a.norm2_sq > 0.0:
            cossim = min(max(_f32(a.dot_prod / (math.sqrt(a.norm1_sq) * math.sqrt(a.norm2_sq))), -1.0), 1.0)
        elif a.norm1_sq == 0.0 and a.norm2_sq == 0.0:
            cossim = _NAN
        gain = _NAN
        if a.elements_curr > 0 and a.elements_prev > 0 and a.energy_prev > 0.0:
            gain = _f32(math.sqrt(a.energy_curr / a.elements_curr) / math.sqrt(a.energy_prev / a.elements_prev))
        if a.var_c > 0.0 and a.var_p > 0.0:
            pearson = min(max(_f32(a.cov / (math.sqrt(a.var_c) * math.sqrt(a.var_p))), -1.0), 1.0)
        else:
            pearson = _NAN if a.var_c == 0.0 and a.var_p == 0.0 else 0.0
        out[blk] = {"cossim": cossim, "l2_dist": _f32(math.sqrt(a.l2_dist_sq)), "gain": gain, "pearson": pearson,
                    "covariance": _f32(a.cov / a.n_features) if a.n_features > 0 else _NAN}
    return out


def report(entries: dict[str, Entry], n_layer_nextn: int = 0) -> Report:
    """The statistics llama-imatrix --show-statistics prints for these entries."""
    stats = tensor_statistics(entries, n_layer_nextn)
    if not stats:
        raise MinillmError("no tensor of the importance matrix has counted data: no statistics")
    n_legacy = sum(st.legacy for st in stats.values())
    first_nextn = nextn_start(stats, n_layer_nextn)

    def order(name):
        layer, tensor = split_name(name)
        return _block(name, layer, _INT_MAX - 1), tensor

    rows, per_block = [], {}            # block -> [sum of ∑ E[A²] in float32, elements]
    for name in sorted(stats, key=order):
        blk = _block(name, split_name(name)[0], -1)
        rows.append(TensorRow(name, _layer_label(blk, first_nextn), stats[name]))
        acc = per_block.setdefault(blk, [0.0, 0])
        acc[0] = _f32(acc[0] + stats[name].total)
        acc[1] += stats[name].elements
    changes = _layer_statistics(rows)
    blocks = sorted(per_block)
    n_layers = sum(1 for b in blocks if 0 <= b < 9999 and per_block[b][1] > 0)
    trunk = [b for b in blocks if 0 <= b < 9999 and per_block[b][1] > 0 and b < first_nextn]
    rep = Report(rows, None, n_layers, n_legacy > 0, n_legacy)
    if trunk and len(trunk) != max(trunk) - min(trunk) + 1:
        rep.gap = (f"the blocks have a gap ({len(trunk)} blocks in {min(trunk)}-{max(trunk)}, "
                   f"{max(trunk) - min(trunk) + 1} expected): no layer statistics")
        return rep
    rep.layers = []
    for blk in blocks:
        total, n = per_block[blk]
        if blk < 0 or n == 0:
            continue
        row = LayerRow(_layer_label(blk, first_nextn), total)
        if blk != 0 and blk != _INT_MAX and blk in changes:
            for key, value in changes[blk].items():
                setattr(row, key, value)
        rep.layers.append(row)
    return rep


# ---------------------------------------------------------------------------------------------
# llama-imatrix's table, byte for byte (printf's widths count bytes, and NaN prints as nan)
# ---------------------------------------------------------------------------------------------
def _num(value: float, width: int, precision: int) -> str:
    if math.isnan(value):
        text = "-nan" if math.copysign(1.0, value) < 0 else "nan"
    elif math.isinf(value):
        text = "-inf" if value < 0 else "inf"
    else:
        text = f"{value:.{precision}f}"
    return text.rjust(width)


def _right(text: str, width: int) -> str:
    return " " * max(0, width - len(text.encode())) + text


SEP = " | "
_SUM = "∑ E[A²]"


def _name(name: str, width: int = 40) -> str:
    return name if len(name) <= width else ".." + name[len(name) - (width - 2):]


def format_table(rep: Report, title: str) -> str:
    """The text llama-imatrix --show-statistics prints on stdout for file(s) `title`."""
    out = [f"\nComputing tensor statistics for {title} ({len(rep.tensors)} tensors)\n\n"]
    head = (f"{'Layer':>6}{SEP}{'Tensor':<40}{SEP}{'Mean':>10}{'StdDev':>10}{'Skew':>12}{'Kurt':>12}{'H Norm':>9}"
            f"{SEP}{_right(_SUM, 17)}{'Gain':>8}{SEP}")
    if rep.legacy:
        out.append(f"{head}{'PCC':>10}{'Cov':>10}\n{'-' * 153}\n")
    else:
        out.append(f"{head}{'L2 Dist':>12}{'PCC':>10}{'Cov':>10}\n{'-' * 165}\n")
    for row in rep.tensors:
        st = row.stats
        line = (f"{_right(row.layer, 6)}{SEP}{_name(row.name):<40}{SEP}{_num(st.mean, 10, 4)}"
                f"{_num(st.std_deviation, 10, 4)}{_num(st.skewness, 12, 4)}{_num(st.kurtosis, 12, 4)}"
                f"{_num(st.h_norm, 8, 2)}%{SEP}{_num(st.total, 14, 4)}{_num(st.gain, 8, 2)}{SEP}")
        if not rep.legacy:
            line += _num(st.l2_dist, 12, 4)
        out.append(f"{line}{_num(st.pearson, 10, 4)}{_num(st.covariance, 10, 4)}\n")
    if rep.layers is None:
        return "".join(out)
    out.append(f"\nComputing layer statistics for {title} ({rep.n_layers} layers)\n\n")
    head = f"{'Layer':>6}{SEP}{_right(_SUM, 17)}{'Gain':>8}{SEP}"
    if rep.legacy:
        out.append(f"{head}{'CosSim':>9}{'PCC':>9}{'Cov':>12}\n{'-' * 64}\n")
    else:
        out.append(f"{head}{'L2 Dist':>12}{'CosSim':>9}{'PCC':>9}{'Cov':>12}\n{'-' * 76}\n")
    for row in rep.layers:
        line = f"{_right(row.layer, 6)}{SEP}{_num(row.sum_sq, 14, 4)}{_num(row.gain, 8, 2)}{SEP}"
        if not rep.legacy:
            line += _num(row.l2_dist, 12, 4)
        out.append(f"{line}{_num(row.cossim, 9, 4)}{_num(row.pearson, 9, 4)}{_num(row.covariance, 12, 4)}\n")
    out.append("\n")
    return "".join(out)


def _json_number(value: float):
    return None if math.isnan(value) or math.isinf(value) else value


def figures(rep: Report) -> dict:
    """The report as plain data (NaN as None)."""
    tensors = [{"layer": r.layer, "tensor": r.name, "elements": r.stats.elements,
                **{key: _json_number(float(getattr(r.stats, attr))) for key, attr in (
                    ("mean", "mean"), ("std_deviation", "std_deviation"), ("skewness", "skewness"),
                    ("kurtosis", "kurtosis"), ("h_norm", "h_norm"), ("sum_sq", "total"), ("gain", "gain"),
                    ("l2_dist", "l2_dist"), ("cossim", "cossim"), ("pearson", "pearson"),
                    ("covariance", "covariance"))}} for r in rep.tensors]
    layers = None if rep.layers is None else [
        {"layer": r.layer, **{key: _json_number(getattr(r, key)) for key in (
            "sum_sq", "gain", "l2_dist", "cossim", "pearson", "covariance")}} for r in rep.layers]
    return {"legacy": rep.legacy, "tensors": tensors, "layers": layers, "gap": rep.gap}
