"""What the scheduler hands the runner and back: requests, the rows of a step, step statistics.

A request's tokens are its prompt followed by its output so far; ``num_computed_tokens`` of them
have KV in the cache. A step is a list of rows, one per request, each computing a contiguous run
of positions: a decode row computes the last sampled token, a prefill row a chunk of the prompt
(or, after preemption, of prompt and output alike). With speculative decoding a decode row also
carries draft tokens after its last sampled token: a verify row, whose every position samples.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Hashable

from labkit.engine.speculative import SpecDecodeStats

PENDING = -1  # an output token scheduled for sampling whose id the host does not know yet


class Status(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # sampled an EOS id
    FINISHED_LENGTH = "finished_length"    # reached max_tokens or max_model_len
    FINISHED_ERROR = "finished_error"      # rejected: Request.error says why

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


@dataclass(eq=False)
class Request:
    request_id: Hashable
    prompt_token_ids: list[int]
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is cached, or is being written this step
    num_cached_tokens: int = 0    # of those, served by the prefix cache at the last admission
    num_preemptions: int = 0
    speculate: bool = False       # drafts may be proposed for it
    reference: list[int] | None = None  # controlled drafts: its greedy continuation, untimed
    error: str | None = None
    token_steps: list[int] = field(default_factory=list)  # the step that sampled each output
    spec_stats: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # its verify rows

    @property
    def num_tokens(self) -> int:
        """Prompt + output, counting a token still being sampled (``PENDING``)."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def is_decode(self) -> bool:
        """Only the last sampled token lacks KV (a recomputed request is in prefill again)."""
        return bool(self.output_token_ids) and self.num_computed_tokens == self.num_tokens - 1

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions ``[start, end)`` of prompt + output."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - n):end - n]


@dataclass(frozen=True)
class ScheduledSeq:
    """One row of a step: compute ``token_ids`` at positions ``[start, start + num_tokens)``."""
    request: Request
    start: int
    num_tokens: int
    token_ids: tuple[int, ...]
    is_prefill: bool
    needs_logits: bool  # the chunk reaches the request's last token: sample the next one
    # Async scheduling: the input token is PENDING, sampled by the step still in flight; the
    # runner takes it from that step's device tokens, row ``input_from`` of its samples.
    input_from: int | None = None
    # Speculative decoding: the last ``num_draft`` tokens are proposals to verify; the row then
    # samples at each of its last num_draft + 1 positions (what the target would emit there).
    num_draft: int = 0
    # Async speculation: the input token comes from the step in flight (``input_from``), whose
    # accepted count A is not known yet; the row is planned as if A = 0. On the device its
    # positions, slots and length move by A and its drafts are draft_window[A:A + num_draft];
    # ``update`` of that step resolves the row on the host the same way.
    draft_window: tuple[int, ...] | None = None

    @property
    def num_logits(self) -> int:
        """Rows of logits this row produces: one per sampled position."""
        return self.num_draft + 1 if self.needs_logits else 0

    @property
    def sample_position(self) -> int:
        """Where the first token this row samples goes in prompt + output."""
        return self.start + self.num_tokens - self.num_draft

    @property
    def request_id(self) -> Hashable:
        return self.request.request_id

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.num_tokens)


@dataclass(frozen=True)
class StepStats:
    step: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    padded_rows: int        # decode-only or uniform verify step padded up to its graph bucket
    prefix_hit_tokens: int  # prompt tokens of newly admitted requests served from the cache
    num_preempted: int
    num_running: int        # after this step was scheduled
    num_waiting: int
    num_spec_proposed: int = 0  # draft tokens verified in this step (in num_decode_tokens)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass(frozen=True)
class ScheduledStep:
    step_id: int
    rows: tuple[ScheduledSeq, ...]                # decodes first, then prefill chunks
    block_copies: tuple[tuple[int, int], ...]     # copy-on-write (src, dst): apply before compute
    preempted: tuple[Hashable, ...]
    stats: StepStats

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def is_decode_only(self) -> bool:
        """One new token per row, none a prefill: what a full decode graph replays."""
        return bool(self.rows) and not any(r.is_prefill or r.num_draft for r in self.rows)

    @property
    def num_sampled(self) -> int:
        """Rows of logits the step produces (a verify row gives one per position it checks)."""
        return sum(r.num_logits for r in self.rows)
