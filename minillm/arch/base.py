"""What every decoder-only architecture shares: metadata checks, weights, the forward loop."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import ModelError
from ..gguf_file import GGUFFile
from ..kernels.cpu import ops
from ..kernels.cpu.layers import NO_PAGING, linear
from ..kernels.cpu.unpack import dequantize
from ..weights import Matrix, row_by_row

MAX_LAYERS = 512
MAX_WIDTH = 1 << 16
MAX_HEADS = 1024


@dataclass
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dims: int


class Metadata:
    """Typed, bounded access to an architecture's metadata keys."""

    def __init__(self, gguf: GGUFFile, arch: str):
        self.gguf, self.arch = gguf, arch

    def _get(self, key: str, default):
        full = f"{self.arch}.{key}"
        value = self.gguf.metadata.get(full, default)
        if value is None:
            raise ModelError(f"missing metadata key '{full}'")
        return full, value

    def int(self, key: str, lo: int, hi: int, default=None) -> int:
        full, value = self._get(key, default)
        if isinstance(value, np.ndarray):  # per-layer arrays: all layers must agree here
            if value.size == 0 or not np.all(value == value.flat[0]):
                raise ModelError(f"'{full}' varies per layer, which is not supported")
            value = value.flat[0].item()
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ModelError(f"metadata '{full}' = {value!r} is out of range [{lo}, {hi}]")
        return int(value)

    def float(self, key: str, lo: float, hi: float, default=None) -> float:
        full, value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
            raise ModelError(f"metadata '{full}' = {value!r} is out of range [{lo}, {hi}]")
        return float(value)


