"""The CUDA backend: the architecture's own layer code (minillm/arch/*.py) over the CUDA
operations of kernels/cuda/layers.py, with the weights and the KV cache on the device.

    backend = CudaBackend(arch)                  # uploads the weights
    cache = backend.new_cache(n_ctx, n_keep, batch_size)
    logits = backend.forward(ids, cache, logits_from)   # as the CPU backend's, same results

Importing this module imports numba.cuda (the `cuda` extra); the CPU path never does.
"""
from __future__ import annotations

import contextlib
import copy
import os
import threading
from dataclasses import dataclass

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import device_memset

from ..errors import MinillmError, ModelError, UnsupportedError
from ..kernels.cpu.matmul import KIND_IDS
from ..kernels.cpu.unpack import dequantize
from ..kernels.cuda import layers as cuda_layers
from ..kernels.cuda import upload_blocks, upload_float_matrix
from ..kernels.cuda.attention import MAX_HEAD_DIM
from ..kernels.cuda.launch import REPLAY_MODES, Replay, new_stream, recording
from ..kernels.cuda.layers import FLOAT_KIND, DeviceKV, DeviceMatrix, DevicePaging
from ..kernels.cuda.device import SIMULATOR
from ..kernels.cuda.matmul import MATVEC_MAX_T, qmatvec_kernel
from ..kernels.cuda.norm_quant import MAX_K
from ..kv_cache import F16_CACHE, KVCache
from .base import Backend

# how decode steps are replayed (kernels/cuda/launch.py): "auto" (a CUDA graph where it can be
# captured), "graph", "prepared", "direct", or "off" (every step issued from the layer code)
REPLAY = os.environ.get("MINILLM_CUDA_REPLAY", "auto")
POOL_SHARE = 0.8  # of the free device memory, for the batching scheduler's KV pool by default


class CudaKVCache(KVCache):
    """A KVCache whose keys and values live on the device, float16 (S, Hkv, D) per layer.

    The host keeps the bookkeeping (groups, slots, positions, n_past) exactly as KVCache; each
    group's kv_pos (S,) is mirrored on the device, where the RoPE/store kernel writes it during
    a forward, and re-uploaded when the host changes it otherwise (truncate, clear)."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, group_sizes: dict[str, int],
                 layer_groups: list[str], n_keep: int = 0):
        # the host part with zero-width k/v arrays: the keys and values are on the device
        super().__init__(n_layer, n_head_kv, 0, group_sizes, layer_groups, n_keep)
        self.k = [_device_zeros((group_sizes[g], n_head_kv, head_dim)) for g in layer_groups]
        self.v = [_device_zeros((group_sizes[g], n_head_kv, head_dim)) for g in layer_groups]
        self.device_kv_pos = {name: cuda.to_device(g.kv_pos) for name, g in self.groups.items()}  # (S,) int64
        self.device_slots = {}  # group -> (T,) int64 slots of the batch being evaluated (uploaded by forward)
        self.step_plan = None   # the recorded decode step (StepPlan) that reads and writes this cache

    def commit(self, n: int) -> None:
        """The batch of n tokens is stored: the kernels set the device's kv_pos of each group a
        layer uses, the host's follows."""
        positions = np.arange(self.n_past, self.n_past + n, dtype=np.int64)
        for name in set(self.layer_groups):
            self.groups[name].kv_pos[self._slots[name]] = positions
        super().commit(n)

    def batch_slots(self) -> dict[str, np.ndarray]:
        """Each group's (T,) slots of the batch reserve() placed, for the forward pass to upload."""
        return dict(self._slots)

    def device_kv(self, il: int) -> DeviceKV:
        """Layer il's cache as kernels/cuda/layers.py takes it."""
        name = self.layer_groups[il]
        return DeviceKV(self.k[il], self.v[il], self.device_kv_pos[name], self.device_slots[name],
                        self.groups[name].n_keep)

    def rewind(self, n: int) -> None:
        super().rewind(n)
        for name, group in self.groups.items():
            self.device_kv_pos[name].copy_to_device(group.kv_pos)

    def __deepcopy__(self, memo):
        """An independent copy (beam search forks caches), device arrays included."""
        new = copy.copy(self)
        new.groups = copy.deepcopy(self.groups, memo)
        new._slots = dict(self._slots)
        new.k = [_device_copy(a) for a in self.k]
        new.v = [_device_copy(a) for a in self.v]
        new.device_kv_pos = {name: _device_copy(a) for name, a in self.device_kv_pos.items()}
        new.device_slots = {}
        new.step_plan = None  # its launches read this cache's arrays
        return new


