"""`minillm imatrix`: the importance matrix of llama.cpp's llama-imatrix, computed the same way.

For every weight product of the layers (and, with process_output, the output one), the sum of
x^2 of each input column over the rows of a calibration text, and the rows counted:
llama-quantize --imatrix weighs each column's rounding error by sum / count.

The protocol (tools/imatrix/imatrix.cpp of b11434): tokenize the whole text (the model's BOS);
chunks of n_ctx tokens, the first of each replaced by BOS; at least two chunks. Chunks are
evaluated n_seq = n_batch / n_ctx at a time, one KV stream each, and llama.cpp splits that
batch into ubatches of n_ubatch rows: with one stream consecutive tokens, with several an
equal share of every sequence, stream after stream. The float32 sums follow the rows in that
order, and a ubatch of fewer than 16 rows is not counted. So each ubatch is evaluated here as
one forward too: the products over all its rows (ggml's K-quant kernels round a row
differently by where it falls in the batch), attention per stream over the stream's own cache
and rows. A perplexity of the second half of each chunk is reported along the way, as
llama-imatrix prints it.
"""
from __future__ import annotations

import types
from dataclasses import dataclass

import numba as nb
import numpy as np

from ..errors import MinillmError
from ..imatrix_file import Collector, Imatrix
from .perplexity import _nll

MIN_UBATCH_ROWS = 16          # llama-imatrix ignores products of fewer rows


@nb.njit(cache=True, nogil=True)
def _accumulate(x, sum2, sum1):
    """sum2 += x^2 and sum1 += x over the rows of x (T, K), row after row, in float32."""
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            sum2[j] += x[t, j] * x[t, j]
        for j in range(x.shape[1]):
            sum1[j] += x[t, j]


@nb.njit(cache=True, nogil=True)
def _accumulate_squares(x, sum2):
    """sum2 += x^2 over the rows of x (an entry from a legacy file keeps no sum of x)."""
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            sum2[j] += x[t, j] * x[t, j]


class ActivationRecorder:
    """Installed as the backend's `recorder`: the layers then run over operations that
    hand every weight product's input here first (the same kernels: nothing else changes).
    The sums go to the collector's entries (those of files loaded before included), and each
    count it hears of right away: llama-imatrix writes its periodic files at that point, in the
    middle of a ubatch."""

    def __init__(self, backend, collector: Collector, process_output: bool = False):
        self.names = {}                              # id(Weights) -> tensor name
        for il, layer in enumerate(backend.layers):
            for value, source in zip(layer, backend.arch.layer_sources(il)):
                if source is not None and isinstance(value, tuple):
                    self.names[id(value)] = source[0]
        if process_output:
            self.names[id(backend.output)] = backend.output_name
        self.collector = collector
        self.entries = self.collector.entries
        self.collecting = True
        cpu_ops = backend.arch.layer_function.py_func.__globals__["ops"]
        self.layer_function = backend.layer_with_ops(self._recording_ops(cpu_ops))

    def _recording_ops(self, base):
        ops = types.SimpleNamespace(**{k: getattr(base, k) for k in dir(base) if not k.startswith("__")})
        ops.linear = lambda w, x: self.saw((w,), x) or base.linear(w, x)
        ops.linear2 = lambda w1, w2, x: self.saw((w1, w2), x) or base.linear2(w1, w2, x)
        ops.linear3 = lambda w1, w2, w3, x: self.saw((w1, w2, w3), x) or base.linear3(w1, w2, w3, x)

        def rope_attend(q, k, v, positions, rope_table, kv, *args):
            """With one kv per stream (StreamKV): each stream's rows over its own cache."""
            if not isinstance(kv, StreamKV):
                return base.rope_attend(q, k, v, positions, rope_table, kv, *args)
            cos, sin = rope_table
            return np.concatenate([base.rope_attend(q[a:b], k[a:b], v[a:b], positions[a:b], (cos[a:b], sin[a:b]),
                                                    kv_s, *args) for a, b, kv_s in kv.parts])
        ops.rope_attend = rope_attend
        return ops

    def saw(self, weights, x: np.ndarray) -> None:
        """x (T, K) is the input of the products with these weights (fused parts counted once)."""
        if not self.collecting:
            return
        for name in dict.fromkeys(self.names[id(w)] for w in weights if id(w) in self.names):
            e = self.collector.entry_for(name, x.shape[1])
            if e.sum1 is None:
                _accumulate_squares(x, e.sum2)
            else:
                _accumulate(x, e.sum2, e.sum1)
            if not np.all(np.isfinite(e.sum2)):
                raise MinillmError(f"non-finite values detected in the inputs of {name}")
            for i in range(e.counts.size):
                e.counts[i] += x.shape[0]
                self.collector.counted(int(e.counts[i]))


@dataclass
class StreamKV:
    """One layer's caches in a ubatch of several streams: (first row, end row, KVView) each."""
    parts: list


def forward_streams(backend, pieces) -> np.ndarray:
    """One ubatch of several streams, pieces [(cache, ids)], evaluated as llama.cpp does it:
    every product over all the rows together, attention per stream (on the CPU backend).
    Logits (rows, n_vocab)."""
    positions = [cache.reserve(len(ids)) for cache, ids in pieces]
    ends = np.cumsum([len(ids) for _, ids in pieces])
    starts = ends - [len(ids) for _, ids in pieces]

    def kv_of(il):
        return StreamKV([(a, b, backend.cache_kv(cache, il)) for a, b, (cache, _) in zip(starts, ends, pieces)])

    x = backend.run_layers(np.concatenate([ids for _, ids in pieces]), np.concatenate(positions), kv_of, 0,
                           backend.layers, pieces[0][0].n_ctx)
    for cache, ids in pieces:
        cache.commit(len(ids))
    return backend.output_logits(x, backend.output)


