"""After a step runs: its sampled tokens go into the requests, or the step is undone.

``update(step, sampled)`` takes the tokens a step sampled, in row order (one per row that
samples, or for a verify row the target's choice at each checked position), in the order the
steps were scheduled. Each replaces its request's ``PENDING`` output token; where the next step
already reserved that token's KV slot (async scheduling), the block manager gets its id too.
A request that samples a stop token, or reaches ``max_tokens`` or ``max_model_len``, finishes:
its blocks go back and its output is cut after that token. A verify row keeps the longest prefix
of its drafts matching the target's choices plus the target's own next token, and the block
manager rolls the rest back (``speculative.verify_row``, ``accept_draft``). For a sampled request
the LLM turns the rejection rule's outcome into such choices (``speculative.sample_with_drafts``).

``abort_step`` undoes a step that failed before its KV was written (its requests wait again, as
if preempted); ``abort_request`` drops a waiting or running request, finishing it with an error.

:class:`StepResults` holds these methods; ``Scheduler`` inherits them, so they change its
queues, requests and block manager.
"""
from __future__ import annotations

from dataclasses import replace
from operator import index
from typing import Hashable, Sequence

from labkit.engine.request import PENDING, Request, ScheduledSeq, ScheduledStep, Status
from labkit.engine.speculative import verify_row


