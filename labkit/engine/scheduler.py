"""Continuous batching: which requests run in the next step, and how many tokens of each.

Every step has a token budget (``max_num_batched_tokens``) and a cap on running requests
(``max_num_seqs``). A step is filled in this order:

1. decodes of running requests (one token each), so they keep their time between tokens;
2. the next chunk of running requests still in prefill (chunked prefill: a long prompt is
   spread over several steps instead of stalling everyone else for one long step);
3. new requests from the waiting queue, first come first served, with their prefix-cache hits
   skipped: those tokens' KV is already in the cache.

Blocks are taken as tokens are scheduled, never ahead: so a block that the prefix cache can
find always holds KV that is computed or being computed in this step. (Within a step the runner
must store every token's KV of a layer before that layer's attention reads the cache.)

When a running request needs a block and none is left, the newest running request is
preempted: its blocks are freed and it goes back to the front of the waiting queue, to be
recomputed (prompt and output so far) when there is room; its full blocks usually stay cached.

Driven by ``step = schedule()``, the runner computes the step, then ``update(step, sampled)``
(``labkit.engine.step_results``: the tokens placed, requests finished, failed steps undone).

Async scheduling (``async_scheduling=True``): the next step may be scheduled while one is still
in flight, so the CPU plans step N+1 while the GPU computes step N. A token that step N samples
is then ``PENDING``: step N+1's decode row for that request reads it from the device (the row's
``input_from``) and its KV slot is reserved without its id; ``update(N)`` fills in the id. A
request that reaches ``max_tokens`` with its pending token is left out of step N+1; one that
samples a stop token in step N has already been given a row in step N+1, whose token is
dropped (the price of not waiting for the GPU).

Speculative decoding (``SchedulerConfig.speculative``: n-gram proposals, or controlled ones read
from ``Request.reference``): a decode row also carries up to k draft tokens after its last
sampled token, and the target checks them all in that one row (a (k + 1)-token query, causal
within it). The block manager gives the drafts slots without sealing them (``append_draft``);
``update`` keeps the ones the target agrees with and rolls the rest back (``accept_draft``).
Drafts never preempt anyone: without room, or budget, a row verifies fewer or none.

Async speculation (both, with the controlled draft): step N+1 is planned while step N's
accepted count A is unknown. A request whose row in step N samples gets its step N+1 row as if
A = 0 (``_schedule_ahead``): blocks held for the longest outcome (``BlockManager.reserve``) and
a window of drafts for every outcome (``ScheduledSeq.draft_window``), which the controlled draft
can propose because its tokens depend on the position alone. The device counts A and moves the
row (``labkit.kernels.rows_ahead``); ``update(N)`` resolves it on the host to the row the
plain loop would have scheduled, appends its tokens into the held blocks and gives back the
rest. A request that the longest outcome would finish waits one step instead.
"""
from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from operator import index
from typing import Hashable, Sequence

from labkit import check_positive_int
from labkit.engine.config import SchedulerConfig
from labkit.engine.request import (PENDING, Request, ScheduledSeq, ScheduledStep, Status,
                                   StepStats)
from labkit.engine.speculative import SpecDecodeStats, make_proposer, propose_drafts
from labkit.engine.step_results import StepResults
from labkit.graphs import bucket_for
from labkit.kvcache.block_manager import BlockManager

__all__ = ["Request", "ScheduledSeq", "ScheduledStep", "Scheduler", "SchedulerConfig", "Status",
           "StepStats", "cached_prefix_len"]


def cached_prefix_len(bm: BlockManager, token_ids: Sequence[int]) -> int:
    """Leading tokens the prefix cache would serve now; changes nothing."""
    return bm.cached_prefix_len(token_ids) if bm.enable_prefix_caching else 0


@dataclass
class _Plan:
    """The step being filled: what is left of its token budget and what it holds so far."""
    budget: int
    # request id -> (its index among the rows that sample in the step in flight, that row)
    in_flight: dict[Hashable, tuple[int, ScheduledSeq]]
    rows: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    scheduled: set[Hashable] = field(default_factory=set)
    starved: bool = False  # a running prefill got no tokens: admit nobody this step
    decodes_after: int = 0  # decode rows still to come after the one being planned
    hit_tokens: int = 0


