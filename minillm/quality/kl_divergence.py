"""KL divergence between two models over a text, with llama-perplexity's protocol and files.

`--kl-divergence-base FILE` run on the reference model saves, for every scored position of the
perplexity run (llama.cpp's chunks, positions n_ctx/2 .. n_ctx-2), the log-probabilities of
the whole vocabulary, each row quantized to 16 bits:

    "_logits_" | n_ctx u32 | n_vocab i32 | n_chunk i32 | tokens i32[n_chunk * n_ctx]
    then per chunk, per scored position: scale f32 | min_log_prob f32 | u16[n_vocab] (padded
    to an even count), log p_i = scale * u16_i + min_log_prob, cells below max - 16 stored as 0

`--kl-divergence` run on another model re-evaluates the same tokens and compares: KL(base || Q)
per position, top-1 agreement, the change in the probability of the true next token, and the
perplexity ratio. The file is llama.cpp's byte for byte (the arithmetic below is its float32
arithmetic, sums in float64), so a file from either tool works in the other.
"""
from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import MinillmError

MAGIC = b"_logits_"
HEADER = struct.Struct("<Iii")          # n_ctx, n_vocab, n_chunk
LOG_PROB_FLOOR = 16.0                   # cells more than this below the top are stored as 0


def row_width(n_vocab: int) -> int:
    """u16 cells per stored row: two f32 (scale, min) then the vocabulary, padded to even."""
    return 2 * ((n_vocab + 1) // 2) + 4


def _log_sum_exp(logits: np.ndarray, top: np.ndarray) -> np.ndarray:
    """(rows,) float32 log(sum(expf(x - top))) with the sum in float64, as llama.cpp."""
    e = np.exp((logits - top[:, None]).astype(np.float64)).astype(np.float32)
    return np.log(e.astype(np.float64).sum(axis=1)).astype(np.float32)


def encode_log_probs(logits: np.ndarray) -> np.ndarray:
    """(rows, n_vocab) float32 logits -> (rows, row_width) uint16, llama.cpp's log_softmax
    that writes the base file (nearest_int is round-half-even in float32, as np.rint)."""
    rows, n_vocab = logits.shape
    x = np.ascontiguousarray(logits, dtype=np.float32)
    top = x.max(axis=1)
    low = np.maximum(x.min(axis=1), top - np.float32(LOG_PROB_FLOOR))
    lse = _log_sum_exp(x, top)
    min_log_prob = (low - top) - lse
    scale = (top - low) / np.float32(65535.0)
    out = np.zeros((rows, row_width(n_vocab)), np.uint16)
    head = out[:, :4].view(np.float32)
    head[:, 0], head[:, 1] = scale, min_log_prob
    for r in range(rows):
        if scale[r]:
            inv = np.float32(1.0) / scale[r]
            q = np.rint(inv * (x[r] - low[r]))
            out[r, 4:4 + n_vocab] = np.where(x[r] > low[r], q, 0).astype(np.uint16)
    return out


@dataclass
class BaseFile:
    """A base log-probability file: its header and tokens; rows are read chunk by chunk."""
    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray                  # (n_chunk * n_ctx,) int32
    data_offset: int

    @property
    def rows_per_chunk(self) -> int:
        return self.n_ctx - 1 - self.n_ctx // 2

    @classmethod
    def open(cls, path) -> "BaseFile":
        path = Path(path)
        try:
            with open(path, "rb") as f:
                head = f.read(len(MAGIC) + HEADER.size)
                if len(head) < len(MAGIC) + HEADER.size or head[:len(MAGIC)] != MAGIC:
                    raise MinillmError(f"{path} does not look like a file of base log-probabilities "
                                       "(write one by scoring a text with kld_base FILE)", ("kld_base",))
                n_ctx, n_vocab, n_chunk = HEADER.unpack(head[len(MAGIC):])
                if not (16 <= n_ctx <= 1 << 20 and 0 < n_vocab < 1 << 24 and 0 < n_chunk < 1 << 20):
                    raise MinillmError(f"{path}: implausible header (n_ctx {n_ctx}, n_vocab {n_vocab}, "
                                       f"n_chunk {n_chunk})")
                tokens = np.fromfile(f, np.int32, n_chunk * n_ctx)
            size = path.stat().st_size
        except OSError as exc:
            raise MinillmError(f"cannot read {path}: {exc.strerror or exc}") from None
        base = cls(path, n_ctx, n_vocab, n_chunk, tokens, len(MAGIC) + HEADER.size + 4 * n_chunk * n_ctx)
        expected = base.data_offset + 2 * n_chunk * base.rows_per_chunk * row_width(n_vocab)
        if len(tokens) != n_chunk * n_ctx or size != expected:
            raise MinillmError(f"{path} is truncated or damaged: {size} bytes, the header announces {expected}")
        if tokens.min() < 0 or tokens.max() >= n_vocab:
            raise MinillmError(f"{path}: token ids outside the vocabulary of {n_vocab}")
        return base

    def chunk_rows(self, chunk: int) -> np.ndarray:
        """(rows_per_chunk, row_width) uint16 of one chunk."""
        count = self.rows_per_chunk * row_width(self.n_vocab)
        offset = self.data_offset + 2 * chunk * count
        return np.fromfile(self.path, np.uint16, count, offset=offset).reshape(self.rows_per_chunk, -1)


class BaseWriter:
    """Writes a base file: `with BaseWriter(path, n_ctx, n_vocab, tokens) as w: w.add(logits)`
    per chunk. The file appears only when complete (a temporary name, renamed at the end)."""

    def __init__(self, path, n_ctx: int, n_vocab: int, tokens: np.ndarray):
        self.path = Path(path)
        self.tmp = self.path.with_name(f".{self.path.name}.partial-{os.getpid()}")
        n_chunk = len(tokens) // n_ctx
        try:
            self.file = open(self.tmp, "wb")
        except OSError as exc:
            raise MinillmError(f"cannot write {path}: {exc.strerror or exc}") from None
        self.file.write(MAGIC + HEADER.pack(n_ctx, n_vocab, n_chunk))
        self.file.write(np.asarray(tokens[:n_chunk * n_ctx], dtype="<i4").tobytes())

    def add(self, logits: np.ndarray) -> None:
        self.file.write(encode_log_probs(logits).tobytes())

    def __enter__(self) -> "BaseWriter":
        return self

    def __exit__(self, kind, value, tb) -> None:
        self.file.close()
        if kind is None:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)


