"""Importance-matrix files, as llama.cpp b11434's llama-imatrix writes and llama-quantize reads them.

GGUF (general.type "imatrix"): keys imatrix.datasets (the text files), imatrix.chunk_count,
imatrix.chunk_size, imatrix.stats_schema; per weight tensor NAME, in name order:
    NAME.in_sum2  (ne0, n_mat) float32  sum over the input rows of x^2 per column
    NAME.counts   (1, n_mat)   float32  rows summed
    NAME.in_sum   (ne0, n_mat) float32  sum of x (the activations' mean, for statistics)
    NAME.stats    (12,)        float32  the statistics of imatrix.stats_schema (statistics())
The legacy `.dat` files (no in_sum, one count) are read too. A quantizer uses, per column,
in_sum2 / count (imatrix_weights).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import GGUFError, MinillmError

STATS_SCHEMA = ("sum_sq", "mean", "elements", "std_deviation", "skewness", "kurtosis", "gain", "h_norm",
                "l2_dist", "cossim", "pearson", "covariance")
ALIGNMENT = 32
_F32 = np.float32
_NAN = float("nan")
_TINY = float(np.float32(1e-10))        # C's 1e-10f compared with doubles
_libm = ctypes.CDLL(ctypes.util.find_library("m"))
_libm.log2f.restype, _libm.log2f.argtypes = ctypes.c_float, [ctypes.c_float]


@dataclass
class Entry:
    """One weight tensor's sums: sum2 and sum1 (n_mat * ne0,) float32, counts (n_mat,) int64.
    sum1 is None for a legacy file's entries."""
    sum2: np.ndarray
    counts: np.ndarray
    sum1: np.ndarray | None = None

    @classmethod
    def empty(cls, ne0: int, n_mat: int = 1) -> "Entry":
        return cls(np.zeros(ne0 * n_mat, _F32), np.zeros(n_mat, np.int64), np.zeros(ne0 * n_mat, _F32))


@dataclass
class Imatrix:
    entries: dict[str, Entry]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    legacy: bool = False
    path: Path | None = None

    def weights(self, name: str) -> np.ndarray | None:
        """The column importances llama-quantize hands the quantizer for tensor `name`: in_sum2
        divided by its count (1 where nothing was counted; a legacy file's sums divided by its
        count), or None when the file has no entry."""
        e = self.entries.get(name)
        if e is None:
            return None
        if self.legacy:
            return e.sum2 / _F32(e.counts[0]) if e.counts[0] > 0 else e.sum2.copy()
        ne0 = e.sum2.size // e.counts.size
        out = np.ones(e.sum2.size, _F32)
        for m, count in enumerate(e.counts):
            if count > 0:
                out[m * ne0:(m + 1) * ne0] = e.sum2[m * ne0:(m + 1) * ne0] / _F32(count)
        return out


