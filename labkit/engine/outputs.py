"""What the engine hands back: each request's output, each step's record, the totals."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from labkit.engine.request import Status, StepStats

FINISH_REASONS = {Status.FINISHED_STOPPED: "stop", Status.FINISHED_LENGTH: "length",
                  Status.FINISHED_ERROR: "error"}


class AcceptedDrafts:
    """``mean_accepted_length`` of anything that counts ``num_spec_verifies`` and
    ``num_spec_accepted`` (one request's output, or the engine's totals)."""

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per verify row (NaN without one)."""
        return self.num_spec_accepted / self.num_spec_verifies if self.num_spec_verifies \
            else math.nan


@dataclass
class RequestOutput(AcceptedDrafts):
    index: int                       # position in the prompts given to generate()
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str               # "stop" (a stop token), "length" or "error"
    error: str | None = None         # why the request was refused: the others still ran
    ttft_s: float | None = None      # arrival -> first token
    tpot_s: float | None = None      # mean time between later tokens; None with one token
    token_times_s: list[float] = field(default_factory=list)  # each token, since arrival
    num_cached_tokens: int = 0       # prompt tokens served by the prefix cache (last admission)
    num_preemptions: int = 0
    text: str | None = None          # decoded, when the LLM has a tokenizer
    request_id: int = -1             # add_request's id (generate's index is the prompt's place)
    # Speculative decoding: its verify rows, draft tokens proposed and accepted in them, and
    # the target forwards that sampled its tokens (prefill chunks that sample nothing left out)
    num_spec_verifies: int = 0
    num_spec_proposed: int = 0
    num_spec_accepted: int = 0
    num_forwards: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def forwards_per_token(self) -> float:
        """Target forwards per output token: 1 for plain decoding, less when drafts pay off."""
        return self.num_forwards / len(self.token_ids) if self.token_ids else math.nan


GRAPH_KINDS = ("full", "full verify", "piecewise", "eager")  # how a step ran (StepRecord.graph)


@dataclass(frozen=True)
class StepRecord:
    stats: StepStats
    graph_batch: int | None          # the request bucket a full (decode or verify) graph replayed
    start_s: float                   # on the engine's clock
    end_s: float                     # after the device finished the step and its sampling
    graph_tokens: int | None = None  # the token bucket piecewise graphs replayed at
    graph_query_len: int | None = None  # a full verify graph's tokens per row (k + 1)
    device_s: float | None = None    # LLM(device_step_times=True): its time on the device

    @property
    def graph(self) -> str:
        """How the step ran (``GRAPH_KINDS``): "full" (a decode graph), "full verify" (a verify
        graph: every row k + 1 tokens), "piecewise" or "eager"."""
        if self.graph_batch is not None:
            return "full" if self.graph_query_len is None else "full verify"
        return "eager" if self.graph_tokens is None else "piecewise"

    @property
    def padded_tokens(self) -> int:
        """Tokens computed and dropped: a full graph's padding rows (one token each in a decode
        graph, k + 1 in a verify graph) or the padding up to the piecewise token bucket."""
        if self.graph_tokens is not None:
            return self.graph_tokens - self.stats.num_tokens
        if self.graph_batch is None:
            return 0
        return self.stats.padded_rows * (self.graph_query_len or 1)

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class EngineStats(AcceptedDrafts):
    num_steps: int
    num_graph_steps: int             # steps that replayed a full graph (decode or verify)
    prefill_tokens: int
    decode_tokens: int
    padded_rows: int
    prefix_hit_tokens: int
    preemptions: int
    num_piecewise_steps: int = 0     # steps that replayed piecewise graphs
    padded_tokens: int = 0           # tokens computed for padding, full and piecewise graphs
    num_spec_proposed: int = 0       # draft tokens verified (speculative decoding)
    num_spec_accepted: int = 0       # of those, the ones the target agreed with
    num_spec_verifies: int = 0       # verify rows (one per request per step with drafts)

    @property
    def prefix_hit_rate(self) -> float:
        """Of the prompt tokens admitted (recomputes included), the share served from the
        prefix cache instead of computed."""
        total = self.prefix_hit_tokens + self.prefill_tokens
        return self.prefix_hit_tokens / total if total else 0.0