@dataclass
class StepPlan:
    """A cache's decode step, recorded: replaying it issues the step's launches again, over the
    same device buffers, after the token's inputs are copied into `inputs`."""

    skipped_layers: frozenset  # what the recording depends on besides the cache and T = 1
    pool: object               # the step's BufferPool: its buffers are the replay's buffers
    inputs: list               # device arrays the host inputs go to, in _leaves order
    logits: object             # (1, V) float32 device array the step's logits end in
    replay: Replay


@dataclass
class RowsPlan:
    """A scheduler step of B rows over one pool, recorded (as StepPlan, for forward_rows)."""

    skipped_layers: frozenset
    pool_key: tuple            # the pool's arrays the launches read (_pool_key)
    buffers: object            # the step's BufferPool
    inputs: list               # device arrays the host inputs go to, in _leaves order
    logits: object             # (B, V) float32 device array
    replay: Replay


MAX_REPLAYED_ROWS = 64  # scheduler steps of up to this many rows are recorded and replayed


def _replayed(plan: StepPlan | RowsPlan, host: list) -> np.ndarray:
    """A recorded pass run again: the host inputs (in _leaves order) copied into its buffers, its
    launches replayed, its logits copied back (the one synchronisation)."""
    stream = plan.replay.stream or 0
    for device_array, host_array in zip(plan.inputs, host):
        device_array.copy_to_device(np.ascontiguousarray(host_array), stream=stream)
    plan.replay.run()
    logits = plan.logits.copy_to_host(stream=stream)
    if stream:
        stream.synchronize()
    return logits


def _pool_arrays(kv_of, n_layer: int, pad: np.ndarray | None = None) -> list[np.ndarray]:
    """The host arrays of the pool's KVViews (kv_pos, slots, row_seq, tables of each group),
    each once, in layer order: what a rows pass uploads. pad: the rows of a padded batch (the
    per-row slots and row_seq taken at them)."""
    arrays, seen = [], set()
    for il in range(n_layer):
        _, _, kv_pos, slots, _, (row_seq, tables, _, _), _ = kv_of(il)
        for a, per_row in ((kv_pos, False), (slots, True), (row_seq, True), (tables, False)):
            if id(a) not in seen:
                seen.add(id(a))
                arrays.append(a[pad] if per_row and pad is not None else a)
    return arrays


def _device_views(kv_of, n_layer: int, device_arrays: list) -> list[DeviceKV]:
    """Each layer's DeviceKV: kv_of's views with their host arrays replaced by device_arrays
    (uploaded in _pool_arrays order)."""
    index, views = {}, []
    for il in range(n_layer):
        k, v, kv_pos, slots, n_keep, (row_seq, tables, shift, n_slots), _ = kv_of(il)
        for a in (kv_pos, slots, row_seq, tables):
            index.setdefault(id(a), len(index))
        d = [device_arrays[index[id(a)]] for a in (kv_pos, slots, row_seq, tables)]
        views.append(DeviceKV(k, v, d[0], d[1], n_keep, DevicePaging(d[2], d[3], shift, n_slots)))
    return views


def _pool_key(kv_of) -> tuple:
    """What identifies a pool's device arrays (those a recorded step reads): its first layer's."""
    k, v = kv_of(0)[:2]
    return id(k), id(v)


def _leaves(tree) -> list:
    """The arrays of nested tuples, lists and dicts, in order (a dict's in insertion order)."""
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in _leaves(item)]
    return [tree]


def _map_leaves(fn, tree):
    """The same nesting with fn applied to each array, in _leaves order."""
    if isinstance(tree, dict):
        return {key: _map_leaves(fn, value) for key, value in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map_leaves(fn, item) for item in tree)
    return fn(tree)


def _device_zeros(shape: tuple[int, ...]):
    """float16 zeros set on the device: a scheduler's pool can be tens of GB, which a copy of
    host zeros would send over the bus."""
    out = cuda.device_array(shape, np.float16)
    if out.size:
        device_memset(out, 0, out.nbytes)
    return out


def _device_copy(array):
    out = cuda.device_array_like(array)
    out.copy_to_device(array)
    return out


