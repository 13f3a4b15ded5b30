"""The batching scheduler: many sequences decoded together (continuous batching).

Requests join a running batch at token boundaries and leave when they finish. Each step:
  1. cancelled requests leave (their slots are free again);
  2. queued requests are admitted, best (priority, arrival) first, while slots are free; when
     none is and a request of higher priority waits, the running request with the lowest
     priority (the latest among equals) is preempted: back to the queue, resumed later from its
     tokens;
  3. rows are planned: one decode row per running sequence that has a token to evaluate, then
     prompt chunks within a budget (prompt_budget: `batch` tokens, fewer while settled streams
     decode, so that they keep flowing); cells come from the pool in blocks
     (kv_pool.py), and when it runs dry idle slots' cached cells are evicted, then the lowest
     priority running request is preempted;
  4. one forward over all rows (Backend.forward_rows): the weights stream once for the step;
  5. every sequence whose rows reached its last token samples one (its own sampler and seed),
     streams a Chunk, and leaves when finished.

Batch invariance: forward_rows computes every row as if it were alone (one kernel path per
row), so a request's tokens are the same alone, among others, chunked or preempted
(docs/fidelity.md). A finished request's cells stay in its slot: a later request whose prompt
starts with the same tokens (the next chat turn, a shared system prompt) evaluates only the rest.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..errors import MinillmError
from ..generate import Session
from ..sampling import SamplingParams
from ..sequence import Chunk, Result, Sequence
from .kv_pool import KVPool
from ..speculative import (Speculation, SpeculationParams, check_params, check_same_vocabulary, draft_speculation,
                          make_speculation)

DEFAULT_PARALLEL = 4
DEFAULT_CHUNK = 512  # prompt tokens a step, at most
STREAM_SHARE, MIN_PROMPT_ROWS = 2, 2  # prompt rows a step per decoding row, and at least (prompt_budget)
SETTLED_TOKENS = 16  # a stream paces prompt reading once it has streamed this many tokens (prompt_budget)
POLICIES = ("priority", "fcfs")


@dataclass
class Request:
    prompt: object                    # text, a conversation (list of {role, content}), or token ids
    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    priority: int = 0                 # lower runs first; first come, first served within a priority
    ignore_eos: bool = False
    id: object = None                 # the caller's name for it (echoed in results)
    logprobs: int | None = None       # None: off; k: each Chunk carries its token's logprob and the k best
    lookup: bool = False              # prompt lookup: guessed tokens checked in the same step (_guesses)
    draft: bool = False               # guesses from the scheduler's draft model (Scheduler(draft=...))


class Handle:
    """A submitted request as its caller sees it. Iterate it for its Chunks (as
    Model.generate(stream=True) yields them; the last has a finish_reason), or call result();
    cancel() ends it at the next step. The scheduler hands it Chunks (deliver) or an error (fail)."""

    def __init__(self, scheduler: "Scheduler", job: "_Job"):
        self.request = job.request
        self.prompt_ids = job.prompt_ids
        self.arrival = job.arrival
        self.finish_reason: str | None = None  # set as the last Chunk is delivered
        self.notify = None  # called (from the scheduler's thread) after each new Chunk or error
        self._job = job
        self._scheduler = scheduler
        self._chunks: deque[Chunk] = deque()
        self._error: BaseException | None = None
        self._cv = threading.Condition()

    # -- what the request has come to (read from the scheduler's side) -------------------
    @property
    def generated(self) -> list[int]:
        return self._job.sequence.generated

    @property
    def timings(self):
        return self._job.sequence.timings

    @property
    def n_cached(self) -> int:
        """Prompt tokens found in a slot's cells (not evaluated again)."""
        return self._job.n_cached

    @property
    def n_preempted(self) -> int:
        return self._job.n_preempted

    @property
    def first_step(self) -> int | None:
        """The scheduler step in which it first ran."""
        return self._job.first_step

    @property
    def running(self) -> bool:
        """In a slot now (neither queued, preempted nor finished)."""
        return self._job.slot is not None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self._error is not None

    def cancel(self) -> None:
        self._job.cancelled = True

    # -- its Chunks --------------------------------------------------------------------
    def __iter__(self):
        while True:
            chunk = self._take()
            if chunk is None:
                return
            yield chunk
            if chunk.finish_reason is not None:
                return

    def result(self) -> Result:
        return Result.collect(iter(self))

    def poll(self) -> list[Chunk]:
        """The Chunks streamed since the last call, without waiting (raises the request's error)."""
        with self._cv:
            if not self._chunks and self._error is not None:
                raise self._error
            ready = list(self._chunks)
            self._chunks.clear()
            return ready

    def _take(self) -> Chunk | None:
        while True:
            with self._cv:
                if self._chunks:
                    return self._chunks.popleft()
                if self._error is not None:
                    raise self._error
                if self.finish_reason is not None:
                    return None
                if self._scheduler.threaded:
                    self._cv.wait(0.5)
                    continue
            if not self._scheduler.step() and not self._chunks and not self.done:
                raise MinillmError("the scheduler has nothing to run for this request")

    def deliver(self, chunk: Chunk) -> None:
        with self._cv:
            self._chunks.append(chunk)
            if chunk.finish_reason is not None:
                self.finish_reason = chunk.finish_reason
            self._cv.notify_all()
        if self.notify is not None:
            self.notify()

    def fail(self, error: BaseException) -> None:
        with self._cv:
            self._error = error
            self._cv.notify_all()
        if self.notify is not None:
            self.notify()