class Transformer:
    """A decoder-only transformer; subclasses define the hyper-parameters and one layer."""

    name = ""
    rope_neox = False
    # the layer tensors, in the order the compiled layer function unpacks them
    layer_order = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate",
                   "ffn_up", "ffn_down")

    def __init__(self, gguf: GGUFFile):
        self.gguf = gguf
        self.meta = Metadata(gguf, self.name)
        self.hp = self.read_hparams()
        self.check_tensors()

    # -- hyper-parameters and tensors ------------------------------------------------
    def read_hparams(self) -> HParams:
        m = self.meta
        n_embd = m.int("embedding_length", 1, MAX_WIDTH)
        n_head = m.int("attention.head_count", 1, MAX_HEADS)
        n_head_kv = m.int("attention.head_count_kv", 1, n_head, default=n_head)
        if n_head % n_head_kv:
            raise ModelError(f"head count {n_head} is not a multiple of the key/value head count {n_head_kv}")
        head_dim = m.int("attention.key_length", 1, MAX_WIDTH, default=n_embd // n_head)
        if m.int("attention.value_length", 1, MAX_WIDTH, default=head_dim) != head_dim:
            raise ModelError("key and value head sizes differ, which is not supported")
        emb = self.gguf.tensors.get("token_embd.weight")
        if emb is None or len(emb.shape) != 2:
            raise ModelError("missing tensor 'token_embd.weight' (or it is not a matrix)")
        return HParams(
            n_vocab=emb.shape[1],
            n_embd=n_embd,
            n_layer=m.int("block_count", 1, MAX_LAYERS),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=m.int("feed_forward_length", 1, 1 << 20),
            n_ctx_train=m.int("context_length", 1, 1 << 24),
            rms_eps=m.float("attention.layer_norm_rms_epsilon", 0.0, 1.0),
            rope_base=m.float("rope.freq_base", 1e-3, 1e12, default=10000.0),
            rope_dims=m.int("rope.dimension_count", 2, head_dim, default=head_dim),
        )

    def layer_tensors(self, il: int) -> dict[str, tuple[int, ...]]:
        """Tensor name suffix -> expected GGUF shape for layer il."""
        hp = self.hp
        E, F, q_dim, kv_dim = hp.n_embd, hp.n_ff, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
        return {
            "attn_norm": (E,), "attn_q": (E, q_dim), "attn_k": (E, kv_dim), "attn_v": (E, kv_dim),
            "attn_output": (q_dim, E), "ffn_norm": (E,), "ffn_gate": (E, F), "ffn_up": (E, F),
            "ffn_down": (F, E),
        }

    def check_tensors(self) -> None:
        hp = self.hp
        expected = {"token_embd.weight": (hp.n_embd, hp.n_vocab), "output_norm.weight": (hp.n_embd,)}
        if "output.weight" in self.gguf.tensors:
            expected["output.weight"] = (hp.n_embd, hp.n_vocab)
        for il in range(hp.n_layer):
            for suffix, shape in self.layer_tensors(il).items():
                expected[f"blk.{il}.{suffix}.weight"] = shape
        for name, shape in expected.items():
            info = self.gguf.tensors.get(name)
            if info is None:
                raise ModelError(f"missing tensor '{name}' (the metadata says {hp.n_layer} layers)")
            if info.shape != shape:
                raise ModelError(f"tensor '{name}' has shape {list(info.shape)}, "
                                 f"but the metadata implies {list(shape)}")
            if len(shape) == 2 and info.format.quantized and shape[0] % 32:
                raise ModelError(f"tensor '{name}': row length {shape[0]} is not a multiple of 32")
            if len(shape) == 1 and info.format.name != "F32":
                raise ModelError(f"tensor '{name}' must be F32, not {info.format.name}")

    # -- weights ---------------------------------------------------------------------
    def vector(self, name: str) -> np.ndarray:
        return self.gguf.read_rows(name, [0]).view(np.float32).reshape(-1)  # a 1-D tensor is one row

    def matrix(self, name: str) -> Matrix:
        info = self.gguf.tensors[name]
        matrix = Matrix(name, info.format, self.gguf.raw(name), info.shape[1], info.shape[0],
                        release=lambda r0, r1: self.gguf.release_pages(name, (r0, r1)))
        self.gguf.release_pages(name)
        return matrix

    def load_weights(self, progress=None) -> None:
        hp = self.hp
        self.output_norm = self.vector("output_norm.weight")
        name = "output.weight" if "output.weight" in self.gguf.tensors else "token_embd.weight"
        self.output = self.matrix(name)
        self.layers = []  # per layer: a tuple in layer_order (vectors, and Matrix.packed tuples)
        for il in range(hp.n_layer):
            shapes = self.layer_tensors(il)
            layer = []
            for suffix in self.layer_order:
                full = f"blk.{il}.{suffix}.weight"
                layer.append(self.vector(full) if len(shapes[suffix]) == 1 else self.matrix(full).packed)
            self.layers.append(tuple(layer))
            if progress:
                progress(il + 1, hp.n_layer)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """(T, E) float32 rows of token_embd, dequantized exactly as ggml_get_rows."""
        info = self.gguf.tensors["token_embd.weight"]
        rows = self.gguf.read_rows("token_embd.weight", ids)
        return dequantize(info.format, rows, info.shape[0])

    # -- forward ---------------------------------------------------------------------
    def cache_layout(self, n_ctx: int, n_batch: int) -> tuple[dict[str, int], list[str]]:
        """Cache group sizes and each layer's group: by default one context-sized group."""
        return {"global": n_ctx}, ["global"] * self.hp.n_layer

    def cache_windows(self) -> dict[str, int]:
        """The sliding window of each cache group's layers (absent: none)."""
        return {}

    def forward(self, ids: np.ndarray, cache, logits_from: int) -> np.ndarray:
        """Evaluate ids at the cache's next positions; logits (T - logits_from, V)."""
        positions = cache.reserve(len(ids))
        # as llama.cpp, the last layer's feed-forward runs on the output rows only
        out_from = min(logits_from, len(ids) - 1)

        def kv_of(il):  # the CPU layers' view of the cache (kernels/cpu/layers.py)
            kc, vc, group, slots = cache.layer(il)
            return kc, vc, group.kv_pos, slots, group.n_keep, NO_PAGING

        x = self.run_layers(ids, positions, kv_of, out_from, self.layers)
        cache.commit(len(ids))
        return self.output_logits(x[logits_from - out_from:], self.output.packed)

    def forward_rows(self, ids: np.ndarray, positions: np.ndarray, kv_of, out_from: int) -> np.ndarray:
        """The batching scheduler's forward: rows of several sequences (ids, positions (T,)),
        each computed exactly as if it were evaluated alone, one token at a time (one kernel
        path per row, whatever the other rows). kv_of(il): layer il's kv tuple over the shared
        pool (minillm/kv_pool.py). Logits (T - out_from, V) of the rows from out_from on."""
        if self.row_layers is None:
            self.row_layers = [tuple(row_by_row(w) if isinstance(w, tuple) else w for w in layer)
                               for layer in self.layers]
        x = self.run_layers(ids, positions, kv_of, out_from, self.row_layers)
        return self.output_logits(x, row_by_row(self.output.packed))

    def forward_each_alone(self, ids: np.ndarray, cache) -> np.ndarray:
        """Logits (T, V) of ids at the cache's next positions, each row bit for bit what
        forward() gives that token evaluated alone after the rows before it (speculative
        decoding's verification). Only within cache.headroom(), where no row's cells are lost."""
        positions = cache.reserve(len(ids))

        def kv_of(il):
            kc, vc, group, slots = cache.layer(il)
            return kc, vc, group.kv_pos, slots, group.n_keep, cache.paging(il, len(ids))

        logits = self.forward_rows(ids, positions, kv_of, 0)
        cache.commit(len(ids))
        return logits

    row_layers = None  # self.layers with every product computed row by row (forward_rows)

    def run_layers(self, ids, positions, kv_of, out_from, layers) -> np.ndarray:
        """The hidden states (T - out_from, E) after every layer."""
        x = self.embed(ids)
        tables = self.rope_tables(positions)
        last = len(layers) - 1
        for il, layer in enumerate(layers):
            x = self.layer_function(x, layer, positions, kv_of(il), out_from if il == last else 0,
                                    *self.layer_args(il, tables))
        return x

    def output_logits(self, x: np.ndarray, output) -> np.ndarray:
        """Logits (T, V) of hidden states x (T, E): final norm, output product (its packed tuple)."""
        if x.shape[0] == 0:
            return np.empty((0, self.hp.n_vocab), np.float32)
        xn = np.empty_like(x)
        ops.rmsnorm(x, self.output_norm, np.float32(self.hp.rms_eps), xn)
        return self.finish_logits(linear(output, xn))

    def finish_logits(self, logits: np.ndarray) -> np.ndarray:
        return logits

    layer_function = None  # the architecture's compiled layer, written over its module's `ops`

    def layer_with_ops(self, ops_module):
        """The same layer code running over another backend's operations (plain Python)."""
        import types

        fn = self.layer_function.py_func
        return types.FunctionType(fn.__code__, dict(fn.__globals__, ops=ops_module), fn.__name__)

    def kernels_cached(self) -> bool:
        """Whether Numba's on-disk cache (wherever NUMBA_CACHE_DIR puts it) holds this
        architecture's layer function for the current source. Numba has no public call for
        this: its cache index is read the way Numba itself reads it (empty when the file is
        missing or the source changed since)."""
        try:
            return bool(self.layer_function._cache._cache_file._load_index())
        except (AttributeError, OSError):  # another Numba version: assume the worst, say we compile
            return False

    def layer_args(self, il, tables) -> tuple:
        """The layer function's arguments after (x, w, positions, kv): the rope table, ..."""
        raise NotImplementedError

    def rope_table(self, positions: np.ndarray, base: float, scale: float = 1.0):
        """(cos, sin) (T, rope_dims/2) for the batch, as ggml's rope cache computes them."""
        half = self.hp.rope_dims // 2
        cos_t = np.empty((len(positions), half), np.float32)
        sin_t = np.empty((len(positions), half), np.float32)
        ops.rope_angles(positions, self.hp.rope_dims, np.float32(base), np.float32(scale), cos_t, sin_t)
        return cos_t, sin_t