# ---------------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------------
def load(path) -> Imatrix:
    """Read a GGUF or legacy importance matrix, checked; MinillmError naming what is wrong."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise MinillmError(f"cannot read {path}: {exc.strerror}") from None
    imatrix = _load_gguf(path) if magic == b"GGUF" else _load_legacy(path)
    imatrix.path = path
    if not imatrix.entries:
        raise MinillmError(f"{path}: the importance matrix holds no entries")
    for name, e in imatrix.entries.items():
        if not np.all(np.isfinite(e.sum2)):
            raise MinillmError(f"{path}: the importance matrix holds non-finite values for {name}")
    return imatrix


def _load_gguf(path: Path) -> Imatrix:
    from .gguf_file import GGUFFile

    try:
        gf = GGUFFile(path)
    except GGUFError as exc:
        raise MinillmError(f"{path}: not a valid importance matrix ({exc})") from None
    with gf:
        meta = gf.metadata
        keys = ("imatrix.datasets", "imatrix.chunk_count", "imatrix.chunk_size")
        if not all(k in meta for k in keys):
            raise MinillmError(f"{path}: missing imatrix metadata (is it an importance matrix? "
                               f"it needs {', '.join(keys)})")
        parts: dict[str, dict[str, np.ndarray]] = {}
        for name, info in gf.tensors.items():
            base, dot, suffix = name.rpartition(".")
            if suffix in ("in_sum2", "counts", "in_sum"):
                if info.format.name != "F32":
                    raise MinillmError(f"{path}: tensor {name} must be F32, not {info.format.name}")
                parts.setdefault(base, {})[suffix] = gf.raw(name).view(_F32).reshape(-1).copy()
        entries = {}
        for base, p in sorted(parts.items()):
            sum2, counts, sum1 = p.get("in_sum2"), p.get("counts"), p.get("in_sum")
            if sum2 is None or counts is None or (sum1 is not None and sum1.size != sum2.size) \
                    or sum2.size % counts.size:
                raise MinillmError(f"{path}: mismatched sums and counts for {base}")
            entries[base] = Entry(sum2, np.round(counts).astype(np.int64), sum1)
        datasets = meta["imatrix.datasets"]
        return Imatrix(entries, [str(d) for d in datasets] if not isinstance(datasets, str) else [datasets],
                       int(meta["imatrix.chunk_count"]), int(meta["imatrix.chunk_size"]))


def _load_legacy(path: Path) -> Imatrix:
    """The `.dat` format: int32 n_entries, then per entry (int32 length, name, int32 ncall,
    int32 nval, float32 sums[nval]); optionally int32 chunk count and a dataset name."""
    data = path.read_bytes()
    pos = 0

    def take(fmt: str, what: str):
        nonlocal pos
        size = struct.calcsize(fmt)
        if pos + size > len(data):
            raise MinillmError(f"{path}: not an importance matrix (GGUF or legacy): truncated reading {what}")
        value = struct.unpack_from(fmt, data, pos)
        pos += size
        return value if len(value) > 1 else value[0]

    n_entries = take("<i", "the entry count")
    if n_entries < 1 or n_entries > len(data) // 16:
        raise MinillmError(f"{path}: not an importance matrix (GGUF or legacy .dat)")
    entries = {}
    for i in range(n_entries):
        length = take("<i", f"entry {i + 1}'s name")
        if not 0 < length <= 4096:
            raise MinillmError(f"{path}: bad name length {length} for entry {i + 1}")
        name = take(f"<{length}s", f"entry {i + 1}'s name").decode("utf-8", "replace")
        ncall, nval = take("<ii", f"entry {i + 1}")
        if nval < 1:
            raise MinillmError(f"{path}: entry {name} has {nval} values")
        sums = np.array(take(f"<{nval}f", f"entry {name}'s values"), _F32)
        entries[name] = Entry(sums, np.array([ncall], np.int64))
    chunk_count, datasets = 0, []
    if pos + 4 <= len(data):
        chunk_count = take("<i", "the chunk count")
        if pos + 4 <= len(data):
            length = take("<i", "the dataset name")
            if 0 < length <= len(data) - pos:
                datasets.append(take(f"<{length}s", "the dataset name").decode("utf-8", "replace"))
    return Imatrix(entries, datasets, chunk_count, 0, legacy=True)


# ---------------------------------------------------------------------------------------------
# statistics (llama-imatrix's compute_vector_statistics and compute_tensor_statistics, in
# double precision in C's order, stored as float32)
# ---------------------------------------------------------------------------------------------
@dataclass
class _TensorStats:
    total: float = 0.0          # sum of the mean squares
    mean: float = 0.0           # of the mean activations
    elements: int = 0
    std_deviation: float = 0.0
    skewness: float = 0.0
    kurtosis: float = 0.0
    entropy: float = 0.0
    gain: float = _NAN
    l2_dist: float = _NAN
    cossim: float = _NAN
    pearson: float = _NAN
    covariance: float = _NAN
    legacy: bool = False


def _f32(v: float) -> float:
    return float(_F32(v))


def _vector_statistics(e: Entry) -> _TensorStats | None:
    legacy = e.sum1 is None
    n_mat = e.counts.size
    row = e.sum2.size // n_mat
    # the per-column means of x (or of x^2 for a legacy entry) and of x^2, as doubles
    inv = [1.0 / float(_F32(c)) for c in e.counts]
    v_val = [float(s) * inv[i // row] for i, s in enumerate(e.sum2.tolist())]
    v_act = v_val if legacy else [float(s) * inv[i // row] for i, s in enumerate(e.sum1.tolist())]
    keep = [i for i in range(e.sum2.size) if _F32(e.counts[i // row]) > 0
            and math.isfinite(v_act[i]) and math.isfinite(v_val[i])]
    if not keep:
        return None
    total, mean, energy, n = 0.0, 0.0, 0.0, 0
    for i in keep:
        total += v_val[i]
        n += 1
        mean += (v_act[i] - mean) / n
        if v_val[i] > 0.0:
            energy += v_val[i]
    sum_sq = sum_cu = sum_qd = entropy = 0.0
    inv_energy = 1.0 / energy if energy > 0.0 else 0.0
    log2_inv = 1.0 / math.log(2.0)
    for i in keep:
        diff = v_act[i] - mean
        sum_sq += diff * diff
        sum_cu += diff * diff * diff
        sum_qd += diff * diff * diff * diff
        if inv_energy > 0.0:
            p = max(0.0, v_val[i]) * inv_energy
            if p > 1e-10:
                entropy -= p * math.log(p) * log2_inv
    variance = sum_sq / n if n > 1 else 0.0
    st = _TensorStats(total, _f32(mean), n, _f32(math.sqrt(_f32(max(variance, 0.0)))), entropy=_f32(entropy),
                      legacy=legacy)
    if st.std_deviation > _TINY:
        m2 = sum_sq / n
        st.skewness = _f32(sum_cu / n / (m2 * math.sqrt(m2)))
        st.kurtosis = _f32(sum_qd / n / (m2 * m2) - 3.0)
    return st


def _averages(e: Entry, use_activations: bool) -> np.ndarray | None:
    """compute_tensor_averages: float32 per-column means (NaN where nothing was counted)."""
    src = e.sum1 if use_activations else e.sum2
    row = src.size // e.counts.size
    out = np.full(src.size, np.nan, _F32)
    valid = False
    for m, c in enumerate(e.counts):
        if _F32(c) > 0:
            out[m * row:(m + 1) * row] = src[m * row:(m + 1) * row] * (_F32(1.0) / _F32(c))
            valid = True
    return out if valid else None


_BLOCK = re.compile(r"blk\.(\d+)\.")


def _layer_change(cur: Entry, prev: Entry, st: _TensorStats, prev_st: _TensorStats):
    """The statistics against the same tensor of an earlier layer: L2 distance, cosine
    similarity, Pearson correlation and covariance of the mean activations, and the gain."""
    use_act = not st.legacy and not prev_st.legacy
    c_avg, p_avg = _averages(cur, use_act), _averages(prev, use_act)
    if c_avg is None or p_avg is None or c_avg.size != p_avg.size:
        return
    pairs = [(c, p) for c, p in zip(c_avg.tolist(), p_avg.tolist()) if math.isfinite(c) and math.isfinite(p)]
    if not pairs:
        return
    n = len(pairs)
    sum_c = sum_p = 0.0
    for c, p in pairs:
        sum_c += c
        sum_p += p
    mean_c, mean_p = sum_c / n, sum_p / n
    dot = n1 = n2 = l2 = cov = var_c = var_p = 0.0
    for c, p in pairs:
        dot += c * p
        n1 += c * c
        n2 += p * p
        d = c - p
        l2 += d * d
        dc, dp = c - mean_c, p - mean_p
        cov += dc * dp
        var_c += dc * dc
        var_p += dp * dp
    st.l2_dist = _f32(math.sqrt(l2))
    if n > 1:
        st.covariance = _f32(cov / n)
    if n1 > 0.0 and n2 > 0.0:
        st.cossim = min(max(_f32(dot / (math.sqrt(n1) * math.sqrt(n2))), -1.0), 1.0)
    else:
        st.cossim = _NAN if n1 == 0.0 and n2 == 0.0 else 0.0
    if var_c > 0.0 and var_p > 0.0:
        st.pearson = min(max(_f32(cov / (math.sqrt(var_c) * math.sqrt(var_p))), -1.0), 1.0)
    else:
        st.pearson = _NAN if var_c == 0.0 and var_p == 0.0 else 0.0
    if prev_st.total > _TINY:
        st.gain = _f32(math.sqrt(st.total / st.elements) / math.sqrt(prev_st.total / prev_st.elements))
    else:
        st.gain = 1.0 if st.total <= _TINY else _NAN


def statistics(entries: dict[str, Entry]) -> dict[str, np.ndarray]:
    """name -> the (12,) float32 .stats tensor (STATS_SCHEMA) llama-imatrix stores."""
    stats = {name: _vector_statistics(e) for name, e in entries.items()}
    stats = {name: st for name, st in stats.items() if st is not None}
    for name, st in stats.items():
        m = _BLOCK.search(name)
        if m is None or int(m.group(1)) <= 0:
            continue
        for prev in range(int(m.group(1)) - 1, -1, -1):
            prev_name = name[:m.start(1)] + str(prev) + name[m.end(1):]
            if prev_name in stats:
                _layer_change(entries[name], entries[prev_name], st, stats[prev_name])
                break
    out = {}
    for name in entries:
        st = stats.get(name)
        if st is None:
            out[name] = np.zeros(12, _F32)
            continue
        h_norm = (_F32(100.0) * (_F32(st.entropy) / _F32(_libm.log2f(float(st.elements)))) if st.elements > 1
                  else _NAN)
        out[name] = np.array([st.total, st.mean, st.elements, st.std_deviation, st.skewness, st.kurtosis, st.gain,
                              h_norm, st.l2_dist, st.cossim, st.pearson, st.covariance], _F32)
    return out


# ---------------------------------------------------------------------------------------------
# writing (gguf_write_to_file's layout)
# ---------------------------------------------------------------------------------------------
_UINT32, _STRING, _ARRAY, _F32_TYPE = 4, 8, 9, 0


def _string(s: str) -> bytes:
    raw = s.encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(raw)) + raw


def _strings(values) -> bytes:
    return struct.pack("<IQ", _STRING, len(values)) + b"".join(_string(v) for v in values)


def _pad(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def to_bytes(imatrix: Imatrix) -> bytes:
    """The GGUF file llama-imatrix writes for these entries."""
    kvs = [_string("general.type") + struct.pack("<I", _STRING) + _string("imatrix"),
           _string("imatrix.datasets") + struct.pack("<I", _ARRAY) + _strings(imatrix.datasets),
           _string("imatrix.chunk_count") + struct.pack("<II", _UINT32, imatrix.chunk_count),
           _string("imatrix.chunk_size") + struct.pack("<II", _UINT32, imatrix.chunk_size),
           _string("imatrix.stats_schema") + struct.pack("<I", _ARRAY) + _strings(STATS_SCHEMA)]
    stats = statistics(imatrix.entries)
    tensors = []                                        # (name, shape, float32 data)
    for name in sorted(imatrix.entries, key=lambda n: n.encode("utf-8", "surrogateescape")):
        e = imatrix.entries[name]
        n_mat = e.counts.size
        tensors += [(f"{name}.in_sum2", (e.sum2.size // n_mat, n_mat), e.sum2),
                    (f"{name}.counts", (1, n_mat), e.counts.astype(_F32))]
        if e.sum1 is not None:
            tensors.append((f"{name}.in_sum", (e.sum1.size // n_mat, n_mat), e.sum1))
        tensors.append((f"{name}.stats", (12,), stats[name]))
    infos, offset = [], 0
    for name, shape, data in tensors:
        dims = shape[:max(i + 1 for i, d in enumerate(shape) if d != 1 or i == 0)]   # ggml_n_dims
        infos.append(_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, _F32_TYPE, offset))
        offset += _pad(data.nbytes)
    header = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(infos)
    parts = [header, bytes(_pad(len(header)) - len(header))]
    for _, _, data in tensors:
        raw = np.ascontiguousarray(data, _F32).tobytes()
        parts += [raw, bytes(_pad(len(raw)) - len(raw))]
    return b"".join(parts)
