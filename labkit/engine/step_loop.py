"""The engine's loop: what ``LLM.step`` does, plain or with async scheduling.

The plain loop is schedule -> run -> sample -> read tokens -> update. With async scheduling (the
default on a GPU) the host schedules step N+1, copies its metadata on the copy stream and queues
its kernels while the device is still computing step N, and only then reads step N's tokens:
the device never waits for Python between steps. Each step's samples go to the host in a
non-blocking copy into one of two pinned buffers (step N's and step N+1's), and a token's time
is taken when the host has read it.

With async speculation (the controlled draft), each step's accepted counts and next tokens are
counted on the device right after sampling (``labkit.kernels.rows_ahead.count_accepted``) and
the next step, already planned, reads them there (``labkit.engine.scheduler`` explains the
plan).

With speculative decoding under full CUDA Graphs, the verify graphs (one per request bucket,
for k + 1 tokens a row: ``labkit.engine.verify_graphs``) are captured before the first step,
since the runner is built before the scheduler that knows k; each step's record says which kind
of graph it replayed (``StepRecord.graph``), and ``graph_steps`` counts them.

A step that fails is undone (``Scheduler.abort_step``) before the error propagates; then
``generate`` drops its requests (``_abort_all``).

:class:`StepLoop` holds these methods; ``LLM`` inherits them, so they drive its scheduler,
runner and requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from labkit.engine.outputs import GRAPH_KINDS, RequestOutput, StepRecord
from labkit.engine.request import Request, ScheduledStep
from labkit.engine.sampling import SamplingParams
from labkit.engine.speculative import sample_with_drafts
from labkit.kernels.rows_ahead import count_accepted
from labkit.overlap import InFlightCopy, start_copy_to_host


@dataclass
class LiveRequest:
    request_id: int
    request: Request
    params: SamplingParams
    generator: torch.Generator | None
    arrival_s: float
    token_times_s: list[float] = field(default_factory=list)


@dataclass
class LaunchedStep:
    """A step on the device: its samples (device tensor) and their copy to the host."""
    step: ScheduledStep
    rows: list[LiveRequest]      # the rows that sample, in order
    tokens: torch.Tensor         # int64 [num_sampled] on the device
    host: InFlightCopy | None    # the non-blocking device-to-host copy (None on CPU)
    graph_batch: int | None
    start_s: float
    graph_tokens: int | None = None
    graph_query_len: int | None = None
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # device_step_times
    # per row that samples, the token after it, which the next step reads on the device; with
    # async speculation also the drafts kept before it (``rows_ahead.count_accepted``)
    next_tokens: torch.Tensor | None = None
    accepted: torch.Tensor | None = None


class StepLoop:
    """``LLM``'s step loop (see the module docstring)."""

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the outputs of the requests that finished in it (and of
        requests refused by ``add_request`` since the last call).

        Plain loop: schedule, run, sample, read the tokens, update. Async scheduling: schedule
        and launch step N+1, then read step N's tokens (the GPU already has N+1 queued) and
        update N; so the host's scheduling and metadata copy overlap the device's compute.
        """
        finished = [self._finished.pop(rid) for rid in list(self._finished)]
        launched = None
        if self.scheduler.has_unfinished_requests():
            step = self.scheduler.schedule()
            if step.rows:
                launched = self._launch(step, self._launched)
            elif self._launched is None:
                raise RuntimeError(
                    f"step {step.step_id} scheduled nothing while requests wait: "
                    f"{len(self.scheduler.waiting)} waiting, {len(self.scheduler.running)} "
                    "running (a scheduler bug)")
        if not self.async_scheduling and launched is not None:
            finished += self._complete(launched)
            return finished
        if self._launched is not None:
            prev, self._launched = self._launched, launched
            finished += self._complete(prev)
        else:
            self._launched = launched
        return finished

    def _launch(self, step: ScheduledStep, prev: LaunchedStep | None) -> LaunchedStep:
        start = self._now(sync=not self.async_scheduling)
        rows = [self._live[r.request_id] for r in step.rows if r.needs_logits]
        every = [self._live[r.request_id] for r in step.rows]
        events = None
        if self.device_step_times:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        ahead = self.async_scheduling and self.scheduler.config.speculative is not None
        try:
            prev_tokens, prev_accepted = (None, None) if prev is None else \
                (prev.next_tokens, prev.accepted)
            out = self.runner.execute(step, self.block_manager, prev_tokens, prev_accepted,
                                      None if events is None else events[0].record)
            # a verify row has a row of logits per position it checks: argmaxes for a greedy
            # request, the rejection rule's outcome for a sampled one
            tokens = sample_with_drafts(out.logits, step.rows, [e.params for e in every],
                                        [e.generator for e in every])
            accepted, next_tokens = None, tokens  # without drafts: one sample per row
            if ahead:  # what the next step, planned before these are read, moves by
                accepted, next_tokens = count_accepted(
                    tokens, out.inputs.input_ids, out.inputs.logits_indices,
                    out.inputs.sample_starts, 1 + self.scheduler.config.speculative.
                    num_speculative_tokens)
            if events is not None:
                events[1].record()
        except BaseException:
            self.scheduler.abort_step(step)
            raise
        host = None
        if self.device.type == "cuda":
            buf = self._token_buffers[step.step_id % 2]  # step N-1's buffer was read already
            host = start_copy_to_host(tokens, buf[:tokens.numel()])
        return LaunchedStep(step, rows, tokens, host, out.graph_batch, start, out.graph_tokens,
                            out.graph_query_len, events, next_tokens, accepted)

    def _complete(self, done: LaunchedStep) -> list[RequestOutput]:
        sampled = (done.host.synchronize() if done.host is not None else done.tokens).tolist()
        end = self._now(sync=not self.async_scheduling)
        kept = [not e.request.finished for e in done.rows]  # a stop in the step before drops it
        before = [len(e.request.output_token_ids) - 1 for e in done.rows]  # less its PENDING
        finished = self.scheduler.update(done.step, sampled)
        for entry, keep, n in zip(done.rows, kept, before):
            if keep:  # a verify row may emit several tokens at once
                new = len(entry.request.output_token_ids) - n
                entry.token_times_s += [end - entry.arrival_s] * new
        device_s = None
        if done.events is not None:  # the samples were read, so the end mark has passed
            done.events[1].synchronize()
            device_s = done.events[0].elapsed_time(done.events[1]) / 1e3
        self.step_history.append(StepRecord(done.step.stats, done.graph_batch, done.start_s,
                                            end, done.graph_tokens, done.graph_query_len,
                                            device_s))
        return [self._output(self._live.pop(r.request_id)) for r in finished]

    @property
    def graph_steps(self) -> dict[str, int]:
        """Steps run so far by how they ran (``StepRecord.graph``): "full" (a decode graph),
        "full verify" (a verify graph), "piecewise", "eager"."""
        counts = dict.fromkeys(GRAPH_KINDS, 0)
        for record in self.step_history:
            counts[record.graph] += 1
        return counts

    def _abort_all(self) -> None:
        """After a failed step: finish what is in flight if it can, drop every request."""
        if self._launched is not None:
            launched, self._launched = self._launched, None
            try:
                self._complete(launched)
            except BaseException:  # noqa: BLE001 (the step failed too: undo it instead)
                self.scheduler.abort_step(launched.step)
        # a step that failed after its launch (reading or updating its tokens) is still in
        # flight: undo it, or aborting its requests would fail and hide the first error
        self.scheduler.abort_steps_in_flight()
        for rid in list(self._live):
            if not self._live[rid].request.finished:
                self.scheduler.abort_request(rid)
        self._live.clear()
        self._finished.clear()