@dataclass
class KLDSums:
    """llama.cpp's kl_divergence_result: running sums over every scored position."""
    sum_nll: float = 0.0
    sum_nll2: float = 0.0
    sum_nll_base: float = 0.0
    sum_nll_base2: float = 0.0
    sum_nll_nll_base: float = 0.0
    sum_kld: float = 0.0
    sum_kld2: float = 0.0
    sum_p_diff: float = 0.0
    sum_p_diff2: float = 0.0
    sum_p_diff4: float = 0.0
    max_p_diff: float = 0.0
    n_same_top: int = 0
    count: int = 0
    kld_values: list = field(default_factory=list)      # float32 arrays, one per chunk
    p_diff_values: list = field(default_factory=list)

    def add(self, logits: np.ndarray, base_rows: np.ndarray, targets: np.ndarray) -> None:
        """One chunk: logits (rows, n_vocab) float32 of the model under test, the base file's
        rows for the same positions, and the tokens they predict."""
        f32, n_vocab = np.float32, logits.shape[1]
        x = np.ascontiguousarray(logits, dtype=f32)
        rows = np.arange(len(x))
        top = x.max(axis=1)
        lse = _log_sum_exp(x, top)
        head = np.ascontiguousarray(base_rows[:, :4]).view(f32)
        scale, min_log_prob = head[:, 0], head[:, 1]
        cells = base_rows[:, 4:4 + n_vocab].astype(f32)
        nll = (top + lse) - x[rows, targets]
        nll_base = -(scale * cells[rows, targets] + min_log_prob)
        klds = np.empty(len(x), np.float64)
        norm = top + lse
        for r in range(len(x)):
            p_log_base = scale[r] * cells[r] + min_log_prob[r]
            keep = p_log_base > f32(-LOG_PROB_FLOOR)
            kept = p_log_base[keep]
            terms = _expf(kept) * ((kept - x[r, keep]) + norm[r])
            klds[r] = terms.astype(np.float64).sum()
        same_top = x.argmax(axis=1) == (scale[:, None] * cells + min_log_prob[:, None]).argmax(axis=1)
        p_diff = _expf(-nll) - _expf(-nll_base)
        p_diff2 = (p_diff * p_diff).astype(np.float64)
        d = np.float64
        self.sum_nll += nll.astype(d).sum()
        self.sum_nll2 += (nll * nll).astype(d).sum()
        self.sum_nll_base += nll_base.astype(d).sum()
        self.sum_nll_base2 += (nll_base * nll_base).astype(d).sum()
        self.sum_nll_nll_base += (nll * nll_base).astype(d).sum()
        self.sum_kld += klds.sum()
        self.sum_kld2 += (klds * klds).sum()
        self.sum_p_diff += p_diff.astype(d).sum()
        self.sum_p_diff2 += p_diff2.sum()
        self.sum_p_diff4 += (p_diff2 * p_diff2).sum()
        self.max_p_diff = max(self.max_p_diff, float(np.abs(p_diff).max()))
        self.n_same_top += int(same_top.sum())
        self.count += len(x)
        self.kld_values.append(klds.astype(f32))
        self.p_diff_values.append(p_diff)