class CudaBackend(Backend):
    """An architecture's weights on the device and its forward pass there (the shared loop of
    base.Backend over kernels/cuda/layers.py)."""

    device = "cuda"
    missing = {"imatrix": "the importance matrix"}
    _lock = threading.Lock()  # the ops' buffer pool serves one forward pass at a time

    def __init__(self, arch, cache_types: tuple[str, str] = F16_CACHE, progress=None):
        if arch.cpu_only():
            raise UnsupportedError(f"{arch.name} models ({arch.cpu_only()}) run on the CPU only yet: use device 'cpu'")
        if arch.hp.head_dim > MAX_HEAD_DIM:
            raise ModelError(f"heads of {arch.hp.head_dim} values are larger than the CUDA attention "
                             f"takes ({MAX_HEAD_DIM})")
        if cache_types != F16_CACHE:
            raise MinillmError("a quantized KV cache runs on the CPU only: use device 'cpu', or f16 cache types")
        if REPLAY not in ("auto", "off", *REPLAY_MODES):
            raise MinillmError(f"MINILLM_CUDA_REPLAY={REPLAY!r}: choose auto, off or one of {', '.join(REPLAY_MODES)}")
        super().__init__(arch, cache_types, progress)
        self.layer_function = self.layer_with_ops(cuda_layers)
        self._kept = []  # the pass's device buffers that outlive a layer (positions, slots, tables)
        self._row_plans: dict[int, RowsPlan] = {}  # recorded scheduler steps by their (padded) row count

    # -- weights ---------------------------------------------------------------------
    def vector(self, name: str):
        return cuda.to_device(np.ascontiguousarray(self.arch.vector(name)))

    def matrix(self, name: str, rows: tuple[int, int] | None = None) -> DeviceMatrix:
        """The tensor's matrix on the device, or rows [r0, r1) of it (part of a fused tensor)."""
        gguf = self.arch.gguf
        info = gguf.tensors[name]
        r0, r1 = rows or (0, info.shape[1])
        fmt, raw, n_cols = info.format, gguf.raw(name)[r0:r1], info.shape[0]
        if fmt.quantized and n_cols > MAX_K:
            raise ModelError(f"tensor '{name}': rows of {n_cols} values are longer than the CUDA "
                             f"kernels quantize ({MAX_K})")
        if fmt.quantized:
            matrix = DeviceMatrix(upload_blocks(fmt, raw, n_cols), KIND_IDS[fmt.activation])  # as in the file
        else:
            matrix = DeviceMatrix(upload_float_matrix(dequantize(fmt, raw, n_cols), fmt.name), FLOAT_KIND)
        gguf.release_pages(name)
        return matrix

    def weight_bytes(self) -> int:
        """Device bytes the weights take (quantized blocks as in the file, floats as uploaded)."""
        def nbytes(item) -> int:
            if isinstance(item, DeviceMatrix):
                return item.weights.raw.nbytes if item.weights_are_blocks else item.weights.weight.nbytes
            return item.nbytes

        return sum(nbytes(item) for layer in self.layers for item in layer) + nbytes(self.output) + \
            nbytes(self.output_norm)

    # -- caches and forward passes ----------------------------------------------------
    def new_cache(self, n_ctx: int, n_keep: int = 0, batch_size: int = 512) -> CudaKVCache:
        """As the CPU's, with the keys and values on the device."""
        hp = self.hp
        sizes, layout = self.arch.cache_layout(n_ctx, min(batch_size, n_ctx))
        return CudaKVCache(hp.n_layer, hp.n_head_kv, hp.head_dim, sizes, layout, n_keep)

    def pool_arrays(self, row_counts: list[int], cache_type: str) -> list:
        """float16 device arrays (CudaBackend takes f16 caches only)."""
        return [_device_zeros((n, self.hp.n_head_kv, self.hp.head_dim)) for n in row_counts]

    def pool_budget(self) -> int | None:
        """POOL_SHARE of the device memory free now (the rest for the passes' buffers); None
        where the device does not say (the simulator)."""
        free = cuda.current_context().get_memory_info().free
        return int(free * POOL_SHARE) if np.isfinite(free) else None

    def forward_rows(self, ids: np.ndarray, positions: np.ndarray, kv_of, out_from: int, n_ctx: int) -> np.ndarray:
        """Backend.forward_rows on the GPU: each row's products by the matrix-vector kernels
        (a lone token's path), its attention a lone query's over its sequence's cells (the
        pool's block tables, kv_pos and the rows' slots uploaded once for the pass). A step
        whose every row wants its logits (decode steps) of at most MAX_REPLAYED_ROWS rows is
        replayed from a recording (_replayed_rows)."""
        with self._lock:
            if out_from == 0 and len(ids) <= MAX_REPLAYED_ROWS and REPLAY != "off":
                return self._replayed_rows(ids, positions, kv_of, n_ctx)
            with self._rows_alone():
                inputs = self.upload((self.step_inputs(ids, positions, n_ctx), _pool_arrays(kv_of, self.hp.n_layer)))
                return self._logits_to_host(self._rows_pass(inputs, kv_of, out_from))

    def _rows_pass(self, inputs, kv_of, out_from: int):
        """The layers and logits (on the device) of a rows pass from its inputs on the device:
        ((x, rope tables, positions), the pool's host arrays in _pool_arrays order)."""
        (x, tables, positions), pool_inputs = inputs
        views = _device_views(kv_of, self.hp.n_layer, pool_inputs)
        x = self.layers_from(x, tables, positions, views.__getitem__, out_from, self.layers)
        return self.device_logits(x)

    def _replayed_rows(self, ids: np.ndarray, positions: np.ndarray, kv_of, n_ctx: int) -> np.ndarray:
        """forward_rows for rows that all want logits, padded to a power of two B by repeating the
        last row (a copy computes what its row does and writes the same cell with the same
        values; every row's results are its own), through the recorded pass of B rows over this
        pool: its host inputs copied into the recording's buffers, one replay, one copy back."""
        T = len(ids)
        B = 1 << max(0, T - 1).bit_length()
        pad = np.r_[np.arange(T), np.full(B - T, T - 1)]
        pool = _pool_arrays(kv_of, self.hp.n_layer, pad)
        host = _leaves((self.step_inputs(ids[pad], positions[pad], n_ctx), pool))
        plan = self._row_plans.get(B)
        if plan is None or plan.skipped_layers != self.skipped_layers or plan.pool_key != _pool_key(kv_of) or \
                [h.shape for h in host] != [d.shape for d in plan.inputs]:
            plan = self._record_rows(ids[pad], positions[pad], kv_of, n_ctx, pad)  # (this step, run)
            return self.arch.finish_logits(plan.logits.copy_to_host()[:T])
        return self.arch.finish_logits(_replayed(plan, host)[:T])

    def _record_rows(self, ids, positions, kv_of, n_ctx: int, pad: np.ndarray) -> RowsPlan:
        """A rows pass of len(ids) rows (padded: pad) run while its launches are recorded, on
        buffers of its own: the plan later steps of as many rows replay (kept per row count, for
        one pool at a time)."""
        key = _pool_key(kv_of)
        if any(p.pool_key != key for p in self._row_plans.values()):
            self._row_plans = {}  # another pool (a new scheduler): the old one's recordings go
        buffers = cuda_layers.BufferPool()
        with cuda_layers.using_pool(buffers), recording() as launches, self._rows_alone():
            inputs = self.upload((self.step_inputs(ids, positions, n_ctx), _pool_arrays(kv_of, self.hp.n_layer, pad)))
            logits = self._rows_pass(inputs, kv_of, 0)
        plan = RowsPlan(self.skipped_layers, key, buffers, _leaves(inputs), logits,
                        Replay(launches, new_stream(), REPLAY))
        self._row_plans[len(ids)] = plan
        return plan

    @contextlib.contextmanager
    def _rows_alone(self):
        """A pass whose rows are each computed as a lone token's (cuda_layers.rows_alone); its
        buffers go back to the pool after it."""
        try:
            with cuda_layers.rows_alone():
                yield
        finally:
            self._kept = []
            cuda_layers.recycle()

    def forward_each_alone(self, ids: np.ndarray, cache: CudaKVCache) -> np.ndarray:
        """Logits (T, V) of ids at the cache's next positions, each row what forward() gives that
        token alone after the rows before it (speculative verification): forward_rows' kernels
        over the cache's own slots. Only within cache.headroom()."""
        with self._lock, self._rows_alone():
            positions = cache.reserve(len(ids))
            slots, (x, tables, positions), row_seq, no_table = self.upload((
                cache.batch_slots(), self.step_inputs(ids, positions, cache.n_ctx),
                np.zeros(len(ids), np.int64), np.zeros((1, 1), np.int64)))
            cache.device_slots = slots

            def alone(il: int) -> DeviceKV:
                n_slots = cache.groups[cache.layer_groups[il]].n_slots
                return cache.device_kv(il)._replace(paging=DevicePaging(row_seq, no_table, -1, n_slots))

            x = self.layers_from(x, tables, positions, alone, 0, self.layers)
            cache.commit(len(ids))
            return self._logits_to_host(self.device_logits(x))

    def forward(self, ids: np.ndarray, cache: CudaKVCache, logits_from: int) -> np.ndarray:
        with self._lock:
            if len(ids) == 1 and logits_from == 0 and REPLAY != "off":
                return self._decode_step(ids, cache)
            try:
                logits, _ = self._pass(ids, cache, logits_from)
                return self._logits_to_host(logits)
            finally:
                self._kept = []
                cuda_layers.recycle()

    def _pass(self, ids: np.ndarray, cache: CudaKVCache, logits_from: int):
        """One forward pass issued on the device: (logits (T - logits_from, V) on the device or
        None, the device buffers its host inputs were copied into, in _leaves order)."""
        positions = cache.reserve(len(ids))
        slots, (x, tables, positions) = self.upload((cache.batch_slots(), self.step_inputs(ids, positions, cache.n_ctx)))
        cache.device_slots = slots
        x = self.layers_from(x, tables, positions, cache.device_kv, 0, self.layers)
        cache.commit(len(ids))
        return self.device_logits(x[logits_from:] if logits_from else x), list(self._kept)

    def _decode_step(self, ids: np.ndarray, cache: CudaKVCache) -> np.ndarray:
        """One token: the cache's recorded step replayed with this token's inputs (recorded on
        the cache's first step, and again when what it depends on changed)."""
        plan = cache.step_plan
        if plan is None or plan.skipped_layers != self.skipped_layers:
            return self._record_step(ids, cache)
        positions = cache.reserve(1)
        host = _leaves((cache.batch_slots(), self.step_inputs(ids, positions, cache.n_ctx)))
        if [h.shape for h in host] != [d.shape for d in plan.inputs]:
            return self._record_step(ids, cache)
        logits = _replayed(plan, host)
        cache.commit(1)
        return self.arch.finish_logits(logits)

    def _record_step(self, ids: np.ndarray, cache: CudaKVCache) -> np.ndarray:
        """A decode step run while its launches are recorded, on buffers of its own: the plan
        that replays it."""
        cache.step_plan = None
        pool = cuda_layers.BufferPool()
        try:
            with cuda_layers.using_pool(pool), recording() as launches:
                logits, inputs = self._pass(ids, cache, 0)
        finally:
            self._kept = []
        cache.step_plan = StepPlan(self.skipped_layers, pool, inputs, logits,
                                   Replay(launches, new_stream(), REPLAY))
        return self._logits_to_host(logits)

    def upload(self, inputs):
        """Pooled device copies of the host arrays (in tuples and dicts), kept through the pass."""
        def copy(host):
            device_array = cuda_layers.POOL.upload(host)
            self._kept.append(device_array)
            return device_array

        return _map_leaves(copy, inputs)

    def layer_done(self, x) -> None:
        cuda_layers.recycle(keep=(x, *self._kept))

    def device_logits(self, x):
        """Logits (T, V) of hidden states x (T, E), on the device (None for no rows)."""
        if x.shape[0] == 0:
            return None
        xn = cuda_layers.norm(x, self.output_norm, np.float32(self.hp.rms_eps))  # (the last layer's add with it)
        return cuda_layers.linear(self.output, xn)

    def _logits_to_host(self, logits) -> np.ndarray:
        if logits is None:
            return np.empty((0, self.hp.n_vocab), np.float32)
        return self.arch.finish_logits(logits.copy_to_host())

    def warm_up(self, on_compile=None) -> None:
        """Compile the kernels (numba compiles each on its first launch, or loads it from its
        cache): a one-token step (matrix-vector kernels) and a short batch (tiled kernels),
        inside on_compile() when given and they are not cached. A toolchain that cannot compile
        them (a numba-cuda that does not work with the installed numpy, a missing NVVM) is one
        MinillmError that names the versions."""
        cached = on_compile is None or self.kernels_cached()
        try:
            with contextlib.nullcontext() if cached else on_compile():
                for n in (1, MATVEC_MAX_T + 1):
                    self.forward(np.zeros(n, np.int64), self.new_cache(n), n - 1)
        except MinillmError:
            raise
        except Exception as exc:  # noqa: BLE001 (whatever the CUDA toolchain raises)
            from importlib.metadata import version

            raise MinillmError(f"the CUDA kernels do not compile with numba-cuda {version('numba-cuda')}, "
                               f"numba {version('numba')} and numpy {np.__version__} ({type(exc).__name__}: "
                               f"{exc})") from exc

    @staticmethod
    def kernels_cached() -> bool:
        """Whether numba-cuda's on-disk cache holds the decode product for the current sources
        (read as numba-cuda reads its index; the simulator compiles nothing)."""
        if SIMULATOR:
            return True
        try:
            return bool(qmatvec_kernel._cache._cache_file._load_index())
        except (AttributeError, OSError):  # another numba-cuda: say we compile
            return False
