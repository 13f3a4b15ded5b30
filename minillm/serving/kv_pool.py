"""The KV store of the batching scheduler: one pool of cells shared by many sequences, handed
out in blocks as sequences grow (paged, as vLLM does), so that slots with a long context do not
reserve it up front.

Each cache group (see kv_cache.py: the context-sized "global" group, Gemma 3's "local" windows)
has its own pool. A sequence (a *slot*, 0..n_seqs-1) sees a group as n_slots slots, exactly
as a lone sequence's ring buffer (position p in slot p, or p % n_slots in a window's ring), and
its block table maps slot s to pool row table[s >> SHIFT] * BLOCK + s % BLOCK. Attention reads
the cells through the table (kernels/cpu/attention.py, attention_rows).

Sequences here never run past their context (the scheduler stops them there), so the global
group never wraps and no attention sinks are needed.

A model with recurrent layers (layer group None) keeps each slot's recurrent state beside its
cells (`recurrent`, a RecurrentState of n_seqs sequences): the state after the slot's last
token, which cannot be cut back to a prefix. Such a pool reuses a slot's cells and state only
for a job that continues all of it (`reusable_prefix`: a chat's next turn, a preempted request
back in its slot); else the slot's state starts again with its cells.
"""
from __future__ import annotations

import numpy as np

from ..errors import MinillmError
from ..kernels.cpu.layers import KVView, Paging, plain
from ..kv_cache import F16_CACHE, cache_bytes
from ..recurrent_state import RecurrentState

SHIFT = 4
BLOCK = 1 << SHIFT  # cells per block