class _Job:
    """A request on the scheduler's side: its Sequence (tokens, sampler, end of generation,
    detokenizer, stop strings, timings), where it runs, what it guesses, when it started. Its
    Handle is the caller's view."""

    def __init__(self, scheduler: "Scheduler", request: Request, prompt_ids: list[int], arrival: int):
        self.request = request
        self.prompt_ids = prompt_ids
        self.sequence = Sequence(scheduler.tokenizer, prompt_ids, request.max_tokens, request.sampling,
                                 request.stop, request.ignore_eos, request.logprobs, max_length=scheduler.n_ctx)
        self.timings = self.sequence.timings
        self.arrival = arrival
        self.sort_key = (request.priority if scheduler.policy == "priority" else 0, arrival)
        self.slot: "_Slot | None" = None
        self.cancelled = False
        self.n_cached = 0             # prompt tokens found in a slot's cells (not evaluated again)
        self.n_preempted = 0
        self.first_step: int | None = None
        self.t_admit = self.t_first = 0.0
        self.speculation = scheduler.speculation_for(request)  # a speculative.Speculation, or None
        if self.speculation is not None:
            self.speculation.start(prompt_ids)
        self.guesses: list[int] = []  # the tokens guessed after its decode row this step
        self.state_before = None      # recurrent pools: (slot, start, its state, rows) before a pass of guesses
        self.handle = Handle(scheduler, self)

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens: what the slot must hold to go on (a new list)."""
        return list(self.sequence.tokens)

    @property
    def n_tokens(self) -> int:
        return len(self.sequence.tokens)

    def emit(self, token: int, row: np.ndarray) -> bool:
        """Stream a chosen token (row: the logits it came from); True when the request is finished."""
        self._timed(time.perf_counter())
        for chunk in self.sequence.take(token, row):
            self.handle.deliver(chunk)
        return self.sequence.done

    def finish(self, reason: str, now: float) -> None:
        self._timed(now)
        self.handle.deliver(self.sequence.finish(reason))

    def _timed(self, now: float) -> None:
        if self.t_first:
            self.timings.generate_s = now - self.t_first


class _Slot:
    """One sequence's place in the pool: the tokens its cells hold, the request running in it."""

    def __init__(self, index: int):
        self.index = index
        self.tokens: list[int] = []
        self.job: _Job | None = None
        self.last_used = 0
        self.draft_session = None  # a generate.Session of the scheduler's draft model, once a draft request ran here