@dataclass
class ImatrixResult:
    imatrix: Imatrix
    n_chunks: int
    ppl: float | None


def ubatches(n_seqs: int, n_tokens: int, n_ubatch: int, n_streams: int):
    """llama.cpp's split of a batch of n_seqs sequences of n_tokens each into ubatches: yields
    (first token, tokens per sequence, sequences) in order. One stream: consecutive rows
    (split_simple, one sequence); several: split_equal's equal share of every sequence."""
    per_seq = n_ubatch if n_streams == 1 else max(1, n_ubatch // n_seqs)
    for t0 in range(0, n_tokens, per_seq):
        yield t0, min(per_seq, n_tokens - t0), n_seqs


def compute_imatrix(model, text: str, dataset: str, n_ctx: int = 512, n_batch: int = 2048, n_ubatch: int = 512,
                    n_chunks: int | None = None, process_output: bool = False, compute_ppl: bool = True,
                    progress=None, first_chunk: int = 0, collector: Collector | None = None) -> ImatrixResult:
    """The importance matrix of the model over the text (see the module's docstring). dataset:
    the name the file records (llama-imatrix: the -f path as given). progress(done, total, ppl)
    after each group of chunks. first_chunk: skip the text's first chunks (llama-imatrix
    --chunk; at least two must remain, and a token more). collector: where the sums go, with
    the files loaded before (a Collector(n_ctx) of its own if None); its on_chunks hears of
    every new chunk count."""
    model.backend.check_supports("imatrix")
    tok = model.tokenizer
    tokens = tok.tokenize(text, special=False)
    if first_chunk > 0:
        if (first_chunk + 2) * n_ctx >= len(tokens):
            raise MinillmError(f"the text is {len(tokens)} tokens: starting from chunk {first_chunk} of {n_ctx} "
                               f"tokens leaves fewer than two chunks (and a token)")
        tokens = tokens[first_chunk * n_ctx:]
    if len(tokens) < 2 * n_ctx:
        raise MinillmError(f"the text is {len(tokens)} tokens; an importance matrix with a context of {n_ctx} "
                           f"needs at least {2 * n_ctx} (a longer text, or a smaller n_ctx)", ("n_ctx",))
    n_chunk = len(tokens) // n_ctx
    if n_chunks is not None and n_chunks > 0:
        n_chunk = min(n_chunk, n_chunks)
    n_seq = max(1, n_batch // n_ctx)
    n_batch = min(n_batch, n_seq * n_ctx)
    n_ubatch = min(n_ubatch, n_batch)
    if collector is None:
        collector = Collector(n_ctx)
    elif collector.n_ctx != n_ctx:
        raise ValueError(f"the collector counts chunks of {collector.n_ctx} tokens, not {n_ctx}")
    recorder = ActivationRecorder(model.backend, collector, process_output)
    bos = tok.bos_id if tok.add_bos and tok.bos_id is not None else None
    nll_total, n_scored = 0.0, 0
    model.backend.recorder = recorder
    try:
        for i in range(0, n_chunk, n_seq):
            seqs = range(i, min(i + n_seq, n_chunk))
            chunks = [np.asarray(tokens[c * n_ctx:(c + 1) * n_ctx], np.int64) for c in seqs]
            caches = [model.new_cache(n_ctx, batch_size=n_ubatch) for _ in seqs]
            for b0 in range(0, n_ctx, n_batch):              # one batch per chunk unless n_ctx > n_batch
                size = min(n_batch, n_ctx - b0)
                for t0, n, n_seqs in ubatches(len(chunks), size, n_ubatch, n_seq):
                    recorder.collecting = n * n_seqs >= MIN_UBATCH_ROWS
                    start = b0 + t0
                    pieces = [(cache, chunk[start:start + n].copy()) for chunk, cache in zip(chunks, caches)]
                    if start == 0 and bos is not None:
                        for _, ids in pieces:
                            ids[0] = bos
                    logits = forward_streams(model.backend, pieces)
                    if compute_ppl:
                        for s, chunk in enumerate(chunks):
                            nll = _scored_nll(logits[s * n:(s + 1) * n], chunk, start, n_ctx)
                            nll_total += nll.sum()
                            n_scored += nll.size
            if progress:
                progress(seqs[-1] + 1, n_chunk, float(np.exp(nll_total / n_scored)) if n_scored else None)
    finally:
        model.backend.recorder = None
    if not recorder.entries:
        raise MinillmError("no weight products were recorded (chunks of fewer than 16 tokens per step?)")
    return ImatrixResult(collector.imatrix(dataset), n_chunk, float(np.exp(nll_total / n_scored)) if n_scored else None)


def _scored_nll(logits: np.ndarray, chunk: np.ndarray, start: int, n_ctx: int) -> np.ndarray:
    """The NLL of the positions n_ctx/2 .. n_ctx-2 among start .. start+len(logits)-1 (their
    next tokens as targets), as llama-imatrix's perplexity scores a chunk."""
    first = max(n_ctx // 2, start)
    last = min(n_ctx - 1, start + logits.shape[0])          # exclusive
    if first >= last:
        return np.zeros(0)
    return _nll(logits[first - start:last - start], chunk[first + 1:last + 1])