class Scheduler(StepResults):
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []   # admission order: the last one is the newest
        self.history: list[StepStats] = []
        self._live: dict[Hashable, Request] = {}
        self._in_flight: deque[ScheduledStep] = deque()  # scheduled, not yet updated; in order
        self._next_step = 0
        spec = config.speculative
        self._proposer = None if spec is None else make_proposer(spec)
        # plan a verify row before the step in flight says how many drafts it kept
        self._async_speculation = spec is not None and config.async_scheduling
        self.spec_stats = SpecDecodeStats()  # drafts proposed and accepted, over every step

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: Hashable, prompt_token_ids: Sequence[int], *,
                    max_tokens: int, eos_token_ids: Sequence[int] = (),
                    speculate: bool = True, reference: Sequence[int] | None = None
                    ) -> Request:
        """Queue a request. A prompt that can never be served is finished at once with
        ``Status.FINISHED_ERROR`` and a message; nothing else is affected. ``speculate``: its
        decode rows may verify drafts (with ``SchedulerConfig.speculative``). ``reference``: its
        greedy continuation, which a controlled proposer reads (without one it proposes none)."""
        if request_id in self._live:
            raise ValueError(f"request {request_id!r} is already queued or running; use a new id")
        check_positive_int("max_tokens", max_tokens, hint="tokens to generate")
        req = Request(request_id, list(prompt_token_ids), max_tokens, frozenset(eos_token_ids),
                      speculate=bool(speculate) and self._proposer is not None,
                      reference=None if reference is None else [index(t) for t in reference])
        req.error = self._why_unservable(req)
        if req.error:
            req.status = Status.FINISHED_ERROR
            return req
        self._live[request_id] = req
        self.waiting.append(req)
        return req

    def _why_unservable(self, req: Request) -> str | None:
        cfg, n = self.config, len(req.prompt_token_ids)
        try:
            req.prompt_token_ids = [index(t) for t in req.prompt_token_ids]
        except TypeError as e:
            return f"request {req.request_id!r}: prompt token ids must be ints ({e})"
        # An id outside the embedding table would fault the device and take the batch with it.
        limit = cfg.vocab_size or 2**63
        bad = next((t for t in req.prompt_token_ids if not 0 <= t < limit), None)
        if bad is not None:
            return (f"request {req.request_id!r}: token id {bad} is outside the vocabulary "
                    f"[0, {limit}); check the tokenizer matches the model")
        if n == 0:
            return f"request {req.request_id!r}: the prompt is empty; give at least one token"
        if n > cfg.max_model_len:
            return (f"request {req.request_id!r}: prompt of {n} tokens is longer than "
                    f"max_model_len={cfg.max_model_len}; shorten it or use a longer context")
        if not cfg.enable_chunked_prefill and n > cfg.max_num_batched_tokens:
            return (f"request {req.request_id!r}: prompt of {n} tokens exceeds the step budget "
                    f"max_num_batched_tokens={cfg.max_num_batched_tokens} with chunked prefill "
                    "off; enable chunked prefill or raise the budget")
        # The last sampled token is never fed back, so it needs no KV slot.
        total = min(n + req.max_tokens, max(cfg.max_model_len, n + 1))
        bs = self.bm.block_size
        need = -(-(total - 1) // bs)
        if need > self.bm.num_blocks:
            return (f"request {req.request_id!r}: {n} prompt + up to {total - n} output tokens "
                    f"need {need} blocks of {bs}, the KV cache holds {self.bm.num_blocks}; lower "
                    "max_tokens, shorten the prompt or give the cache more memory")
        return None

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def history_table(self):
        """Every step's statistics so far, one row per step (a pandas DataFrame)."""
        import pandas as pd

        return pd.DataFrame([asdict(s) for s in self.history], columns=list(
            StepStats.__dataclass_fields__))

    # ------------------------------------------------------------------ scheduling
    @property
    def steps_in_flight(self) -> int:
        return len(self._in_flight)

    def schedule(self) -> ScheduledStep:
        """The next step. Its rows' tokens count as computed from now on (their KV is written
        by this step), and each row that samples gets a ``PENDING`` output token."""
        limit = 2 if self.config.async_scheduling else 1
        if len(self._in_flight) >= limit:
            raise RuntimeError(
                f"step {self._in_flight[0].step_id} was scheduled but not updated: call "
                f"update(step, sampled_token_ids) first ({limit - 1} step(s) may be in flight "
                f"{'with' if limit == 2 else 'without'} async_scheduling)")
        # Where each token sampled by the step in flight sits in that step's samples.
        in_flight = {}
        if self._in_flight:
            sampling = [r for r in self._in_flight[-1].rows if r.needs_logits]
            in_flight = {r.request_id: (i, r) for i, r in enumerate(sampling)}
        plan = _Plan(self.config.max_num_batched_tokens, in_flight)
        self._schedule_decodes(plan)
        self._schedule_prefill_chunks(plan)
        self._admit_waiting(plan)
        step = ScheduledStep(self._next_step, tuple(plan.rows), tuple(plan.copies),
                             tuple(r.request_id for r in plan.preempted),
                             self._stats(plan.rows, plan.hit_tokens, len(plan.preempted)))
        self._next_step += 1
        if plan.rows:  # an empty step has nothing to update
            self._in_flight.append(step)
        self.history.append(step.stats)
        return step

    def _schedule_decodes(self, plan: "_Plan") -> None:
        """1. One token for each running request past its prompt, oldest first; the newest
        running request gives way when blocks run out. Drafts take what is left of the budget
        once every later decode row has its one token (``plan.decodes_after``)."""
        decodes = [r for r in self.running if r.is_decode]
        for i, req in enumerate(decodes):
            plan.decodes_after = len(decodes) - i - 1
            if req.status is not Status.RUNNING or self._done_when_resolved(req):
                continue  # preempted earlier in this loop, or finishing with its pending token
            self._preempt_until(plan, req, lambda: self.bm.can_append(req.request_id),
                                requester_too=True)
            if req.status is not Status.RUNNING:
                continue
            start = req.num_computed_tokens
            token = req.token_ids(start, start + 1)[0]
            if token == PENDING and self._async_speculation:
                self._schedule_ahead(plan, req)
                continue
            plan.copies += self.bm.append_token(req.request_id, None if token == PENDING else token)
            drafts = [] if token == PENDING or not req.speculate else propose_drafts(
                self._proposer, self.bm, req, plan.budget - 1 - plan.decodes_after,
                self.config.max_model_len, self.config.vocab_size)
            if drafts:
                plan.copies += self.bm.append_draft(req.request_id, drafts)
            self._add_row(plan, req, start, 1, is_prefill=False, drafts=drafts)

    def _schedule_ahead(self, plan: "_Plan", req: Request) -> None:
        """1b. Async speculation: a decode row for ``req`` while the step in flight still
        decides how many of its drafts are kept (A, from 0 to that row's k_prev drafts). The row
        is planned as if A = 0 (``ScheduledSeq.draft_window``); blocks are held for the longest
        outcome, A = k_prev (``BlockManager.reserve``); ``update`` resolves it. Its own drafts
        are as many as the longest outcome leaves room for; a request that the longest outcome
        would finish waits for the next step instead (its row could land past its end)."""
        k_prev = plan.in_flight[req.request_id][1].num_draft
        longest = len(req.output_token_ids) + k_prev  # outputs after that step, at most
        if longest >= req.max_tokens or \
                len(req.prompt_token_ids) + longest >= self.config.max_model_len:
            return
        rid, cfg = req.request_id, self.config
        self._preempt_until(plan, req, lambda: self.bm.can_reserve(
            rid, req.num_tokens + k_prev), requester_too=True)
        if req.status is not Status.RUNNING:
            return
        room = min(plan.budget - 1 - plan.decodes_after, req.max_tokens - longest - 1,
                   cfg.max_model_len - len(req.prompt_token_ids) - longest - 1)
        window = []
        if req.speculate and req.reference is not None and room > 0:
            # drafts for every outcome: output slots past the pending token, k_prev + k of them
            window = self._proposer.propose(
                req.reference, len(req.output_token_ids), cfg.vocab_size, rid,
                count=k_prev + min(room, self._proposer.k))
        k = max(0, len(window) - k_prev)
        if k and not self.bm.can_reserve(rid, req.num_tokens + k_prev + k):
            k = 0  # drafts never preempt anyone
        if k == 0:  # no drafts to pick; the window's length still says how far the row moves
            window = [0] * k_prev
        self.bm.reserve(rid, req.num_tokens + k_prev + k)
        self._add_row(plan, req, req.num_computed_tokens, 1, is_prefill=False,
                      drafts=window[:k], window=tuple(window))

    def _schedule_prefill_chunks(self, plan: "_Plan") -> None:
        """2. The next chunk of each running request still in its prompt, as large as the
        budget and the free blocks allow."""
        for req in [r for r in self.running if not r.is_decode]:
            if plan.budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue
            # only older or already scheduled requests may hold the blocks: then it waits
            self._preempt_until(plan, req, lambda: self._room(req) > 0, requester_too=False)
            start = req.num_computed_tokens
            n = min(plan.budget, req.num_tokens - start, self._room(req))
            if n == 0:
                plan.starved = True  # waits for decodes to finish; admit nobody meanwhile
                continue
            for t in req.token_ids(start, start + n):
                plan.copies += self.bm.append_token(req.request_id, t)
            self._add_row(plan, req, start, n, is_prefill=True)

    def _admit_waiting(self, plan: "_Plan") -> None:
        """3. New (or preempted) requests, first come first served, with their prefix-cache hits
        skipped, while nothing running is starved or was preempted in this step."""
        cfg, bm = self.config, self.bm
        while (self.waiting and plan.budget > 0 and len(self.running) < cfg.max_num_seqs
               and not plan.starved and not plan.preempted):
            req = self.waiting[0]
            tokens = req.token_ids(0, req.num_tokens)
            if PENDING in tokens:
                break  # preempted while its last token is in flight: admit it after update()
            hit = cached_prefix_len(bm, tokens)
            todo = len(tokens) - hit
            if not cfg.enable_chunked_prefill and plan.budget < todo <= cfg.max_num_batched_tokens:
                break  # wait for a step with room for all of it; a recompute that can never
                # fit (prompt + output past the budget) is chunked, or it would be lost
            end = hit + min(todo, plan.budget)
            if not bm.can_allocate(tokens[:end]):
                break
            got = bm.allocate(req.request_id, tokens[:end])
            assert got == hit, f"prefix cache probe said {hit} tokens, allocate served {got}"
            self.waiting.popleft()
            self.running.append(req)
            req.status = Status.RUNNING
            req.num_computed_tokens = req.num_cached_tokens = hit
            plan.hit_tokens += hit
            self._add_row(plan, req, hit, end - hit, is_prefill=True)

    def _add_row(self, plan: "_Plan", req: Request, start: int, n: int, is_prefill: bool,
                 drafts: Sequence[int] = (), window: tuple[int, ...] | None = None) -> None:
        """Tokens [start, start + n) of ``req`` into the step, then its ``drafts``; the last one
        of a request's known tokens samples, so it gets a PENDING output token. Drafts' KV is
        written too, but counts as computed only once ``update`` accepts it."""
        tokens = tuple(req.token_ids(start, start + n))
        source = plan.in_flight[req.request_id][0] if tokens[-1] == PENDING else None
        needs_logits = start + n == req.num_tokens
        plan.rows.append(ScheduledSeq(req, start, n + len(drafts), tokens + tuple(drafts),
                                      is_prefill, needs_logits, source, len(drafts), window))
        plan.scheduled.add(req.request_id)
        plan.budget -= n + len(drafts)
        req.num_computed_tokens = start + n
        if needs_logits:
            req.output_token_ids.append(PENDING)
            req.token_steps.append(self._next_step)

    def _preempt_until(self, plan: "_Plan", req: Request, has_room, *,
                       requester_too: bool) -> None:
        """4. Preemption: the newest running requests (``_victim``) give their blocks back
        until ``has_room()``. Reaching ``req`` itself stops it: ``req`` is preempted too when
        ``requester_too``, else it is left running, to wait for room."""
        while not has_room():
            victim = self._victim(req, plan.scheduled)
            if victim is req and not requester_too:
                return
            self._preempt(victim)
            plan.preempted.append(victim)
            if victim is req:
                return

    def _done_when_resolved(self, req: Request) -> bool:
        """Its pending token is its last: max_tokens or max_model_len is reached with it."""
        return (bool(req.output_token_ids) and req.output_token_ids[-1] == PENDING
                and (len(req.output_token_ids) >= req.max_tokens
                     or req.num_tokens >= self.config.max_model_len))

    def _room(self, req: Request) -> int:
        """Tokens a running request can still append without preempting anyone."""
        rid, bs = req.request_id, self.bm.block_size
        held = len(self.bm.block_table(rid)) * bs - self.bm.num_tokens(rid)
        return held + self.bm.num_free_blocks * bs

    def _victim(self, requester: Request, scheduled: set) -> Request:
        """The newest running request newer than ``requester`` and not in this step, else the
        requester itself. A request already in this step is never taken: its newest blocks may
        be findable in the prefix cache while their KV is still to be written."""
        for req in reversed(self.running):
            if req is requester or req.request_id not in scheduled:
                return req
        raise AssertionError("the requester is not running")

    def _preempt(self, req: Request, *, uncache: bool = False) -> None:
        self.bm.free(req.request_id, uncache=uncache)
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _stats(self, rows: list[ScheduledSeq], hit_tokens: int, num_preempted: int) -> StepStats:
        prefill = [r for r in rows if r.is_prefill]
        decode = [r for r in rows if not r.is_prefill]
        padded = 0
        buckets, spec = self.config.decode_buckets, self.config.speculative
        # full graphs replay uniform decode, and uniform verify (every row k drafts)
        uniform = {0, spec.num_speculative_tokens} if spec is not None else {0}
        if buckets and decode and not prefill and len({r.num_draft for r in decode}) == 1 \
                and decode[0].num_draft in uniform:
            bucket = bucket_for(len(decode), buckets, default=None)  # None: too big, eager
            padded = 0 if bucket is None else bucket - len(decode)
        return StepStats(self._next_step, sum(r.num_tokens for r in prefill),
                         sum(r.num_tokens for r in decode), len(prefill), len(decode), padded,
                         hit_tokens, num_preempted, len(self.running), len(self.waiting),
                         sum(r.num_draft for r in decode))
