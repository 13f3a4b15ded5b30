"""A sequence's memory in its recurrent layers: fixed-size state carried from token to token.

Where an attention layer keeps every token's keys and values (kv_cache.py), a recurrent layer
(Qwen3.5's gated delta net) keeps per sequence
    conv  (Kc - 1, C)   the last inputs of the channels' causal convolution
    ssm   (Hv, S, S)    each value head's state matrix (kernels/cpu/delta_net.py's layout)
whose size does not grow with the context. Such state cannot forget its last tokens: a
sequence cut back to a prefix is cut to a snapshot taken at that prefix's end, or evaluated
again from its start (KVCache.truncate says which).
"""
from __future__ import annotations

import numpy as np

_NO_CONV = np.zeros((0, 0, 0), np.float32)
_NO_SSM = np.zeros((0, 0, 0, 0), np.float32)


class RecurrentState:
    """The recurrent layers' state of n_seqs sequences (one for a KVCache, a slot's each in the
    scheduler's pool); `rows` names each row's sequence in the batch being evaluated."""

    def __init__(self, layers: list[int], conv_shape: tuple, ssm_shape: tuple, n_seqs: int = 1):
        self.conv = {il: np.zeros((n_seqs, *conv_shape), np.float32) for il in layers}  # il -> (n, Kc-1, C)
        self.ssm = {il: np.zeros((n_seqs, *ssm_shape), np.float32) for il in layers}    # il -> (n, Hv, S, S)
        self.rows = np.zeros(0, np.int64)  # (T,) each row's sequence
        self.snapshots: dict[int, tuple] = {}  # n_past -> (conv, ssm) copies at that position (one sequence)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.conv.values(), *self.ssm.values()))

    def layer(self, il: int) -> tuple:
        """(conv states, state matrices, each row's sequence) of layer il, the states written in
        place by its pass; empty states for an attention layer."""
        return self.conv.get(il, _NO_CONV), self.ssm.get(il, _NO_SSM), self.rows

    def save(self, n_past: int, keep: int = 2) -> None:
        """Keep a copy of the state as it is after n_past tokens (the last `keep` such copies)."""
        self.snapshots[n_past] = ({il: a.copy() for il, a in self.conv.items()},
                                  {il: a.copy() for il, a in self.ssm.items()})
        for old in sorted(self.snapshots)[:-keep]:
            del self.snapshots[old]

    def restore(self, n_past: int) -> int | None:
        """Put back the latest state saved after at most n_past tokens: its position, or None
        (nothing changed) if none was."""
        at = max((n for n in self.snapshots if n <= n_past), default=None)
        if at is None:
            return None
        conv, ssm = self.snapshots[at]
        for il, a in conv.items():
            self.conv[il][...] = a
        for il, a in ssm.items():
            self.ssm[il][...] = a
        self.snapshots = {n: s for n, s in self.snapshots.items() if n <= at}
        return at

    def forget(self, n_past: int) -> None:
        """Drop the snapshot after n_past tokens, if there is one."""
        self.snapshots.pop(n_past, None)

    def copy_seq(self, seq: int) -> tuple:
        """Sequence seq's state as it is now: (conv, ssm) copies, per layer."""
        return ({il: a[seq].copy() for il, a in self.conv.items()}, {il: a[seq].copy() for il, a in self.ssm.items()})

    def put_seq(self, seq: int, saved: tuple) -> None:
        """Put back a state copy_seq took of sequence seq."""
        conv, ssm = saved
        for il, a in conv.items():
            self.conv[il][seq] = a
        for il, a in ssm.items():
            self.ssm[il][seq] = a

    def clear(self, seq: int | None = None) -> None:
        """Zero every sequence's state (and forget the snapshots), or sequence seq's."""
        for a in (*self.conv.values(), *self.ssm.values()):
            if seq is None:
                a[...] = 0
            else:
                a[seq] = 0
        if seq is None:
            self.snapshots.clear()