class PoolGroup:
    """One group's pool: blocks of BLOCK rows, a block table per sequence, a free list."""

    def __init__(self, n_slots: int, n_blocks: int, n_seqs: int, windowed: bool):
        self.n_slots = n_slots                                   # slots a sequence sees
        self.windowed = windowed                                 # a ring smaller than the context
        self.n_blocks = n_blocks
        self.width = -(-n_slots // BLOCK)                        # blocks a table can name
        self.tables = np.full((n_seqs, self.width), -1, np.int64)  # (n_seqs, width) block ids, -1 = none
        self.kv_pos = np.full(n_blocks * BLOCK, -1, np.int64)    # (rows,) position held by each pool row
        self.free = list(range(n_blocks - 1, -1, -1))            # free block ids (pop from the end)

    def slot_of(self, positions: np.ndarray) -> np.ndarray:
        return positions % self.n_slots if self.windowed else positions

    def blocks_needed(self, seq: int, start: int, stop: int) -> list[int]:
        """The table entries positions [start, stop) of seq write to that have no block yet."""
        if stop <= start:
            return []
        slots = self.slot_of(np.arange(start, stop, dtype=np.int64))
        entries = np.unique(slots >> SHIFT)
        return [int(e) for e in entries if self.tables[seq, e] < 0]

    def assign(self, seq: int, entries: list[int]) -> None:
        for e in entries:
            block = self.free.pop()
            self.kv_pos[block * BLOCK:(block + 1) * BLOCK] = -1
            self.tables[seq, e] = block

    def rows_of(self, seq: int, positions: np.ndarray) -> np.ndarray:
        """Pool rows where seq's positions live (blocks assigned)."""
        slots = self.slot_of(positions)
        return (self.tables[seq, slots >> SHIFT] << SHIFT) | (slots & (BLOCK - 1))

    def release(self, seq: int, keep: int = 0) -> None:
        """Forget seq's positions from `keep` on and give back the blocks left empty. With keep
        > 0 the sequence must not have wrapped a ring (slot = position: see KVPool.reusable)."""
        first = -(-keep // BLOCK)  # the first table entry holding no kept position
        for e in range(first, self.width):
            block = self.tables[seq, e]
            if block >= 0:
                self.free.append(int(block))
                self.tables[seq, e] = -1
        if keep % BLOCK:
            self.kv_pos[self.rows_of(seq, np.arange(keep, first * BLOCK, dtype=np.int64))] = -1

    def blocks_held(self, seq: int) -> int:
        return int((self.tables[seq] >= 0).sum())


class KVPool:
    """Keys and values of every layer for n_seqs sequences of up to n_ctx positions each, in
    pools of n_cells cells (the global group; windowed groups get what their rings need)."""

    def __init__(self, backend, n_seqs: int, n_ctx: int, n_cells: int, n_batch: int,
                 cache_types: tuple[str, str] = F16_CACHE):
        """backend: the model's, whose pool_arrays hold the keys and values where its kernels
        read them (host memory, or the GPU's)."""
        arch = backend.arch
        sizes, self.layer_groups = arch.cache_layout(n_ctx, n_batch)
        self.n_seqs, self.n_ctx = n_seqs, n_ctx
        self.groups: dict[str, PoolGroup] = {}
        for name, size in sizes.items():
            windowed = size < n_ctx
            n_blocks = n_seqs * -(-size // BLOCK) if windowed else max(-(-n_cells // BLOCK), -(-size // BLOCK))
            self.groups[name] = PoolGroup(size, n_blocks, n_seqs, windowed)
        # per layer: (rows, Hkv, D) float16 (on the CPU uint16 bit patterns, or (rows, Hkv,
        # D/32 * block bytes) uint8 for a quantized cache: kv_cache.py); host pages are touched
        # only when written
        rows = [self.groups[g].n_blocks * BLOCK if g else 0 for g in self.layer_groups]
        self.k = backend.pool_arrays(rows, cache_types[0])
        self.v = backend.pool_arrays(rows, cache_types[1])
        self.attend_fn = backend.attention_address(self.k[0].dtype)
        recurrent = arch.recurrent_shapes()
        self.recurrent = RecurrentState(*recurrent, n_seqs=n_seqs) if recurrent else None

    @staticmethod
    def cells_within(arch, n_seqs: int, n_ctx: int, n_batch: int, cache_types, budget: int) -> int:
        """The most cells of the context-sized pool whose whole pool (the windowed layers' rings
        included) takes at most `budget` bytes; a quantized cache gets more cells. MinillmError
        if that is not one context of n_ctx (one request must fit alone)."""
        hp = arch.hp
        sizes, layer_groups = arch.cache_layout(n_ctx, n_batch)

        def layer_bytes(n_cells: int) -> int:     # one layer's K and V
            return sum(cache_bytes(n_cells, hp.n_head_kv, hp.head_dim, t) for t in cache_types)

        fixed = sum(layer_bytes(n_seqs * -(-sizes[g] // BLOCK) * BLOCK) for g in layer_groups
                    if g and sizes[g] < n_ctx)
        per_cell = sum(layer_bytes(1) for g in layer_groups if g and sizes[g] >= n_ctx)
        cells = max(0, budget - fixed) // per_cell // BLOCK * BLOCK
        if cells < n_ctx:
            need = fixed + per_cell * -(-n_ctx // BLOCK) * BLOCK
            raise MinillmError(f"a KV memory of {budget / 2**20:.1f} MiB holds {cells} cells of {'/'.join(cache_types)}, "
                               f"less than one context of {n_ctx}: it needs {need / 2**20:.1f} MiB")
        return cells

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool (reserved; pages are touched as sequences write them)."""
        return sum(a.nbytes for a in self.k + self.v) + (self.recurrent.nbytes if self.recurrent else 0)

    @property
    def n_cells(self) -> int:
        """Cells of the context-sized pool: the figure admission is bounded by."""
        return max(g.n_blocks for g in self.groups.values() if not g.windowed) * BLOCK

    @property
    def free_cells(self) -> int:
        return min(len(g.free) for g in self.groups.values() if not g.windowed) * BLOCK

    def blocks_needed(self, seq: int, start: int, stop: int) -> dict[str, list[int]]:
        return {name: g.blocks_needed(seq, start, stop) for name, g in self.groups.items()}

    def can_assign(self, needed: dict[str, list[int]]) -> bool:
        return all(len(entries) <= len(self.groups[name].free) for name, entries in needed.items())

    def assign(self, seq: int, needed: dict[str, list[int]]) -> None:
        for name, entries in needed.items():
            self.groups[name].assign(seq, entries)

    def release(self, seq: int, keep: int = 0) -> None:
        """Free seq's cells from position `keep` on (all of them by default, its recurrent state
        with them; a recurrent pool keeps a prefix only whole: reusable_prefix)."""
        for g in self.groups.values():
            g.release(seq, keep)
        if self.recurrent is not None and keep == 0:
            self.recurrent.clear(seq)

    def blocks_held(self, seq: int) -> int:
        return sum(g.blocks_held(seq) for g in self.groups.values())

    def reusable_prefix(self, n_past: int, n_shared: int) -> int:
        """How many positions of a sequence of n_past a job that shares its first n_shared
        tokens keeps: all n_shared where the sequence can be cut back (no ring of it has
        wrapped: a wrapped ring has overwritten positions the prefix still needs); with
        recurrent state, which holds the whole sequence, n_past where the job shares all of it,
        else none."""
        if any(n_past > g.n_slots for g in self.groups.values()):
            return 0
        if self.recurrent is not None and n_shared != n_past:
            return 0
        return n_shared

    def batch_kv(self, row_seq: np.ndarray, positions: np.ndarray):
        """kv_of(il) for Backend.forward_rows: each layer's KVView for a batch of rows
        (row_seq (T,) their sequences, positions (T,)), their rows computed once per group.
        The rows' kv_pos are set here, as the kernels set them when they store the rows' keys
        (so that a backend whose kernels write a device copy keeps the host's right)."""
        views = {}
        for name, g in self.groups.items():
            rows = np.empty(len(positions), np.int64)
            for seq in np.unique(row_seq):
                sel = row_seq == seq
                rows[sel] = g.rows_of(int(seq), positions[sel])
            g.kv_pos[rows] = positions
            views[name] = (g.kv_pos, rows, plain(Paging(row_seq, g.tables, SHIFT, g.n_slots)))

        if self.recurrent is not None:
            self.recurrent.rows = row_seq

        def kv_of(il: int) -> tuple:
            kv_pos, rows, paging = views[self.layer_groups[il] or "global"]
            view = plain(KVView(self.k[il], self.v[il], kv_pos, rows, 0, paging, self.attend_fn))
            return view if self.recurrent is None else (view, *self.recurrent.layer(il))

        return kv_of
