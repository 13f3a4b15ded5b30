"""Prefix-aware routing for `serve --replicas`: a request goes to the replica that already holds
the KV cells of the longest start of its prompt, unless that replica is busier than the least
busy one by more than `slack` requests; then, and for prompts no replica has seen, the least busy
replica takes it (busy: requests sent and not finished).

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
    """Ray Serve's request router for the model replicas (see the module's docstring). Load is
    the requests this router has sent a replica and not yet seen finish: exact with one gateway."""

    def initialize_state(self, slack: int = 2, **kwargs) -> None:
        self.slack = slack
        self.tables: dict[ReplicaID, PrefixTable] = {}
        self.in_flight: dict[ReplicaID, int] = {}
        self.sent: dict[str, ReplicaID] = {}  # internal request id -> replica, until it finishes

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks, one replica each: the one holding the longest prefix when it is not too busy,
        then the rest from the least busy (ties in random order). Ray takes the first whose
        queue is not full."""
        load = {r.replica_id: self.in_flight.get(r.replica_id, 0) for r in candidate_replicas}
        ranked = sorted(random.sample(candidate_replicas, len(candidate_replicas)), key=lambda r: load[r.replica_id])
        blocks = request_blocks(pending_request)
        if blocks and len(ranked) > 1:
            matched = {r.replica_id: self.tables[r.replica_id].matched(blocks) if r.replica_id in self.tables else 0
                       for r in ranked}
            best = max(ranked, key=lambda r: matched[r.replica_id])
            if matched[best.replica_id] and load[best.replica_id] - load[ranked[0].replica_id] <= self.slack:
                ranked.remove(best)
                ranked.insert(0, best)
        if pending_request is not None and ranked:  # counted now: requests routed at once see each other
            self._assign(pending_request.metadata.internal_request_id, ranked[0].replica_id)
        return [[r] for r in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        self._assign(pending_request.metadata.internal_request_id, replica_id)
        blocks = request_blocks(pending_request)
        if blocks:
            self.tables.setdefault(replica_id, PrefixTable()).add(blocks)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._assign(internal_request_id, None)

    def _assign(self, request: str, replica_id: ReplicaID | None) -> None:
        """Count the request on replica_id (None: on none any more), off where it was counted."""
        before = self.sent.pop(request, None)
        if before in self.in_flight:
            self.in_flight[before] -= 1
        if replica_id is not None:
            self.sent[request] = replica_id
            self.in_flight[replica_id] = self.in_flight.get(replica_id, 0) + 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        for gone in (set(self.tables) | set(self.in_flight)) - {r.replica_id for r in replicas}:
            self._forget(gone)

    def _forget(self, replica_id: ReplicaID) -> None:
        self.tables.pop(replica_id, None)
        self.in_flight.pop(replica_id, None)
        self.sent = {request: replica for request, replica in self.sent.items() if replica != replica_id}