class StepResults:
    """The scheduler's side of a step's end (see the module docstring)."""

    def update(self, step: ScheduledStep, sampled_token_ids: Sequence[int]) -> list[Request]:
        """Fill in the tokens ``step`` sampled, ``row.num_logits`` per row (in row order: one,
        or for a verify row the target's choice at each checked position), and finish requests
        that stop. Steps are updated in the order they were scheduled. Returns the requests
        that finished."""
        if not step.rows:
            return []
        if not self._in_flight or step.step_id != self._in_flight[0].step_id:
            expected = self._in_flight[0].step_id if self._in_flight else None
            raise RuntimeError(f"update() got step {step.step_id}, but the oldest step in "
                               f"flight is {expected}: update steps in the order scheduled")
        step = self._in_flight[0]  # the scheduler's record: resolved if it was planned ahead
        if hasattr(sampled_token_ids, "tolist"):  # a tensor: one transfer, not one per token
            sampled_token_ids = sampled_token_ids.tolist()
        sampled = [index(t) for t in sampled_token_ids]
        if len(sampled) != step.num_sampled:
            raise ValueError(f"step {step.step_id} samples {step.num_sampled} token(s), one per "
                             f"row with needs_logits; got {len(sampled)}")
        self._in_flight.popleft()
        ahead = {}  # async speculation: rows of the next step planned before these tokens
        if self._in_flight:
            ahead = {r.request_id: i for i, r in enumerate(self._in_flight[0].rows)
                     if r.draft_window is not None}
        resolved = {}
        finished = []
        tokens = iter(sampled)
        for row in (r for r in step.rows if r.needs_logits):
            req, chosen = row.request, [next(tokens) for _ in range(row.num_logits)]
            if req.finished:
                continue  # stopped in the step before; this row ran on a token it never kept
            position = row.sample_position  # where the (first) sampled token goes
            emitted = verify_row(self.bm, row, chosen, self.spec_stats) if row.num_draft \
                else chosen
            slot = position - len(req.prompt_token_ids)
            assert req.output_token_ids[slot] == PENDING, (req.request_id, slot)
            req.output_token_ids[slot:slot + 1] = emitted
            req.token_steps[slot + 1:slot + 1] = [step.step_id] * (len(emitted) - 1)
            rid = req.request_id
            if not row.num_draft and rid in self.bm and self.bm.has_pending(rid) and \
                    self.bm.num_tokens(rid) == position + 1:  # the next step reserved its slot
                self.bm.set_token(rid, emitted[0])
            status = self._stop(req, slot, len(emitted))
            if status is not None:
                self._finish(req, status)
                finished.append(req)
            elif rid in ahead and rid in self.bm:
                resolved[ahead[rid]] = self._resolve_ahead(
                    self._in_flight[0].rows[ahead[rid]], emitted)
        if resolved:
            nxt = self._in_flight[0]
            self._in_flight[0] = replace(nxt, rows=tuple(
                resolved.get(i, r) for i, r in enumerate(nxt.rows)))
        return finished

    def _resolve_ahead(self, row: ScheduledSeq, emitted: list[int]) -> ScheduledSeq:
        """The row the next step really ran for a request planned ahead of ``emitted`` (async
        speculation): A = len(emitted) - 1 drafts were kept, so the row starts A later, on the
        last emitted token, with drafts ``draft_window[A:A + num_draft]``; the block manager gets
        its tokens now, in the blocks held for it, and gives back the ones it did not need.
        The row returned is the one the plain loop would have scheduled."""
        rid, accepted = row.request_id, len(emitted) - 1
        drafts = row.draft_window[accepted:accepted + row.num_draft]
        self.bm.append_token(rid, emitted[-1])
        if drafts:
            self.bm.append_draft(rid, drafts)
        self.bm.release_reserve(rid)
        return replace(row, start=row.start + accepted, token_ids=(emitted[-1], *drafts),
                       input_from=None, draft_window=None)

    def _stop(self, req: Request, first: int, count: int) -> Status | None:
        """Whether one of the ``count`` tokens just placed at output slot ``first`` ends
        ``req``; if so, the output is cut after it (a row scheduled after it, or a verified
        token past it, keeps nothing)."""
        for slot in range(first, first + count):
            position = len(req.prompt_token_ids) + slot
            if req.output_token_ids[slot] in req.eos_token_ids:
                status = Status.FINISHED_STOPPED
            elif slot + 1 >= req.max_tokens or position + 1 >= self.config.max_model_len:
                status = Status.FINISHED_LENGTH
            else:
                continue
            del req.output_token_ids[slot + 1:]
            del req.token_steps[slot + 1:]
            return status
        return None

    def abort_steps_in_flight(self) -> None:
        """Undo every step still in flight, newest first (``abort_step``): what an engine does
        after a failure it cannot finish from, so that its requests can then be aborted."""
        while self._in_flight:
            self.abort_step(self._in_flight[-1])

    def abort_step(self, step: ScheduledStep) -> None:
        """Undo a step that failed before its KV was written (the runner raised): its requests
        go back to the waiting queue as if preempted, the tokens it was to sample are dropped,
        and blocks only they held leave the prefix cache (they hold no KV). Steps after it must
        be aborted first; steps before it can still be updated."""
        if not self._in_flight or step.step_id != self._in_flight[-1].step_id:
            raise RuntimeError(f"abort_step({step.step_id}): only the newest step in flight can "
                               "be aborted")
        step = self._in_flight.pop()
        for row in step.rows:
            req = row.request
            if row.needs_logits:
                slot = row.sample_position - len(req.prompt_token_ids)
                del req.output_token_ids[slot:]
                del req.token_steps[slot:]
            if req.status is Status.RUNNING:
                self._preempt(req, uncache=True)
                req.num_preemptions -= 1  # not the scheduler's choice: no preemption counted

    def abort_request(self, request_id: Hashable) -> Request:
        """Drop a request that is waiting or running (and in no step in flight), freeing its
        blocks; it finishes with ``Status.FINISHED_ERROR``."""
        req = self._live.get(request_id)
        if req is None:
            raise ValueError(f"abort_request: {request_id!r} is not waiting or running")
        if any(r.request is req for s in self._in_flight for r in s.rows):
            raise RuntimeError(f"abort_request({request_id!r}): it is in a step in flight; update "
                               "or abort that step first")
        if PENDING in req.output_token_ids:
            del req.output_token_ids[req.output_token_ids.index(PENDING):]
        self._finish(req, Status.FINISHED_ERROR)
        req.error = req.error or "aborted"
        return req

    def _finish(self, req: Request, status: Status) -> None:
        if req in self.running:
            self.bm.free(req.request_id)
            self.running.remove(req)
        elif req in self.waiting:  # preempted while its last token was in flight
            self.waiting.remove(req)
        del self._live[req.request_id]
        req.status = status