class Scheduler:
    """Continuous batching over one model: submit() requests, then step() (or start() a thread
    that steps while there is work). `parallel` sequences at once, each up to n_ctx positions,
    their cells from a pool of kv_cells (default: enough for every slot's full context; pages
    are touched only when written; on a GPU at most what its free memory holds), or of as many
    cells as kv_memory bytes hold in the model's cache types (a quantized cache: more cells, so
    more sequences before preemption).
    draft: a smaller Model of the same vocabulary for requests with draft=True; each slot
    decodes it in a session of its own (created when first needed). speculation: the
    SpeculationParams of requests that guess (lookup or draft)."""

    def __init__(self, model, parallel: int = DEFAULT_PARALLEL, n_ctx: int | None = None,
                 batch: int = DEFAULT_CHUNK, kv_cells: int | None = None, policy: str = "priority",
                 kv_memory: int | None = None, draft=None, speculation: SpeculationParams | None = None):
        model.backend.check_supports("rows")
        if policy not in POLICIES:
            raise MinillmError(f"unknown scheduling policy {policy!r} (choose from {', '.join(POLICIES)})")
        if parallel < 1:
            raise MinillmError(f"parallel must be at least 1, not {parallel}")
        self.model = model
        self.tokenizer = model.tokenizer
        self.policy = policy
        self.n_ctx = n_ctx or min(4096, model.hp.n_ctx_train)
        self.batch = max(1, batch)  # prompt tokens a step, all sequences together
        # a sequence takes at most min(batch, n_ctx) rows a step: the windows' rings hold that much more
        rows = min(self.batch, self.n_ctx)
        budget = kv_memory if kv_memory is not None or kv_cells else model.backend.pool_budget()
        if budget is not None:  # as many cells as the bytes hold; by default no more than every context
            fit = KVPool.cells_within(model.arch, parallel, self.n_ctx, rows, model.cache_types, budget)
            kv_cells = fit if kv_memory is not None else min(fit, parallel * self.n_ctx)
        kv_cells = max(kv_cells or parallel * self.n_ctx, self.n_ctx)  # one request always fits alone
        self.pool = KVPool(model.backend, parallel, self.n_ctx, kv_cells, rows, model.cache_types)
        self.slots = [_Slot(i) for i in range(parallel)]
        if draft is not None:
            draft.backend.check_supports("speculation")
            check_same_vocabulary(draft, model)
        self.draft = draft
        self.speculation = speculation or SpeculationParams()
        check_params(self.speculation)
        self.queue: list[_Job] = []
        self.threaded = False
        self.n_steps = 0
        self.n_evaluated = 0  # rows evaluated so far (prompt and generated tokens)
        self._arrivals = itertools.count()
        self._lock = threading.RLock()       # queue and slots
        self._step_lock = threading.Lock()   # one step at a time
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stop = False

    # -- requests --------------------------------------------------------------------
    def submit(self, request: Request) -> Handle:
        """Queue a request; MinillmError at once if it cannot run (an over-long prompt...)."""
        prompt = request.prompt
        if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, (int, np.integer)) for t in prompt):
            ids = [int(t) for t in self.model.check_ids(prompt)]
        elif isinstance(prompt, (str, list)):
            ids = self.model.prompt_ids(prompt)
        else:
            raise MinillmError("a prompt is text, a list of messages or a list of token ids")
        if not ids:
            raise MinillmError("the prompt is empty")
        if len(ids) >= self.n_ctx:
            raise MinillmError(f"the prompt is {len(ids)} tokens, {len(ids) - self.n_ctx + 1} more than the "
                               f"context of {self.n_ctx} allows (at most {self.n_ctx - 1})")
        if request.max_tokens < 0:
            raise MinillmError(f"max_tokens must be at least 0, not {request.max_tokens}")
        if request.draft and self.draft is None:
            raise MinillmError("draft: no draft model was given (Scheduler(draft=...))")
        if request.draft and request.lookup:
            raise MinillmError("choose a draft model or prompt lookup, not both")
        if request.draft or request.lookup:
            self.model.backend.check_supports("speculation")
        job = _Job(self, request, ids, next(self._arrivals))
        if request.max_tokens == 0:
            job.finish("length", time.perf_counter())
            return job.handle
        with self._lock:
            self.queue.append(job)
            self._wake.notify_all()
        return job.handle

    def cancel(self, handle: Handle) -> None:
        handle.cancel()

    def speculation_for(self, request: Request) -> Speculation | None:
        """A request's guessing: prompt lookup, or the draft model in its slot's session (lent
        on placement, _place), or None."""
        if request.draft:  # one not expected to pay stays off: its catch-ups would stall every stream
            return draft_speculation(self.draft, self.model, self.n_ctx, self.speculation, own_session=False)
        return make_speculation(self.model, self.n_ctx, lookup=request.lookup, params=self.speculation)

    def stats(self) -> dict:
        with self._lock:
            return {"running": sum(s.job is not None for s in self.slots), "queued": len(self.queue),
                    "slots": len(self.slots), "free_cells": self.pool.free_cells, "cells": self.pool.n_cells,
                    "steps": self.n_steps, "evaluated": self.n_evaluated}

    def run(self, handles, on_finish=None) -> None:
        """Step until every handle is done; on_finish(handle) as each one ends."""
        pending = list(handles)
        while pending:
            still = []
            for h in pending:
                if not h.done:
                    still.append(h)
                elif on_finish is not None:
                    on_finish(h)
            pending = still
            if pending and not self.step() and not any(h.done for h in pending):
                raise MinillmError("the scheduler stalled")  # cannot happen: a bug if it does

    # -- a thread for servers --------------------------------------------------------
    def start(self) -> None:
        """Step in a background thread while there is work (handles then wait on it)."""
        if self._thread is None:
            self.threaded, self._stop = True, False
            self._thread = threading.Thread(target=self._loop, name="minillm-scheduler", daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        """Whether the background thread is stepping (or waiting for work)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread, self.threaded = None, False

    def _loop(self) -> None:
        self.model.use_threads()
        while True:
            with self._lock:
                while not self._stop and not self.queue and all(s.job is None for s in self.slots):
                    self._wake.wait()
                if self._stop:
                    return
            self.step()

    # -- one step --------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, plan, evaluate and sample once; False when there was nothing to do."""
        with self._step_lock:
            with self._lock:
                self._drop_cancelled()
                self._admit()
                plan = self._plan()
            if not plan:
                return False
            self.n_steps += 1
            t0 = time.perf_counter()
            try:
                logits, outputs = self._forward(plan)
            except Exception as exc:  # a kernel error: those requests fail, the slots are freed
                with self._lock:
                    for job, _ in plan:
                        self._leave(job, clear=True)
                        job.handle.fail(exc)
                return True
            with self._lock:
                self._sample(logits, outputs, time.perf_counter() - t0)
            return True

    def _drop_cancelled(self) -> None:
        now = time.perf_counter()
        for job in [j for j in self.queue if j.cancelled]:
            self.queue.remove(job)
            job.finish("cancelled", now)
        for slot in self.slots:
            if slot.job is not None and slot.job.cancelled:
                job = slot.job
                self._leave(job)
                job.finish("cancelled", now)

    def _admit(self) -> None:
        while self.queue:
            job = min(self.queue, key=lambda j: j.sort_key)
            free = [s for s in self.slots if s.job is None]
            if not free:
                victim = max((s.job for s in self.slots), key=lambda j: j.sort_key)
                if self.policy != "priority" or victim.request.priority <= job.request.priority:
                    return
                self._preempt(victim)
                continue
            self.queue.remove(job)
            self._place(job, free)

    def _place(self, job: _Job, free: list[_Slot]) -> None:
        """Run job in the free slot whose cells share the longest prefix with its tokens."""
        tokens = job.tokens

        def shared(slot: _Slot) -> int:
            n, limit = 0, min(len(slot.tokens), len(tokens) - 1)  # leave one token to evaluate
            while n < limit and slot.tokens[n] == tokens[n]:
                n += 1
            return self.pool.reusable_prefix(len(slot.tokens), n)

        slot = max(free, key=lambda s: (shared(s), -s.last_used))
        if job.request.draft and job.speculation.active:  # the draft decodes in the slot's session
            if slot.draft_session is None:
                slot.draft_session = Session(self.draft, n_ctx=self.n_ctx)
            job.speculation.use_session(slot.draft_session)
        keep = shared(slot)
        self.pool.release(slot.index, keep)
        del slot.tokens[keep:]
        slot.job = job
        job.slot = slot
        if job.first_step is None:
            job.first_step = self.n_steps
            job.n_cached = min(keep, len(job.prompt_ids))
            job.t_admit = time.perf_counter()

    def _preempt(self, job: _Job) -> None:
        """Back to the queue; its cells stay in the slot (reused if it gets them back intact)."""
        self._leave(job)
        job.n_preempted += 1
        self.queue.append(job)

    def _leave(self, job: _Job, clear: bool = False) -> None:
        if job.guesses:  # planned, never checked
            job.speculation.n_drafted -= len(job.guesses)
            job.guesses = []
        slot = job.slot
        if slot is None:
            return
        slot.job, job.slot = None, None
        slot.last_used = self.n_steps
        if clear:
            self.pool.release(slot.index)
            slot.tokens = []

    def _plan(self) -> list[tuple[_Job, int]]:
        """(job, rows) for this step: decode rows first, then prompt chunks within the budget;
        blocks assigned for all of them."""
        while True:
            running = sorted((s.job for s in self.slots if s.job is not None), key=lambda j: j.sort_key)
            decoding = [j for j in running if j.n_tokens - len(j.slot.tokens) == 1]
            plan = [(j, 1 + len(self._guesses(j, len(decoding)))) for j in decoding]
            settled = sum(j.timings.n_generated >= SETTLED_TOKENS for j, _ in plan)
            budget = self.prompt_budget(len(plan), settled)
            for job in running:
                pending = job.n_tokens - len(job.slot.tokens)
                if pending > 1 and budget > 0:
                    n = min(pending, budget)
                    plan.append((job, n))
                    budget -= n
            if self._assign_blocks(plan):
                return plan

    def _guesses(self, job: _Job, n_streams: int) -> list[int]:
        """The tokens a lookup or draft request guesses after its decode row this step
        (speculative.py: as many as are expected to pay; a draft's time counts n_streams times
        over, as every decoding stream waits for it), within its max_tokens, the context and
        the free cells.
        Each guess is one more row of its sequence, computed alone like every row, so checking
        it against the decode row's logits (Sampler.verify) keeps its tokens those of plain
        decoding."""
        spec = job.speculation
        if spec is None or job.guesses:  # none, or planned already (plan again after eviction)
            return job.guesses
        room = min(job.request.max_tokens - job.timings.n_generated, self.n_ctx - job.n_tokens) - 1
        spec.n_streams = n_streams
        guesses = spec.guesses(job.tokens, room)
        start = len(job.slot.tokens)
        if guesses and not self.pool.can_assign(self.pool.blocks_needed(job.slot.index, start,
                                                                        start + 1 + len(guesses))):
            spec.n_drafted -= len(guesses)  # no cells to spare: no guesses this step
            guesses = []
        job.guesses = guesses
        return guesses

    def prompt_budget(self, n_decoding: int, n_settled: int) -> int:
        """Prompt rows this step. While settled streams decode (n_settled: those that have
        streamed SETTLED_TOKENS tokens), a step carries at most STREAM_SHARE prompt
        rows per decoding row (at least MIN_PROMPT_ROWS): a row costs about the same whichever
        kind it is, so a running stream's steps stay under ~3x their usual time while a long
        prompt is read. Otherwise the whole `batch`: requests that arrive together (a burst of
        clients a moment apart) are read together, as llama-server and vLLM read them, instead of
        a few rows a step behind the first one's young stream. (Every row is computed alone, so
        how prompts are cut never changes a result.)"""
        if not n_decoding or n_settled == 0:
            return self.batch
        return min(self.batch, max(MIN_PROMPT_ROWS, STREAM_SHARE * n_decoding))

    def _assign_blocks(self, plan) -> bool:
        """Blocks for every planned row; False after making room (plan again)."""
        for job, n in plan:
            start = len(job.slot.tokens)
            needed = self.pool.blocks_needed(job.slot.index, start, start + n)
            if self.pool.can_assign(needed):
                self.pool.assign(job.slot.index, needed)
                continue
            idle = sorted((s for s in self.slots if s.job is None and s.tokens), key=lambda s: s.last_used)
            if idle:
                self.pool.release(idle[0].index)
                idle[0].tokens = []
                return False
            victim = max((s.job for s in self.slots if s.job is not None), key=lambda j: j.sort_key)
            slot = victim.slot
            self._preempt(victim)
            self.pool.release(slot.index)  # its cells go back to the pool: it will be recomputed
            slot.tokens = []
            return False
        return True

    def _forward(self, plan):
        """One forward over the plan's rows; (logits of the output rows, their jobs)."""
        inner, last = [], []  # rows as (slot, position, token); a sequence's newest row last
        outputs = []
        for job, n in plan:
            slot = job.slot
            start = len(slot.tokens)
            tokens = job.tokens + job.guesses  # a decode row's guesses: rows after it
            rows = [(slot.index, start + i, tokens[start + i]) for i in range(n)]
            if job.guesses and self.pool.recurrent is not None:  # rejected guesses are taken back from it
                job.state_before = (slot, start, self.pool.recurrent.copy_seq(slot.index), n)
            if job.guesses:  # every row's logits: each checks the guess after it
                last.extend(rows)
                outputs.append(job)
                continue
            if start + n == len(tokens):  # its last token: sample after it
                inner.extend(rows[:-1])
                last.append(rows[-1])
                outputs.append(job)
            else:
                inner.extend(rows)
        rows = np.array(inner + last, np.int64).reshape(-1, 3)
        row_seq, positions, ids = rows[:, 0].copy(), rows[:, 1].copy(), rows[:, 2].copy()
        kv_of = self.pool.batch_kv(row_seq, positions)
        logits = self.model.backend.forward_rows(ids, positions, kv_of, len(inner), self.pool.n_ctx)
        for job, n in plan:
            slot = job.slot
            start = len(slot.tokens)
            n -= len(job.guesses)  # guesses join the slot's cells once accepted (_sample)
            slot.tokens.extend(job.tokens[start:start + n])
            if job.request.draft and n > 1:
                job.speculation.follow(slot.tokens)  # a prompt chunk: the draft reads it too
            job.timings.n_prompt += max(0, min(start + n, len(job.prompt_ids)) - start)
        self.n_evaluated += len(ids)
        return logits, outputs

    def _sample(self, logits: np.ndarray, outputs: list[_Job], step_s: float) -> None:
        """Sample each output job's token from its row; a job that guessed has a row per
        guess too: each guess is checked against the row before it (kept as the token, or
        replaced by one drawn from the rest of the distribution), and the rows after a replaced
        guess are dropped (their cells are rewritten later; the slot's tokens stop before them)."""
        now = time.perf_counter()
        at = 0
        for job in outputs:
            guesses, job.guesses = job.guesses, []
            rows = logits[at:at + 1 + len(guesses)]
            at += len(rows)
            if job.slot is None:  # preempted meanwhile: it resumes from its tokens
                continue
            if not job.t_first:
                job.t_first = now
                job.timings.prompt_s = now - job.t_admit
            if job.speculation is not None and job.timings.n_generated:  # not its prompt's step
                self._time_pass(job.speculation, len(rows), step_s, len(outputs))
            self._sample_rows(job, rows, guesses)
        for job in outputs:
            self._take_back_rejected(job)

    def _take_back_rejected(self, job: _Job) -> None:
        """A recurrent state that ran a pass's rejected guesses goes back to its state before
        the pass, and the rows its slot kept are evaluated again (each as alone, as in the
        pass): the state of the slot's tokens, with no trace of the guesses."""
        before, job.state_before = job.state_before, None
        if before is None:
            return
        slot, start, state, n_rows = before
        kept = len(slot.tokens) - start
        if kept == n_rows:
            return
        self.pool.recurrent.put_seq(slot.index, state)
        if kept > 0:
            positions = np.arange(start, start + kept, dtype=np.int64)
            ids = np.array(slot.tokens[start:start + kept], np.int64)
            kv_of = self.pool.batch_kv(np.full(kept, slot.index, np.int64), positions)
            self.model.backend.forward_rows(ids, positions, kv_of, kept - 1, self.pool.n_ctx)
            self.n_evaluated += kept

    @staticmethod
    def _time_pass(spec, n_rows: int, step_s: float, n_streams: int) -> None:
        """Teach a request's Speculation what its guesses cost. Beside n_streams - 1 others, a
        guess row slows every stream's step: its cost counts n_streams times over (a step with
        guesses is charged as the steps without them plus n_streams times the difference), so
        a request guesses only where the step's tokens per second rise, not just its own."""
        if n_rows > 1 and spec.t_lone:
            step_s = spec.t_lone + n_streams * (step_s - spec.t_lone)
        spec.timed(n_rows, step_s)

    def _sample_rows(self, job: _Job, rows: np.ndarray, guesses: list[int]) -> None:
        for i, row in enumerate(rows):
            guess = guesses[i] if i < len(guesses) else None
            token = job.sequence.choose(row, guess)
            if guess is not None:
                job.speculation.judged(token == guess)
                job.timings.n_drafted = job.speculation.n_drafted
                job.timings.n_accepted = job.speculation.n_accepted
            if job.emit(token, row):
                self._leave(job)
                return
            if token != guess:
                return
            job.slot.tokens.append(guess)  # its row's cells hold the token now taken
