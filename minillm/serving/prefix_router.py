"""Prefix-aware routing for `serve --replicas`: a request goes to the replica that already holds
the KV cells of the longest start of its prompt, unless that replica is busier than the least
busy one by more than `slack` requests; then, and for prompts no replica has seen, the least busy
replica takes it.

A prompt's text is cut into BLOCK-character blocks and each block's hash covers everything before
it (as a paged KV cache's block hashes do), so "replica r holds the first k blocks" is k lookups
in r's table. The router runs inside the gateway's process (Ray Serve builds one per handle) and
remembers what it sent where, up to TABLE_BLOCKS blocks a replica, least recently used first out.
"""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

BLOCK = 64                 # characters: about 16 tokens
MAX_BLOCKS = 256           # a prompt's first 16 K characters decide where it goes
TABLE_BLOCKS = 1 << 16     # blocks remembered per replica


def prompt_text(body) -> str:
    """The text a completion request's prompt starts with, as far as routing needs it: the chat
    messages' roles and contents in order, or the prompt (token ids as their numbers)."""
    if not isinstance(body, dict):
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"\x00{m.get('role')}\x00{_content_text(m.get('content'))}"
                       for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt)
    return prompt if isinstance(prompt, str) else ""


def _content_text(content) -> str:
    if isinstance(content, list):  # text parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def prefix_blocks(text: str) -> tuple[bytes, ...]:
    """Chained hashes of the text's whole BLOCK-character blocks: entry k stands for blocks 0..k."""
    hashes, chain = [], hashlib.blake2b(digest_size=8)
    for start in range(0, min(len(text) // BLOCK, MAX_BLOCKS) * BLOCK, BLOCK):
        chain.update(text[start:start + BLOCK].encode("utf-8", "surrogatepass"))
        hashes.append(chain.copy().digest())
    return tuple(hashes)


class PrefixTable:
    """The blocks one replica was sent, least recently used first."""

    def __init__(self, capacity: int = TABLE_BLOCKS):
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def matched(self, blocks: tuple[bytes, ...]) -> int:
        """How many of the prompt's first blocks this replica holds."""
        n = 0
        while n < len(blocks) and blocks[n] in self.blocks:
            n += 1
        return n

    def add(self, blocks: tuple[bytes, ...]) -> None:
        for block in blocks:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


def request_blocks(pending: PendingRequest | None) -> tuple[bytes, ...]:
    """The prefix blocks the gateway attached to the request (its first argument's `prefix`)."""
    if pending is None or not pending.args:
        return ()
    return getattr(pending.args[0], "prefix", ())


class PrefixRouter(RequestRouter):
    """Ray Serve's request router for the model replicas (see the module's docstring)."""

    def initialize_state(self, slack: int = 2, **kwargs) -> None:
        self.slack = slack
        self.tables: dict[ReplicaID, PrefixTable] = {}

    def _load(self, replica: RunningReplica) -> int | None:
        return self._replica_queue_len_cache.get(replica.replica_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks: [the replica holding the longest prefix] when it is not too busy, then all, of
        which Ray takes the least busy one whose queue is not full."""
        blocks = request_blocks(pending_request)
        everyone = random.sample(candidate_replicas, len(candidate_replicas))  # equally busy: any of them
        if not blocks or len(everyone) < 2:
            return [everyone]
        matched = {r.replica_id: self.tables.get(r.replica_id, PrefixTable()).matched(blocks)
                   for r in candidate_replicas}
        best = max(candidate_replicas, key=lambda r: matched[r.replica_id])
        if matched[best.replica_id] == 0:
            return [everyone]
        best_load = self._load(best)
        known = [load for r in everyone if (load := self._load(r)) is not None]
        if best_load is not None and best_load - min(known) > self.slack:
            return [everyone]
        return [[best], everyone]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        blocks = request_blocks(pending_request)
        if blocks:
            self.tables.setdefault(replica_id, PrefixTable()).add(blocks)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.tables.pop(replica_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for gone in set(self.tables) - {r.replica_id for r in replicas}:
            del self.tables[gone]
