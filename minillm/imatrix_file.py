"""Importance-matrix files, as llama.cpp b11434's llama-imatrix writes and llama-quantize reads them.

GGUF (general.type "imatrix"): keys imatrix.datasets (the text files), imatrix.chunk_count,
imatrix.chunk_size, imatrix.stats_schema; per weight tensor NAME, in name order:
    NAME.in_sum2  (ne0, n_mat) float32  sum over the input rows of x^2 per column
    NAME.counts   (1, n_mat)   float32  rows summed
    NAME.in_sum   (ne0, n_mat) float32  sum of x (the activations' mean, for statistics)
    NAME.stats    (12,)        float32  the statistics of imatrix.stats_schema (statistics())
(and imatrix.n_layer_nextn where the model has NextN layers). The legacy `.dat` format (no
in_sum, one count: sums / count * chunks) is read and written too (to_dat_bytes). A quantizer
uses, per column, in_sum2 / count (Imatrix.weights). Collector combines files and new sums by
llama-imatrix's rules (load_imatrix).
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
    n_layer_nextn: int = 0      # how many of the top blocks are NextN (MTP) layers

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
            if not np.all(np.isfinite(counts)) or np.any(np.abs(counts) >= 2.0**62):
                raise MinillmError(f"{path}: non-finite or impossible counts for {base}")
            # lround: halves away from zero
            entries[base] = Entry(sum2, (np.sign(counts) * np.floor(np.abs(counts) + 0.5)).astype(np.int64), sum1)
        datasets = meta["imatrix.datasets"]
        try:
            return Imatrix(entries, [str(d) for d in datasets] if not isinstance(datasets, str) else [datasets],
                           int(meta["imatrix.chunk_count"]), int(meta["imatrix.chunk_size"]),
                           n_layer_nextn=int(meta.get("imatrix.n_layer_nextn", 0)))
        except (TypeError, ValueError):
            raise MinillmError(f"{path}: malformed imatrix metadata (chunk_count, chunk_size)") from None


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
# combining (llama-imatrix's collector: load_imatrix, and where the new sums go)
# ---------------------------------------------------------------------------------------------
def rows_to_chunks(rows: int, chunk_size: int) -> int:
    """Rows as chunks, rounded to the nearest (llama-imatrix's chunk counts)."""
    return (rows + chunk_size // 2) // chunk_size


class Collector:
    """The sums as llama-imatrix holds them while it runs: earlier files added by add(), then
    the new sums (imatrix.ActivationRecorder, through entry_for and counted); imatrix() is the
    file to write at any point.

    n_ctx is this run's tokens per chunk (-c): it turns a legacy file's chunk count back into
    rows and counts the chunks of the new sums. The chunk size recorded is the first loaded GGUF
    file's, else n_ctx; the chunk count, last_chunk, is the largest count of rows in chunks
    (when new sums raise it, on_chunks(last_chunk, step) is called: llama-imatrix's moment to
    write the file). warn(message) hears of mismatched chunk sizes."""

    def __init__(self, n_ctx: int, warn=None):
        self.n_ctx = n_ctx
        self.warn = warn or (lambda message: None)
        self.entries: dict[str, Entry] = {}
        self.datasets: list[str] = []
        self.loaded_chunk_size = 0
        self.n_layer_nextn = 0
        self.last_chunk = 0
        self.on_chunks = None

    @property
    def chunk_size(self) -> int:
        return self.loaded_chunk_size or self.n_ctx

    def add(self, imatrix: Imatrix) -> None:
        """Add a loaded file: GGUF sums and counts add up (the activation sums only while every
        file so far has them); a legacy file's averages count as chunk_size rows per chunk and
        its entries lose their activation sums. Entries of different sizes are refused."""
        where = str(imatrix.path) if imatrix.path is not None else "the importance matrix"
        if imatrix.n_layer_nextn > 0:
            if self.n_layer_nextn == 0:
                self.n_layer_nextn = imatrix.n_layer_nextn
            elif self.n_layer_nextn != imatrix.n_layer_nextn:
                self.warn(f"{where} has {imatrix.n_layer_nextn} NextN layers, the files before "
                          f"{self.n_layer_nextn}: keeping {self.n_layer_nextn}")
        if not imatrix.legacy and imatrix.chunk_size > 0:
            if self.loaded_chunk_size == 0:
                self.loaded_chunk_size = imatrix.chunk_size
            elif self.loaded_chunk_size != imatrix.chunk_size:
                self.warn(f"{where} has chunks of {imatrix.chunk_size} tokens, the files before "
                          f"{self.loaded_chunk_size}: recording {self.loaded_chunk_size}")
        chunk_size = self.chunk_size
        for name in sorted(imatrix.entries):
            new, e = imatrix.entries[name], self.entries.get(name)
            nval = new.sum2.size
            if e is not None and e.sum2.size != nval:
                raise MinillmError(f"{where}: {name} holds {nval} values, the files before {e.sum2.size} "
                                   f"(another model's importance matrix?)")
            if imatrix.legacy:
                if e is None:
                    e = self.entries[name] = Entry(np.zeros(nval, _F32), np.zeros(1, np.int64), None)
                e.sum2 += new.sum2 * _F32(chunk_size)
                e.counts += int(new.counts[0]) * chunk_size
                e.sum1 = None
                continue
            first = e is None
            if first:
                e = self.entries[name] = Entry(np.zeros(nval, _F32), np.zeros(new.counts.size, np.int64), None)
            elif e.counts.size == 1 and new.counts.size > 1:
                e.counts = np.full(new.counts.size, e.counts[0], np.int64)
            elif e.counts.size != new.counts.size:
                raise MinillmError(f"{where}: {name} holds {new.counts.size} counts (matrices), the files "
                                   f"before {e.counts.size}")
            e.sum2 += new.sum2
            e.counts += new.counts
            if new.sum1 is not None and (first or e.sum1 is not None):
                if e.sum1 is None:
                    e.sum1 = np.zeros(nval, _F32)
                e.sum1 += new.sum1
            else:
                e.sum1 = None
        self.datasets += imatrix.datasets
        self.last_chunk = rows_to_chunks(max([0, *(int(c) for e in self.entries.values() for c in e.counts)]),
                                         chunk_size)

    def entry_for(self, name: str, ne0: int) -> Entry:
        """The entry that new sums of a weight with ne0 input columns go to."""
        e = self.entries.get(name)
        if e is None:
            e = self.entries[name] = Entry.empty(ne0)
            return e
        if e.counts.size > 1 and np.all(e.counts == e.counts[0]):
            e.counts = e.counts[:1].copy()           # one count per dense tensor
        if e.sum2.size != ne0:
            raise MinillmError(f"{name} takes inputs of {ne0} columns, but the importance matrix loaded holds "
                               f"{e.sum2.size} values for it (another model's?)")
        return e

    def counted(self, rows: int) -> None:
        """An entry's count of rows is now `rows`: the chunk count follows."""
        n_chunk = rows_to_chunks(rows, self.n_ctx)
        if n_chunk > self.last_chunk:
            step, self.last_chunk = n_chunk - self.last_chunk, n_chunk
            if self.on_chunks is not None:
                self.on_chunks(n_chunk, step)

    def imatrix(self, dataset: str | None = None) -> Imatrix:
        """The file as it stands (sharing the sums), with this run's text, if any, last."""
        return Imatrix(self.entries, self.datasets + ([dataset] if dataset else []), self.last_chunk,
                       self.chunk_size, n_layer_nextn=self.n_layer_nextn)


# ---------------------------------------------------------------------------------------------
# statistics (llama-imatrix's compute_vector_statistics and compute_tensor_statistics, in
# double precision in C's order, stored as float32)
# ---------------------------------------------------------------------------------------------
@dataclass
class TensorStats:
    total: float = 0.0          # sum of the mean squares (double)
    mean: float = 0.0           # of the mean activations (a legacy entry: of the mean squares)
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
    # the sums against the preceding layer's tensor, for the layer statistics
    dot_prod: float = 0.0
    norm1_sq: float = 0.0
    norm2_sq: float = 0.0
    l2_dist_sq: float = 0.0
    cov_sum: float = 0.0
    var_c_sum: float = 0.0
    var_p_sum: float = 0.0
    n_features: int = 0
    total_prev: float = 0.0
    elements_prev: int = 0

    @property
    def h_norm(self) -> float:
        """The entropy of the mean squares as a percentage of the largest possible."""
        if self.elements <= 1:
            return _NAN
        return float(_F32(100.0) * (_F32(self.entropy) / _F32(_libm.log2f(float(self.elements)))))


def _f32(v: float) -> float:
    return float(_F32(v))


_STOI = re.compile(r"[ \t\n\v\f\r]*([+-]?[0-9]+)")


def stoi(text: str) -> int | None:
    """C++'s std::stoi: the leading integer, or None where it throws."""
    m = _STOI.match(text)
    if m is None or not -2**31 <= int(m.group(1)) < 2**31:
        return None
    return int(m.group(1))


def split_name(name: str) -> tuple[str, str]:
    """llama-imatrix's process_tensor_name: (the block, "-" if none; the name as its tables
    sort it)."""
    parts = name.split(".")
    if name.endswith(".") or name == "":
        parts = parts[:-1]                       # getline yields no empty last field
    layer = next((parts[i + 1] for i in range(len(parts) - 1) if parts[i] == "blk"), "")
    tensor = ""
    if "weight" in parts[1:]:
        i = parts.index("weight", 1)
        j = 0
        while j < len(parts):
            if parts[j] == "blk":
                j += 2 if len(parts) > 4 else 3
                continue
            if j == i:
                break
            tensor += ("." if tensor else "") + parts[j]
            j += 1
    return layer or "-", tensor or name


def nextn_start(stats: dict[str, TensorStats], n_layer_nextn: int) -> int:
    """The first NextN block (INT_MAX when none)."""
    max_blk, first = -1, _INT_MAX
    for name in stats:
        layer, tensor = split_name(name)
        blk = stoi(layer)
        if blk is None:
            continue
        max_blk = max(max_blk, blk)
        if tensor.startswith("nextn."):
            first = min(first, blk)
    if n_layer_nextn > 0 and max_blk >= 0:
        return max(0, max_blk + 1 - n_layer_nextn)
    return first


_INT_MAX = 2**31 - 1


def _vector_statistics(e: Entry) -> TensorStats | None:
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
    st = TensorStats(total, _f32(mean), n, _f32(math.sqrt(_f32(max(variance, 0.0)))), entropy=_f32(entropy),
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


def _layer_change(cur: Entry, prev: Entry, st: TensorStats, prev_st: TensorStats):
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
    st.n_features, st.dot_prod, st.norm1_sq, st.norm2_sq = n, dot, n1, n2
    st.cov_sum, st.var_c_sum, st.var_p_sum, st.l2_dist_sq = cov, var_c, var_p, l2
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
        st.total_prev, st.elements_prev = prev_st.total, prev_st.elements
    else:
        st.gain = 1.0 if st.total <= _TINY else _NAN


def tensor_statistics(entries: dict[str, Entry], n_layer_nextn: int = 0) -> dict[str, TensorStats]:
    """Each entry's statistics (none for an entry with nothing counted), those against the same
    tensor of the nearest earlier block included."""
    stats = {name: _vector_statistics(e) for name, e in entries.items()}
    stats = {name: st for name, st in stats.items() if st is not None}
    first_nextn = nextn_start(stats, n_layer_nextn) if stats else _INT_MAX
    for name, st in stats.items():
        layer, _ = split_name(name)
        blk = stoi(layer)
        if blk is None or blk <= 0 or blk == first_nextn:
            continue
        at = name.find("blk." + layer)
        if at < 0:
            continue
        for prev in range(blk - 1, (first_nextn if blk > first_nextn else 0) - 1, -1):
            prev_name = name[:at] + f"blk.{prev}" + name[at + len(layer) + 4:]
            if prev_name in stats:
                _layer_change(entries[name], entries[prev_name], st, stats[prev_name])
                break
    return stats


def statistics(entries: dict[str, Entry], n_layer_nextn: int = 0) -> dict[str, np.ndarray]:
    """name -> the (12,) float32 .stats tensor (STATS_SCHEMA) llama-imatrix stores."""
    stats = tensor_statistics(entries, n_layer_nextn)
    out = {}
    for name in entries:
        st = stats.get(name)
        if st is None:
            out[name] = np.zeros(12, _F32)
            continue
        out[name] = np.array([st.total, st.mean, st.elements, st.std_deviation, st.skewness, st.kurtosis, st.gain,
                              st.h_norm, st.l2_dist, st.cossim, st.pearson, st.covariance], _F32)
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
           _string("imatrix.chunk_size") + struct.pack("<II", _UINT32, imatrix.chunk_size)]
    if imatrix.n_layer_nextn > 0:
        kvs.append(_string("imatrix.n_layer_nextn") + struct.pack("<II", _UINT32, imatrix.n_layer_nextn))
    kvs.append(_string("imatrix.stats_schema") + struct.pack("<I", _ARRAY) + _strings(STATS_SCHEMA))
    stats = statistics(imatrix.entries, imatrix.n_layer_nextn)
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


def to_dat_bytes(imatrix: Imatrix) -> tuple[bytes, list[str]]:
    """The legacy `.dat` file llama-imatrix --output-format dat writes for these entries, and
    the entries it leaves out (nothing counted). Per entry, in name order: the calls, the count
    in chunks rounded up; the values, sum / count * calls (1 * calls where a matrix counted
    nothing). Then the chunk count and the last dataset."""
    chunk_size = imatrix.chunk_size
    keep = sorted((n for n, e in imatrix.entries.items() if np.any(e.counts != 0)),
                  key=lambda n: n.encode("utf-8", "surrogateescape"))
    parts = [struct.pack("<i", len(keep))]
    for name in keep:
        e = imatrix.entries[name]
        raw = name.encode("utf-8", "surrogateescape")
        ncall = (int(e.counts.max()) + chunk_size - 1) // chunk_size
        counts = np.repeat(e.counts.astype(_F32), e.sum2.size // e.counts.size)
        values = e.sum2.copy()
        values[counts == 0] = 1.0
        counts[counts == 0] = 1.0
        parts += [struct.pack("<i", len(raw)), raw, struct.pack("<ii", ncall, e.sum2.size),
                  ((values / counts) * _F32(ncall)).astype("<f4").tobytes()]
    dataset = imatrix.datasets[-1].encode("utf-8", "surrogateescape") if imatrix.datasets else b""
    parts += [struct.pack("<ii", imatrix.chunk_count, len(dataset)), dataset]
    return b"".join(parts), sorted(set(imatrix.entries) - set(keep))
