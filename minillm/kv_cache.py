"""The KV cache: ring buffers of keys and values, with logical positions kept apart from slots.

Layers share a *group* when they keep the same span of history: Gemma 3's local layers only
need their sliding window, so their group is a small ring; global layers (and every Llama
layer) use the context-sized group. A group's slots are

    [0, n_keep)            the first n_keep tokens ever evaluated (attention sinks), kept for good
    [n_keep, n_slots)      a ring for the rest: position p lives in slot n_keep + (p - n_keep) % ring

kv_pos (n_slots,) maps slot -> logical position (-1 = empty); attention masks by position (causal,
sliding window), never by slot order, and RoPE uses the logical position. Once a ring wraps, the
oldest tokens are forgotten: decoding goes on with flat memory however long it runs.
"""
from __future__ import annotations

import numpy as np

from .errors import MinillmError
from .kernels.cpu.lanes import aligned_zeros
from .kernels.cpu.layers import Paging, plain

# llama.cpp's -ctk/-ctv names -> (cache dtype, row length for head_dim values): F16 as bit
# patterns, the block formats as their bytes (kernels/cpu/attention_q.py)
CACHE_TYPES = {
    "f16": (np.uint16, lambda head_dim: head_dim),
    "q8_0": (np.uint8, lambda head_dim: head_dim // 32 * 34),
    "q4_0": (np.uint8, lambda head_dim: head_dim // 32 * 18),
}
F16_CACHE = ("f16", "f16")


def check_cache_types(types: tuple[str, str], head_dim: int) -> tuple[str, str]:
    """(K type, V type) as given to -ctk/-ctv, checked: known names, both F16 or both quantized
    (the mixed kernels are not built), and heads of whole 32-value blocks."""
    types = tuple(t.lower() for t in types)
    for name, param in zip(types, ("cache_types[0]", "cache_types[1]")):
        if name not in CACHE_TYPES:
            raise MinillmError(f"{param} {name}: expected one of {', '.join(CACHE_TYPES)}", (param,))
    if (types[0] == "f16") != (types[1] == "f16"):
        raise MinillmError(f"K and V caches of types {types[0]} and {types[1]}: both f16, or both quantized "
                           "(q8_0, q4_0), are supported")
    if types[0] != "f16" and head_dim % 32:
        raise MinillmError(f"a quantized KV cache needs heads of a multiple of 32 values; this model's have {head_dim}")
    return types


def cache_arrays(row_counts: list[int], n_head_kv: int, head_dim: int, cache_type: str,
                 huge_pages: bool = False) -> list[np.ndarray]:
    """Zeroed (rows, n_head_kv, row length) arrays for the keys or the values of each layer
    (row_counts: each layer's rows), whose pages are taken only as cells are written. With
    huge_pages, views of one region of huge pages (aligned_zeros): fewer TLB misses when a
    batch's rows walk every layer's cells, but pages of 2 MiB rather than 4 KiB."""
    dtype, row = CACHE_TYPES[cache_type]
    if not huge_pages:
        return [np.zeros((n, n_head_kv, row(head_dim)), dtype) for n in row_counts]
    row_bytes = n_head_kv * row(head_dim) * np.dtype(dtype).itemsize
    sizes = [-(-n * row_bytes // 64) * 64 for n in row_counts]  # each layer's array on a cache line
    region = aligned_zeros(sum(sizes), populate=False)
    starts = np.cumsum([0] + sizes)
    return [region[at:at + n * row_bytes].view(dtype).reshape(n, n_head_kv, row(head_dim))
            for at, n in zip(starts, row_counts)]


def cache_bytes(n_cells: int, n_head_kv: int, head_dim: int, cache_type: str) -> int:
    dtype, row = CACHE_TYPES[cache_type]
    return n_cells * n_head_kv * row(head_dim) * np.dtype(dtype).itemsize


class CacheGroup:
    def __init__(self, n_slots: int, n_keep: int, window: int = 0):
        if n_keep >= n_slots:
            raise ValueError(f"n_keep {n_keep} must be smaller than the cache size {n_slots}")
        self.n_slots, self.n_keep = n_slots, n_keep
        self.window = window  # the layers' sliding window (0 = they attend to everything kept)
        self.kv_pos = np.full(n_slots, -1, np.int64)  # (S,) logical position held by each slot

    def headroom(self, n_past: int) -> int:
        """How many tokens can be evaluated past n_past and taken back again (rewind) without
        overwriting a cell that one of them, or a later token, attends to."""
        spare = self.n_slots - self.n_keep - self.window
        if self.window and spare > 0:  # a ring larger than the window: its spare slots
            return spare
        return max(0, self.n_slots - n_past)  # until the ring wraps

    def slots_for(self, positions: np.ndarray) -> np.ndarray:
        ring = self.n_slots - self.n_keep
        return np.where(positions < self.n_keep, positions,
                        self.n_keep + (positions - self.n_keep) % ring)


class KVCache:
    """Keys and values for every layer; `layer_groups[il]` names the group of layer il (None: a
    recurrent layer, whose memory is `recurrent`'s instead)."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, group_sizes: dict[str, int],
                 layer_groups: list[str | None], n_keep: int = 0, windows: dict[str, int] | None = None,
                 cache_types: tuple[str, str] = F16_CACHE, recurrent=None):
        # sinks only matter where attention is unlimited; windowed groups never see them
        windows = windows or {}
        self.groups = {name: CacheGroup(size, min(n_keep, size // 2) if name == "global" else 0,
                                        windows.get(name, 0))
                       for name, size in group_sizes.items()}
        self.layer_groups = layer_groups
        # per layer: (S, Hkv, D) uint16, float16 bit patterns (llama.cpp's F16 cache), or
        # (S, Hkv, D/32 * block bytes) uint8 for q8_0/q4_0; S = its group's size
        self.cache_types = cache_types
        rows = [group_sizes[g] if g else 0 for g in layer_groups]
        self.k = cache_arrays(rows, n_head_kv, head_dim, cache_types[0])
        self.v = cache_arrays(rows, n_head_kv, head_dim, cache_types[1])
        self.recurrent = recurrent  # a RecurrentState (recurrent_state.py), or None
        self.n_past = 0      # tokens evaluated so far: the next token's logical position
        self._slots = {}     # group -> slots of the batch being evaluated

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v) + (self.recurrent.nbytes if self.recurrent else 0)

    @property
    def n_ctx(self) -> int:
        return max(g.n_slots for g in self.groups.values())

    @property
    def wrapped(self) -> bool:
        """True once some tokens have been forgotten by a ring."""
        return any(self.n_past > g.n_slots for g in self.groups.values())

    def reserve(self, n: int) -> np.ndarray:
        """Positions of the next n tokens; computes each group's slots for them."""
        positions = np.arange(self.n_past, self.n_past + n, dtype=np.int64)
        if self.recurrent is not None:
            if self.n_past + n > self.n_ctx:
                raise MinillmError(f"the context of {self.n_ctx} tokens is full: a model with recurrent layers "
                                   f"cannot drop its oldest tokens to go on; raise n_ctx", ("n_ctx",))
            self.recurrent.rows = np.zeros(n, np.int64)  # every row the one sequence's
        for name, group in self.groups.items():
            if n > group.n_slots - group.n_keep:
                raise ValueError(f"a batch of {n} tokens does not fit the {name} cache ring")
            self._slots[name] = group.slots_for(positions)
        return positions

    def commit(self, n: int) -> None:
        self.n_past += n

    def paging(self, il: int, n_rows: int) -> tuple:
        """Layer il's own slots as attention_rows reads a pool (no block table: shift -1), for
        rows each computed as a lone token (CpuBackend.forward_each_alone)."""
        group = self.groups[self.layer_groups[il] or "global"]
        return plain(Paging(np.zeros(n_rows, np.int64), np.zeros((1, 1), np.int64), -1, group.n_slots))

    def layer(self, il: int):
        """(k (S, Hkv, D), v (S, Hkv, D), its CacheGroup, slots of this batch) for layer il (a
        recurrent layer: empty k and v, the global group, its slots)."""
        name = self.layer_groups[il] or "global"
        return self.k[il], self.v[il], self.groups[name], self._slots[name]

    def truncate(self, n: int) -> int:
        """Forget every token at position >= n (to re-evaluate from there); the tokens kept: n,
        or, with recurrent state, the position of its latest snapshot at or before n (0 where
        there is none: every token evaluated again)."""
        if self.wrapped and n < self.n_past:
            raise ValueError("cannot rewind a cache whose ring has wrapped")
        if self.recurrent is not None and n < self.n_past:
            n = self.recurrent.restore(n)
            if n is None:
                n = 0
                self.recurrent.clear()
            self._rewind(n)
            return n
        self.rewind(n)
        return n

    def headroom(self) -> int:
        """Tokens that can be evaluated and then taken back (speculative decoding): with rewind,
        or, with recurrent state, with truncate to a snapshot taken before them."""
        return min(g.headroom(self.n_past) for g in self.groups.values())

    def rewind(self, n: int) -> None:
        """Forget the tokens at positions >= n: any n before the ring wraps, or the last few
        tokens evaluated within headroom()."""
        if self.recurrent is not None and n < self.n_past:
            raise ValueError("recurrent state cannot be rewound: truncate to a snapshot instead")
        self._rewind(n)

    def _rewind(self, n: int) -> None:
        """The cells' part of rewind: positions >= n forgotten."""
        for group in self.groups.values():
            group.kv_pos[group.kv_pos >= n] = -1
        self.n_past = min(self.n_past, n)

    def clear(self) -> None:
        self.truncate(0)
        if self.recurrent is not None:
            self.recurrent.clear()