def _expf(x: np.ndarray) -> np.ndarray:
    return np.exp(x.astype(np.float64)).astype(np.float32)


def mean_and_uncertainty(total: float, total2: float, count: int) -> tuple[float, float]:
    if count < 1:
        return 0.0, 0.0
    mean = total / count
    var = total2 / count - mean * mean
    return mean, (math.sqrt(var / (count - 1)) if var > 0 and count > 10 else 0.0)


def covariance(total_a: float, total_b: float, total_ab: float, count: int) -> float:
    if count < 10:
        return 0.0
    return (total_ab / count - (total_a / count) * (total_b / count)) / (count - 1)


def percentile(values: np.ndarray, fraction: float) -> float:
    """llama.cpp's interpolated percentile of sorted float32 values, in float32."""
    if fraction <= 0:
        return float(values[0])
    if fraction >= 1:
        return float(values[-1])
    f32 = np.float32
    p = f32(fraction) * f32(len(values) - 1)
    ip = int(p)
    p = p - f32(ip)
    return float((f32(1) - p) * values[ip] + p * values[min(ip + 1, len(values) - 1)])


def median(values: np.ndarray) -> float:
    n = len(values)
    return float(np.float32(0.5) * (values[n // 2] + values[n // 2 - 1]) if n % 2 == 0 else values[n // 2])


# (label as llama-perplexity prints it, fraction; None = median)
KLD_PERCENTILES = (("Maximum", 1.0), ("99.9%  ", 0.999), ("99.0%  ", 0.990), ("95.0%  ", 0.950),
                   ("90.0%  ", 0.900), ("Median ", None), ("10.0%  ", 0.100), (" 5.0%  ", 0.050),
                   (" 1.0%  ", 0.010), (" 0.1%  ", 0.001), ("Minimum", 0.0))
P_DIFF_PERCENTILES = (("Maximum", 1.0), ("99.9%  ", 0.999), ("99.0%  ", 0.990), ("95.0%  ", 0.950),
                      ("90.0%  ", 0.900), ("75.0%  ", 0.750), ("Median ", None), ("25.0%  ", 0.250),
                      ("10.0%  ", 0.100), (" 5.0%  ", 0.050), (" 1.0%  ", 0.010), (" 0.1%  ", 0.001),
                      ("Minimum", 0.0))


@dataclass
class KLDResult:
    """The statistics llama-perplexity prints after --kl-divergence."""
    sums: KLDSums
    n_chunks: int

    def _sorted(self, which: str) -> np.ndarray:
        return np.sort(np.concatenate(getattr(self.sums, which)))

    def figures(self) -> dict:
        s = self.sums
        log_ppl = mean_and_uncertainty(s.sum_nll, s.sum_nll2, s.count)
        log_base = mean_and_uncertainty(s.sum_nll_base, s.sum_nll_base2, s.count)
        cov = covariance(s.sum_nll, s.sum_nll_base, s.sum_nll_nll_base, s.count)
        ppl, ppl_base = math.exp(log_ppl[0]), math.exp(log_base[0])
        ppl_unc, base_unc = ppl * log_ppl[1], ppl_base * log_base[1]
        ratio = log_ppl[0] - log_base[0]
        ratio_unc = math.sqrt(max(log_ppl[1] ** 2 + log_base[1] ** 2 - 2 * cov, 0.0))
        kld = mean_and_uncertainty(s.sum_kld, s.sum_kld2, s.count)
        p_diff = mean_and_uncertainty(s.sum_p_diff, s.sum_p_diff2, s.count)
        mse = mean_and_uncertainty(s.sum_p_diff2, s.sum_p_diff4, s.count)
        rms = math.sqrt(mse[0])
        same = s.n_same_top / s.count
        klds, p_diffs = self._sorted("kld_values"), self._sorted("p_diff_values")

        def quantiles(values, table):
            return {label.strip(): (median(values) if frac is None else percentile(values, frac))
                    for label, frac in table}
        return {
            "n_chunks": self.n_chunks, "n_scored": s.count,
            "ppl": ppl, "ppl_unc": ppl_unc, "ppl_base": ppl_base, "ppl_base_unc": base_unc,
            "cor_ln_ppl": cov / (log_ppl[1] * log_base[1]) if log_ppl[1] * log_base[1] else 0.0,
            "ln_ppl_ratio": ratio, "ln_ppl_ratio_unc": ratio_unc,
            "ppl_ratio": math.exp(ratio), "ppl_ratio_unc": math.exp(ratio) * ratio_unc,
            "ppl_diff": ppl - ppl_base,
            "ppl_diff_unc": math.sqrt(max(ppl_unc ** 2 + base_unc ** 2 - 2 * ppl * ppl_base * cov, 0.0)),
            "kld": kld[0], "kld_unc": kld[1], "kld_quantiles": quantiles(klds, KLD_PERCENTILES),
            "p_diff": p_diff[0], "p_diff_unc": p_diff[1], "p_diff_quantiles": quantiles(p_diffs, P_DIFF_PERCENTILES),
            "p_diff_rms": rms, "p_diff_rms_unc": 0.5 / rms * mse[1] if rms else 0.0,
            "same_top": same,
            "same_top_unc": math.sqrt(same * (1 - same) / (s.count - 1)) if s.count > 1 else 0.0,
        }

    def report_lines(self) -> list[str]:
        """llama-perplexity's closing statistics, line for line in its format."""
        f = self.figures()
        lines = [
            "====== Perplexity statistics ======",
            f"Mean PPL(Q)                   : {f['ppl']:10.6f} ± {f['ppl_unc']:10.6f}",
            f"Mean PPL(base)                : {f['ppl_base']:10.6f} ± {f['ppl_base_unc']:10.6f}",
            f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * f['cor_ln_ppl']:6.2f}%",
            f"Mean ln(PPL(Q)/PPL(base))     : {f['ln_ppl_ratio']:10.6f} ± {f['ln_ppl_ratio_unc']:10.6f}",
            f"Mean PPL(Q)/PPL(base)         : {f['ppl_ratio']:10.6f} ± {f['ppl_ratio_unc']:10.6f}",
            f"Mean PPL(Q)-PPL(base)         : {f['ppl_diff']:10.6f} ± {f['ppl_diff_unc']:10.6f}",
            "",
            "====== KL divergence statistics ======",
            f"Mean    KLD: {f['kld']:10.6f} ± {f['kld_unc']:10.6f}",
        ]
        lines += [f"{label} KLD: {f['kld_quantiles'][label.strip()]:10.6f}" for label, _ in KLD_PERCENTILES]
        lines += ["", "====== Token probability statistics ======",
                  f"Mean    Δp: {100 * f['p_diff']:6.3f} ± {100 * f['p_diff_unc']:5.3f} %"]
        lines += [f"{label} Δp: {100 * f['p_diff_quantiles'][label.strip()]:6.3f}%"
                  for label, _ in P_DIFF_PERCENTILES]
        lines += [f"RMS Δp    : {100 * f['p_diff_rms']:6.3f} ± {100 * f['p_diff_rms_unc']:5.3f} %",
                  f"Same top p: {100 * f['same_top']:6.3f} ± {100 * f['same_top_unc']:5.3f} %"]
        return lines
