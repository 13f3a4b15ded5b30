"""The KV cache: per layer, keys and values of every cached position, in slots.

A slot holds the token at a logical position; kv_pos (S,) maps slot -> position (-1 for
an empty slot), so attention masks by position, never by slot order.
"""
from __future__ import annotations

import numpy as np


class KVCache:
    def __init__(self, n_layer: int, n_slots: int, n_head_kv: int, head_dim: int):
        self.n_slots = n_slots
        # (layer) x (S, Hkv, D) float32 holding f16-rounded values
        self.k = [np.zeros((n_slots, n_head_kv, head_dim), np.float32) for _ in range(n_layer)]
        self.v = [np.zeros((n_slots, n_head_kv, head_dim), np.float32) for _ in range(n_layer)]
        self.kv_pos = [np.full(n_slots, -1, np.int64) for _ in range(n_layer)]
        self.n_past = 0  # tokens evaluated so far: the next token's position

    def reserve(self, n: int):
        """Positions and slots for the next n tokens."""
        if self.n_past + n > self.n_slots:
            raise ValueError(f"KV cache full: {self.n_past} + {n} tokens > {self.n_slots} slots")
        positions = np.arange(self.n_past, self.n_past + n, dtype=np.int64)
        return positions, positions.copy()

    def commit(self, n: int) -> None:
        self.n_past += n

    def layer(self, il: int):
        return self.k[il], self.v[il], self.kv_pos[il]

    def n_used(self, il: int, slots: np.ndarray) -> int:
        return int(max(self.n_past, slots.max() + 1))
