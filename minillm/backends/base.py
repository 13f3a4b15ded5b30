"""The interface every backend implements, and the forward loop they share.

A backend holds an architecture's weights where its kernels read them (host memory for the CPU,
device memory for CUDA) and runs the forward pass there. The architecture (minillm/arch) stays
declarative: its tensors, hyper-parameters, RoPE tables and one layer function written in the
operations of an `ops` module; a backend runs that same layer over its own operations.

    backend.forward(ids, cache, logits_from)      one sequence: logits (T - logits_from, V)
    backend.forward_rows(ids, positions, kv_of, out_from, n_ctx)
                                                  rows of many sequences, each as if alone
    backend.forward_each_alone(ids, cache)        one sequence's rows, each as if alone
                                                  (speculative verification)
"""
from __future__ import annotations

import numpy as np

from ..arch.base import NO_EXPERTS, NO_MATRIX, Experts
from ..errors import MinillmError

NO_VECTOR = np.zeros(0, np.float32)  # an optional vector (a bias, a norm) the file lacks


class NotOnThisBackend(MinillmError):
    """A feature the chosen device does not run yet."""


class NotForThisModel(MinillmError):
    """A feature the model's architecture does not run yet."""


class Backend:
    """An architecture's weights and forward pass on one kind of device. Subclasses give the
    weights' form (vector, matrix), the caches, the layer function over their ops and the
    hooks of the shared loop (upload, layer_done, output_logits)."""

    device = ""
    # features this backend does not run yet: name -> why (check_supports raises with it)
    missing: dict[str, str] = {}

    def __init__(self, arch, cache_types: tuple[str, str], progress=None):
        self.arch = arch
        self.hp = arch.hp
        self.cache_types = cache_types  # (K, V) of the caches it makes: -ctk, -ctv
        self.skipped_layers: frozenset = frozenset()  # left out of the forward (layer importance)
        self.recorder = None  # while an importance matrix is collected: sees every product's input
        self.load_weights(progress)

    def check_supports(self, feature: str) -> None:
        """Raise NotOnThisBackend if `feature` (a key of `missing`) does not run here, or
        NotForThisModel if the architecture does not run it yet (its `unsupported`)."""
        if feature in self.arch.unsupported:
            raise NotForThisModel(f"{self.arch.unsupported[feature]} does not run {self.arch.name} models yet "
                                  f"(their recurrent layers' state)")
        if feature in self.missing:
            raise NotOnThisBackend(f"{self.missing[feature]} does not run on {self.device} yet: use device='cpu'")

    # -- weights ---------------------------------------------------------------------
    def load_weights(self, progress=None) -> None:
        """Every tensor once, in the architecture's layer order (arch.layer_sources)."""
        arch = self.arch
        self.output_norm = self.vector(arch.output_norm)                                      # (E,)
        self.output_name = "output.weight" if "output.weight" in arch.gguf.tensors else "token_embd.weight"
        self.output = self.matrix(self.output_name)                                          # (V, E)
        self.layers = []  # per layer: a tuple in layer_order (vectors and matrices in this backend's form)
        for il in range(self.hp.n_layer):
            layer = []
            for source in arch.layer_sources(il):
                if source is None:  # an optional vector the file lacks: the layer sees it empty
                    layer.append(NO_VECTOR)
                elif source is NO_MATRIX:
                    layer.append(self.no_matrix())
                elif isinstance(source, Experts):
                    layer.append(self.experts(source.name, source.n))
                elif source is NO_EXPERTS:
                    layer.append(self.experts(None, 0))
                elif len(arch.gguf.tensors[source[0]].shape) == 1:
                    layer.append(self.vector(source[0]))
                elif source[0].endswith(arch.array_tensors):
                    layer.append(arch.array(source[0]))
                else:
                    layer.append(self.matrix(*source))
            self.layers.append(tuple(layer))
            if progress:
                progress(il + 1, self.hp.n_layer)

    def vector(self, name: str):
        raise NotImplementedError

    def matrix(self, name: str, rows: tuple[int, int] | None = None):
        """The tensor's matrix in the form the layers take, or rows [r0, r1) of it."""
        raise NotImplementedError

    def experts(self, name: str, n: int):
        """A 3-D tensor's n expert matrices, as this backend's layers take them."""
        raise NotOnThisBackend(f"mixtures of experts do not run on {self.device} yet: use device='cpu'")

    def no_matrix(self):
        """An empty matrix slot (NO_MATRIX), of the type the layers take matrices in."""
        raise NotOnThisBackend(f"{self.arch.name} models do not run on {self.device} yet: use device='cpu'")

    # -- caches and forward passes ----------------------------------------------------
    def new_cache(self, n_ctx: int, n_keep: int = 0, batch_size: int = 512):
        """A KV cache of n_ctx positions in self.cache_types (ring buffers: kv_cache.py), n_keep
        sink tokens, batches of at most batch_size tokens."""
        raise NotImplementedError

    def pool_arrays(self, row_counts: list[int], cache_type: str) -> list:
        """Zeroed (rows, n_head_kv, row length) keys or values of each layer of the batching
        scheduler's pool (serving/kv_pool.py), where this backend's kernels read them."""
        raise NotImplementedError

    def attention_address(self, cache_dtype) -> int:
        """The address of the compiled attention over caches of this dtype that the layers call
        (the CPU's kernels/cpu/attention_fns.py); 0 where the layers attend otherwise."""
        return 0

    def pool_budget(self) -> int | None:
        """Bytes the scheduler's pool may take when the caller gives no size, or None: as many
        cells as every slot's context (host pages are taken only as cells are written)."""
        return None

    def forward(self, ids: np.ndarray, cache, logits_from: int) -> np.ndarray:
        """Evaluate ids at the cache's next positions; logits (T - logits_from, V) on the host."""
        raise NotImplementedError

    def forward_rows(self, ids: np.ndarray, positions: np.ndarray, kv_of, out_from: int, n_ctx: int) -> np.ndarray:
        """The batching scheduler's forward: rows of several sequences (ids, positions (T,)),
        each computed as if it were evaluated alone, one token at a time (one kernel path per
        row, whatever the other rows). kv_of(il): layer il's KVView over the shared pool
        (minillm/serving/kv_pool.py, its arrays from pool_arrays); n_ctx: the positions each
        sequence may hold. Logits (T - out_from, V) of the rows from out_from on."""
        raise NotOnThisBackend(f"batched rows (the scheduler) do not run on {self.device} yet: use device='cpu'")

    def forward_each_alone(self, ids: np.ndarray, cache) -> np.ndarray:
        raise NotOnThisBackend(f"speculative decoding does not run on {self.device} yet: use device='cpu'")

    def warm_up(self, on_compile=None) -> None:
        """Run the kernels once so that they are compiled (on_compile: see Model.warm_up)."""
        raise NotImplementedError

    # -- the shared loop ------------------------------------------------------------
    layer_function = None  # the architecture's layer over this backend's operations

    def step_inputs(self, ids, positions, n_ctx: int):
        """The host arrays a forward pass reads: the embeddings (T, E), the architecture's rope
        tables ((cos, sin), or a dict of such pairs) and the positions (T,)."""
        return self.arch.embed(ids), self.arch.rope_tables(positions, n_ctx), positions

    def upload(self, inputs):
        """Host arrays (nested in tuples and dicts) where the layers read them: the CPU's layers
        read host memory."""
        return inputs

    def run_layers(self, ids, positions, kv_of, out_from: int, layers, n_ctx: int):
        """The hidden states (T - out_from, E) after every layer (those in skipped_layers left
        out); kv_of(il): layer il's KV view as this backend's layers take it."""
        x, tables, positions = self.upload(self.step_inputs(ids, positions, n_ctx))
        return self.layers_from(x, tables, positions, kv_of, out_from, layers)

    def layers_from(self, x, tables, positions, kv_of, out_from: int, layers):
        """run_layers from its inputs where the layers read them."""
        arch = self.arch
        run = range(len(layers))
        if self.skipped_layers:  # only while layer importance is measured: no list per token otherwise
            run = [il for il in run if il not in self.skipped_layers]
        last = run[-1] if len(run) else -1
        layer = self.layer_function if self.recorder is None else self.recorder.layer_function
        for il in run:
            x = layer(x, layers[il], positions, kv_of(il), out_from if il == last else 0, *arch.layer_args(il, tables))
            self.layer_done(x)
        return x if len(run) else x[out_from:]

    def adapt_threads(self, threads: int) -> None:
        """Run on up to `threads` threads, as many as turn out fastest (the CPU: minillm/threads.py)."""

    def layer_done(self, x) -> None:
        """After each layer, with its output x (CUDA: the pass's other buffers are recycled)."""

    def output_logits(self, x, output) -> np.ndarray:
        """Logits (T, V) on the host of hidden states x (T, E): final norm, output product."""
        raise NotImplementedError

    def layer_with_ops(self, ops_module):
        """The architecture's layer code running over another module of operations (plain Python)."""
        import types

        fn = self.arch.layer_function.py_func
        return types.FunctionType(fn.__code__, dict(fn.__globals__, ops=ops_module), fn.__name__)
