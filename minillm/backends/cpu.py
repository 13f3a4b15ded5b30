"""The CPU backend: weights packed for the Numba kernels (minillm/weights.py), the
architecture's compiled layer (its module's `ops` are kernels/cpu/layers.py), KV caches in host
memory (minillm/kv_cache.py)."""
from __future__ import annotations

import os
import time
from contextlib import nullcontext

import numpy as np

from ..arch.base import NO_EXPERTS, NO_MATRIX, Experts
from ..errors import UnsupportedError
from ..kernels.cpu import ops
from ..kernels.cpu.attention_fns import attention_fn, attention_fn_cached
from ..kernels.cpu.layers import NO_PAGING, NO_WEIGHTS, KVView, linear, plain
from ..kv_cache import CACHE_TYPES, KVCache, cache_arrays
from ..memory import keep_freed_memory, release_compiler_pages
from ..recurrent_state import RecurrentState
from ..threads import ThreadGovernor
from ..weights import (Matrix, ProductsElsewhere, prepare_products, product_kinds, products_ready, row_by_row,
                       stack_experts, with_products)
from .base import Backend


class CpuBackend(Backend):
    device = "cpu"

    def __init__(self, arch, cache_types: tuple[str, str], progress=None, on_compile=None):
        shapes = self._matrix_shapes(arch)
        self.cache_dtype = np.dtype(CACHE_TYPES[cache_types[0]][0])  # (K and V share it: check_cache_types)
        # a first run on several cores: the products and attention compile in another process
        # while warm_up compiles the layer here; else the products here, now (loaded from the
        # cache when they are there), and attention at the first pass
        # (MINILLM_COMPILE_ELSEWHERE: "siblings", other processes compile them already; "0", here)
        self._products_elsewhere = None
        elsewhere = os.environ.get("MINILLM_COMPILE_ELSEWHERE")
        if ((os.cpu_count() or 1) > 1 and elsewhere != "0" and not _layer_cached(arch.layer_function)
                and not (products_ready(*product_kinds(shapes)) and attention_fn_cached(self.cache_dtype))):
            self._products_elsewhere = ProductsElsewhere(shapes, self.cache_dtype, siblings=elsewhere == "siblings")
        else:
            prepare_products(shapes, on_compile)
        super().__init__(arch, cache_types, progress)
        keep_freed_memory()  # each pass's activations reuse the last pass's pages
        self.layer_function = arch.layer_function
        self.row_layers = None  # self.layers with every product computed row by row (forward_rows)
        self.governor = None  # a ThreadGovernor (adapt_threads): the thread count of each pass

    # -- weights ---------------------------------------------------------------------
    @staticmethod
    def _matrix_shapes(arch) -> set:
        """(format, rows) of every matrix load_weights packs (the output, each layer's)."""
        gguf = arch.gguf
        output = "output.weight" if "output.weight" in gguf.tensors else "token_embd.weight"
        sources = [(output, None)] + [source for il in range(arch.hp.n_layer) for source in arch.layer_sources(il)
                                      if source is not None and source is not NO_MATRIX and source is not NO_EXPERTS]
        # an expert tensor: matrices of its middle dimension's rows
        sources = [(s.name, (0, gguf.tensors[s.name].shape[1])) if isinstance(s, Experts) else s for s in sources]
        infos = [(gguf.tensors[name], rows) for name, rows in sources if not name.endswith(arch.array_tensors)]
        return {(info.format, rows[1] - rows[0] if rows else info.shape[1]) for info, rows in infos
                if len(info.shape) == 2 or rows}

    def vector(self, name: str) -> np.ndarray:
        return self.arch.vector(name)

    def matrix(self, name: str, rows: tuple[int, int] | None = None) -> tuple:
        """The matrix's Weights as the compiled layers take them: a plain tuple (kernels/cpu/layers.py)."""
        gguf = self.arch.gguf
        info = gguf.tensors[name]
        r0, r1 = rows or (0, info.shape[1])
        matrix = Matrix(name, info.format, gguf.raw(name)[r0:r1], r1 - r0, info.shape[0],
                        release=lambda a, b: gguf.release_pages(name, (r0 + a, r0 + b)),
                        addresses=self._products_elsewhere is None)
        gguf.release_pages(name)
        return plain(matrix.packed)

    def experts(self, name: str | None, n: int) -> tuple:
        """The n expert matrices of a 3-D tensor (K, F, n), stacked (weights.stack_experts);
        name None: an empty slot of the same types."""
        if name is None:
            return stack_experts([plain(NO_WEIGHTS)])
        info = self.arch.gguf.tensors[name]
        if not info.format.quantized:
            raise UnsupportedError(f"tensor '{name}': experts in {info.format.name} are not supported yet "
                                   f"(quantized ones are)")
        rows = info.shape[1]
        return stack_experts([self.matrix(name, (e * rows, (e + 1) * rows)) for e in range(n)])

    def no_matrix(self) -> tuple:
        return plain(NO_WEIGHTS)

    # -- caches and forward passes ----------------------------------------------------
    def new_cache(self, n_ctx: int, n_keep: int = 0, batch_size: int = 512) -> KVCache:
        hp, arch = self.hp, self.arch
        sizes, layout = arch.cache_layout(n_ctx, min(batch_size, n_ctx))
        recurrent = arch.recurrent_shapes()
        return KVCache(hp.n_layer, hp.n_head_kv, hp.head_dim, sizes, layout, n_keep, arch.cache_windows(),
                       self.cache_types, RecurrentState(*recurrent) if recurrent else None)

    def forward(self, ids: np.ndarray, cache, logits_from: int) -> np.ndarray:
        positions = cache.reserve(len(ids))
        # as llama.cpp, the last layer's feed-forward runs on the output rows only
        out_from = min(logits_from, len(ids) - 1)
        x = self.run_layers(ids, positions, lambda il: self.cache_kv(cache, il), out_from, self.layers, cache.n_ctx)
        cache.commit(len(ids))
        return self.output_logits(x[logits_from - out_from:], self.output)

    def adapt_threads(self, threads: int) -> None:
        self.governor = None if os.environ.get("MINILLM_FIXED_THREADS") == "1" else ThreadGovernor(threads)

    def _products_here(self) -> None:
        """Wait for the products compiled elsewhere, and give every matrix their addresses (in
        place: a forward pass holds self.layers already)."""
        self._products_elsewhere.join()
        self._products_elsewhere = None
        self.output = with_products(self.output)
        for il, layer in enumerate(self.layers):
            self.layers[il] = tuple(with_products(w) if isinstance(w, tuple) else w for w in layer)

    def _layer_types(self) -> tuple:
        """The types of the warm-up pass's layer arguments: the layer compiles for them before
        anything runs (while the products and attention compile elsewhere)."""
        cache = self.new_cache(2)
        positions = cache.reserve(1)
        x, tables, positions = self.upload(self.step_inputs(np.zeros(1, np.int64), positions, cache.n_ctx))
        kv = self.cache_kv(cache, 0, attend_fn=0)  # (an address's type: no attention compiled here)
        args = (x, self.layers[0], positions, kv, 0, *self.arch.layer_args(0, tables))
        return tuple(self.layer_function.typeof_pyval(a) for a in args)

    def run_layers(self, ids, positions, kv_of, out_from: int, layers, n_ctx: int):
        if self._products_elsewhere is not None:  # a pass before warm_up
            self._products_here()
        if self.governor is None:
            return super().run_layers(ids, positions, kv_of, out_from, layers, n_ctx)
        threads = self.governor.choose(len(ids))
        t0 = time.perf_counter()
        x = super().run_layers(ids, positions, kv_of, out_from, layers, n_ctx)
        self.governor.record(len(ids), threads, time.perf_counter() - t0)
        return x

    def attention_address(self, cache_dtype) -> int:
        if self._products_elsewhere is not None:  # (the pool of a server made before warm_up)
            self._products_here()
        return attention_fn(cache_dtype)

    def cache_kv(self, cache, il: int, attend_fn: int | None = None) -> tuple:
        """Layer il's KVView of one sequence's cache, as the CPU layers take it (a plain tuple);
        with recurrent layers, (KVView, conv states, state matrices, each row's sequence), the
        states empty where il has none. attend_fn: the attention's address (by default the
        cache type's)."""
        kc, vc, group, slots = cache.layer(il)
        attend_fn = self.attention_address(kc.dtype) if attend_fn is None else attend_fn
        view = plain(KVView(kc, vc, group.kv_pos, slots, group.n_keep, NO_PAGING, attend_fn))
        if cache.recurrent is None:
            return view
        return (view, *cache.recurrent.layer(il))

    def pool_arrays(self, row_counts: list[int], cache_type: str) -> list[np.ndarray]:
        """In huge pages: a step's rows walk every layer's cells (attention 0.8x the time)."""
        hp = self.hp
        return cache_arrays(row_counts, hp.n_head_kv, hp.head_dim, cache_type, huge_pages=True)

    def forward_rows(self, ids: np.ndarray, positions: np.ndarray, kv_of, out_from: int, n_ctx: int) -> np.ndarray:
        """Backend.forward_rows: every row bit for bit what forward() gives it alone (the
        products row by row, each row's attention as a lone query's)."""
        if self.row_layers is None:
            self.row_layers = [tuple(row_by_row(w) if isinstance(w, tuple) else w for w in layer)
                               for layer in self.layers]
        x = self.run_layers(ids, positions, kv_of, out_from, self.row_layers, n_ctx)
        return self.output_logits(x, row_by_row(self.output))

    def forward_each_alone(self, ids: np.ndarray, cache) -> np.ndarray:
        """Logits (T, V) of ids at the cache's next positions, each row bit for bit what
        forward() gives that token evaluated alone after the rows before it (speculative
        decoding's verification). Only within cache.headroom(), where no row's cells are lost."""
        positions = cache.reserve(len(ids))

        def kv_of(il):
            kc, vc, group, slots = cache.layer(il)
            view = plain(KVView(kc, vc, group.kv_pos, slots, group.n_keep, cache.paging(il, len(ids)),
                                self.attention_address(kc.dtype)))
            return view if cache.recurrent is None else (view, *cache.recurrent.layer(il))

        logits = self.forward_rows(ids, positions, kv_of, 0, cache.n_ctx)
        cache.commit(len(ids))
        return logits

    def output_logits(self, x: np.ndarray, output) -> np.ndarray:
        """Logits (T, V) of hidden states x (T, E): final norm, output product (its Weights)."""
        if x.shape[0] == 0:
            return np.empty((0, self.hp.n_vocab), np.float32)
        xn = np.empty_like(x)
        ops.rmsnorm(x, self.output_norm, np.float32(self.hp.rms_eps), xn)
        if self.recorder is not None:
            self.recorder.saw((output,), xn)
        return self.arch.finish_logits(linear(output, xn))

    def warm_up(self, on_compile=None) -> None:
        """One token through the model so that the compiled kernels are ready; then LLVM's pages,
        idle from here on, go back to the kernel (memory.py). On a machine's first run this
        compiles the kernels (minutes), inside on_compile() when given."""
        compiling = on_compile() if on_compile is not None and not self.kernels_cached() else nullcontext()
        with compiling:
            # the layer first, by its arguments' types: it needs no address of a product or of
            # attention, which on a first run compile meanwhile in another process (or task)
            self.layer_function.compile(self._layer_types())
            if self._products_elsewhere is not None:
                self._products_here()
            self.forward(np.zeros(1, np.int64), self.new_cache(2), 0)
        release_compiler_pages()

    def kernels_cached(self) -> bool:
        """Whether Numba's on-disk cache (wherever NUMBA_CACHE_DIR puts it) holds this
        architecture's layer function and its cache type's attention for the current source.
        Numba has no public call for this: its cache index is read the way Numba itself reads
        it (empty when the file is missing or the source changed since)."""
        return _layer_cached(self.layer_function) and attention_fn_cached(self.cache_dtype)


def _layer_cached(layer_function) -> bool:
    """CpuBackend.kernels_cached for a layer function."""
    try:
        return bool(layer_function._cache._cache_file._load_index())
    except (AttributeError, OSError):  # another Numba version: assume the worst, say we compile
        return False
