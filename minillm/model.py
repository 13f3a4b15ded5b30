"""The engine's entry point: load a GGUF model and evaluate it."""
from __future__ import annotations

import os
import time
from pathlib import Path

import numba
import numpy as np

from .arch import get_architecture
from .errors import MinillmError
from .gguf_file import GGUFFile
from .kv_cache import KVCache

DEFAULT_BATCH = 512


def default_threads() -> int:
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


class Model:
    """A loaded model. `logits(ids)` evaluates a fresh sequence."""

    def __init__(self, path: str | os.PathLike, threads: int | None = None, progress=None):
        t0 = time.perf_counter()
        self.path = Path(path)
        self.threads = threads or default_threads()
        numba.set_num_threads(min(self.threads, numba.config.NUMBA_NUM_THREADS))
        self.gguf = GGUFFile(path)
        self.arch = get_architecture(self.gguf.architecture)(self.gguf)
        self.hp = self.arch.hp
        self.arch.load_weights(progress)
        self.load_seconds = time.perf_counter() - t0

    @property
    def n_vocab(self) -> int:
        return self.hp.n_vocab

    def new_cache(self, n_ctx: int) -> KVCache:
        hp = self.hp
        return KVCache(hp.n_layer, n_ctx, hp.n_head_kv, hp.head_dim)

    def eval(self, ids, cache: KVCache, logits_from: int = 0, batch_size: int = DEFAULT_BATCH) -> np.ndarray:
        """Append ids to cache in batches; logits (len(ids) - logits_from, n_vocab)."""
        ids = self.check_ids(ids)
        out = []
        for b0 in range(0, len(ids), batch_size):
            chunk = ids[b0:b0 + batch_size]
            first = max(0, logits_from - b0)
            logits = self.arch.forward(chunk, cache, min(first, len(chunk)))
            if logits.shape[0]:
                out.append(logits)
        if not out:
            return np.empty((0, self.n_vocab), np.float32)
        return out[0] if len(out) == 1 else np.concatenate(out)

    def logits(self, ids, start: int = 0, batch_size: int = DEFAULT_BATCH) -> np.ndarray:
        """Logits (len(ids) - start, n_vocab) of a fresh sequence, for positions start.. ."""
        ids = self.check_ids(ids)
        cache = self.new_cache(max(1, len(ids)))
        return self.eval(ids, cache, start, batch_size)

    def check_ids(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.n_vocab):
            bad = int(ids[(ids < 0) | (ids >= self.n_vocab)][0])
            raise MinillmError(f"token id {bad} is outside the vocabulary (0..{self.n_vocab - 1})")
        return ids


def load(path: str | os.PathLike, threads: int | None = None, progress=None) -> Model:
    return Model(path, threads=threads, progress=progress)
