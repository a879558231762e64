"""Speculative decoding: propose k tokens cheaply, check them in one target forward, keep a prefix.

A verify step feeds a request's last token and its k draft tokens to the target as one
(k + 1)-token query. Its k + 1 output distributions say, for each draft token, what the target
would have produced there. The emitted tokens are the accepted drafts plus one token of the
target's own, so a step emits between 1 and k + 1 tokens for one target forward. If each draft
token is accepted independently with probability ``a`` (stopping at the first rejection), a
step emits ``(1 - a^(k+1)) / (1 - a)`` tokens on average (:func:`expected_tokens_per_step`).

- Proposers: :class:`NgramProposer` (prompt lookup: the request's own tokens) and
  :class:`ControlledProposer` (a teaching draft of a chosen acceptance rate that costs nothing).
- Acceptance: :func:`accept_greedy` (greedy requests: the output is exactly plain decoding's)
  and :func:`rejection_sample` (sampled requests: the output distribution is exactly the
  target's, whatever the draft); :func:`rejection_sample_point_drafts` is its case for a
  deterministic draft (n-gram, controlled), where q is a point mass.
- Rollback of the rejected tokens' KV lives in ``BlockManager.append_draft`` / ``accept_draft``.
- In the engine: ``propose_drafts`` and ``verify_row``, called by the scheduler, and
  ``sample_with_drafts``, called by the LLM on each step's logits.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from hashlib import blake2b
from typing import Hashable, Sequence

import torch

from labkit import check_positive_int
from labkit.engine.sampling import SamplingParams, sample, sampling_probs

METHODS = ("ngram", "controlled", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a request's next tokens are proposed: ``LLM(..., speculative=...)``. The engine runs
    ``"ngram"`` (every request), ``"controlled"`` (greedy requests: the LLM first computes
    each one's greedy continuation in an untimed reference run; what it measures is the upper
    bound for a draft of that acceptance rate, on random weights) and ``"draft"`` (every
    request: ``draft_model``, a smaller model over the same vocabulary, proposes its own greedy
    tokens). With async scheduling only ``"controlled"`` runs: the next step is planned
    before this one's accepted count is read, and only its drafts can be proposed for every
    outcome (``labkit.engine.scheduler``)."""
    method: str = "ngram"           # "ngram", "controlled" or "draft" (a smaller model)
    num_speculative_tokens: int = 4  # k: draft tokens per verify step
    min_n: int = 1                  # ngram: shortest suffix n-gram looked up
    max_n: int = 3                  # ngram: longest, tried first
    acceptance: float = 0.8         # controlled: chance that each draft token is right
    seed: int = 0                   # controlled: which tokens go wrong
    draft_model: object = field(default=None, compare=False, repr=False)  # draft: the model

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {self.method!r}")
        check_positive_int("num_speculative_tokens", self.num_speculative_tokens,
                           hint="k, the draft tokens each verify step checks")
        check_positive_int("min_n", self.min_n, hint="the shortest n-gram looked up")
        check_positive_int("max_n", self.max_n, hint="the longest n-gram looked up")
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must be <= max_n ({self.max_n}): n-grams of "
                             "max_n tokens are tried first, down to min_n")
        a = self.acceptance
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise ValueError(f"acceptance must be a probability in [0, 1], got {a!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.method == "draft":
            if not isinstance(self.draft_model, torch.nn.Module) or \
                    not hasattr(self.draft_model, "config"):
                raise ValueError("method 'draft' needs draft_model: a labkit model (LlamaModel) "
                                 "over the target's vocabulary, e.g. random_model(ModelConfig."
                                 f"tiny(...)); got {type(self.draft_model).__name__}")
        elif self.draft_model is not None:
            raise ValueError(f"draft_model is used by method 'draft' only, not {self.method!r}")


# ---------------------------------------------------------------- proposers
class NgramProposer:
    """Prompt lookup: if the last n tokens occurred before in the request, propose what followed.

    n goes from ``max_n`` down to ``min_n``: the longest match wins, and among its earlier
    occurrences the most recent one. The proposal stops at k tokens or at the sequence's end
    (an occurrence ending just before the suffix proposes fewer). No match: ``[]``.
    It pays off when the output quotes its input: code edits, summaries, retrieval answers.
    """

    def __init__(self, min_n: int, max_n: int, k: int):
        check_positive_int("k", k, hint="draft tokens per verify step")
        SpeculativeConfig("ngram", k, min_n, max_n)  # validates min_n and max_n
        self.min_n, self.max_n, self.k = min_n, max_n, k

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        tokens = list(token_ids)
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            for start in range(length - n - 1, -1, -1):  # most recent earlier occurrence first
                if tokens[start:start + n] == suffix:
                    return tokens[start + n:start + n + self.k]
        return []


class DraftModelProposer:
    """A smaller model proposes its own greedy continuation, k tokens, one forward each.

    Each forward recomputes the whole sequence through the model's plain causal path: the draft
    keeps no KV cache of its own, so its cost grows with the sequence, where an engine's draft
    has a paged cache beside the target's. Its tokens are its own, so acceptance is measured,
    not chosen: two models with random weights rarely agree."""

    def __init__(self, model: torch.nn.Module, k: int):
        check_positive_int("k", k, hint="draft tokens per verify step")
        self.model, self.k = model, k
        self.device = next(model.parameters()).device

    @torch.no_grad()
    def propose(self, token_ids: Sequence[int]) -> list[int]:
        tokens = torch.tensor([list(token_ids)], device=self.device)
        out = []
        for _ in range(self.k):
            nxt = self.model(tokens)[0, -1].argmax()
            out.append(int(nxt))
            tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
        return out


def _uniform(*key) -> float:
    """A number in [0, 1) fixed by ``key``, the same in every process and batch order."""
    digest = blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class ControlledProposer:
    """A draft with a chosen acceptance rate, read from the target's greedy continuation.

    ``reference`` is the continuation an untimed greedy run of the target produced for the
    request; ``start`` is how many of its tokens the request has emitted. Each of the next k
    positions is proposed correctly (``reference[start + i]``) with probability ``acceptance``,
    else as a different id. Every position draws its own coin, also after a wrong one: the
    tokens past the first wrong one are never accepted (verification stops there), but the draft
    keeps its length k, so every verify step has the same shape. The target's own token at the
    wrong position is the reference's (the reference run's steps take the verify steps' shape,
    ``labkit.engine.reference_run``), so the request stays on the reference, and the next step
    starts past that position with fresh coins: accepted lengths are independent, with
    P(accepted >= i) = acceptance^i (capped at k). The coins depend only on
    (seed, request_key, position), not on batching or preemption.
    It costs nothing to run, so what it measures is the upper bound for a draft of that rate
    (on random weights, in the engine): a real draft pays for its own forwards.
    """

    def __init__(self, acceptance: float, k: int, seed: int = 0):
        check_positive_int("k", k, hint="draft tokens per verify step")
        SpeculativeConfig("controlled", k, acceptance=acceptance, seed=seed)
        self.acceptance, self.k, self.seed = acceptance, k, seed

    def propose(self, reference: Sequence[int], start: int, vocab_size: int,
                request_key: Hashable = 0, count: int | None = None) -> list[int]:
        """Up to k tokens (or ``count``) for positions ``start, start + 1, ...`` of
        ``reference``. A position's token never depends on ``start`` or ``count``: async
        speculation proposes a window past the outcome still on the device and picks from it."""
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start:
            raise ValueError(f"start must be an int >= 0 (tokens emitted so far), got {start!r}")
        check_positive_int("vocab_size", vocab_size)
        if count is None:
            count = self.k
        elif isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0 (tokens to propose), got {count!r}")
        if vocab_size < 2 and self.acceptance < 1:
            raise ValueError("vocab_size must be >= 2 for a wrong token to exist; "
                             f"got {vocab_size} with acceptance {self.acceptance}")
        out = []
        for pos in range(start, min(start + count, len(reference))):
            right = int(reference[pos])
            if _uniform(self.seed, request_key, pos) < self.acceptance:
                out.append(right)
            else:  # uniform over the other vocab_size - 1 ids
                shift = 1 + int(_uniform(self.seed, request_key, pos, "wrong") * (vocab_size - 1))
                out.append((right + shift) % vocab_size)
        return out


# ---------------------------------------------------------------- acceptance
def _ids(x, name: str) -> list[int]:
    if isinstance(x, torch.Tensor):
        if x.dim() != 1:
            raise ValueError(f"{name} must be 1-D [num_tokens], got shape {tuple(x.shape)}")
        return x.tolist()
    return [int(t) for t in x]


def accept_greedy(draft_tokens, target_argmax) -> tuple[int, int]:
    """Greedy verification: ``(num_accepted, next_token)``.

    ``draft_tokens: [k]``; ``target_argmax: [k + 1]``, the target's argmax after the last token
    and after each draft token. Drafts are accepted while they equal the target's choice; the
    next token is the target's own at the first mismatch (or its bonus token after all k).
    The emitted tokens are exactly what k + 1 plain greedy decode steps would produce.
    """
    draft, target = _ids(draft_tokens, "draft_tokens"), _ids(target_argmax, "target_argmax")
    if len(target) != len(draft) + 1:
        raise ValueError(f"target_argmax needs one entry per draft token plus one (the bonus "
                         f"position): got {len(target)} for {len(draft)} draft tokens")
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n, target[n]


def rejection_sample(draft_tokens, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> list[int]:
    """Sampled verification; returns the emitted tokens: the accepted drafts plus one more.

    ``draft_tokens: [k]`` sampled from ``draft_probs: [k, vocab]`` (q);
    ``target_probs: [k + 1, vocab]`` (p). Draft token x is accepted with probability
    min(1, p(x) / q(x)). At the first rejection the replacement is drawn from
    normalize(max(p - q, 0)), the mass p has that q under-proposed; if all k are accepted a
    bonus token is drawn from p's last row. Each emitted token is then distributed exactly as
    p: P(x) = q(x) min(1, p(x)/q(x)) + P(reject) (p(x) - q(x))+ / sum((p - q)+) = p(x).
    """
    draft = _ids(draft_tokens, "draft_tokens")
    k = len(draft)
    if draft_probs.dim() != 2 or draft_probs.shape[0] != k:
        raise ValueError(f"draft_probs must be [k={k}, vocab], got {tuple(draft_probs.shape)}")
    if target_probs.shape != (k + 1, draft_probs.shape[1]):
        raise ValueError(f"target_probs must be [k + 1 = {k + 1}, vocab = "
                         f"{draft_probs.shape[1]}], got {tuple(target_probs.shape)}")
    out = []
    for i, x in enumerate(draft):
        p, q = target_probs[i], draft_probs[i]
        u = torch.rand((), generator=generator, device=p.device)
        if u * q[x] < p[x]:  # u < p/q without dividing; q(x) = 0 < p(x) always accepts
            out.append(x)
            continue
        residual = torch.clamp(p - q, min=0)
        if residual.sum() <= 0:  # p == q up to rounding: no rejection should have happened
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[k], 1, generator=generator)))
    return out


def rejection_sample_point_drafts(draft_tokens, target_probs: torch.Tensor,
                                  generator: torch.Generator | None = None) -> list[int]:
    """:func:`rejection_sample` for a deterministic draft (n-gram, controlled): q is a point
    mass on each draft token, so draft x is accepted with probability p(x), and at the first
    rejection the replacement is drawn from p with x removed, renormalised ((p - q)+ is p
    without x); after k acceptances the bonus token comes from p's last row. (The same law as
    drawing y ~ p at every position and keeping x while y == x: P(y = x) = p(x), and a y that
    differs is p without x; for a point-mass draft, "sample, then match as greedy" is exact.)
    ``target_probs: [k + 1, vocab]``; returns the emitted tokens."""
    draft = _ids(draft_tokens, "draft_tokens")
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be [k + 1, vocab], got {tuple(target_probs.shape)}")
    point = torch.zeros(len(draft), target_probs.shape[1], dtype=target_probs.dtype,
                        device=target_probs.device)
    point[torch.arange(len(draft)), torch.tensor(draft, dtype=torch.long)] = 1
    return rejection_sample(draft, point, target_probs, generator)


# ---------------------------------------------------------------- statistics
def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Mean tokens a verify step emits when each draft token is right with probability a,
    independently: 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a)."""
    if acceptance == 1:
        return float(k + 1)
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


@dataclass
class SpecDecodeStats:
    """Proposed and accepted draft tokens, over verify steps (one per request per step): the
    scheduler keeps one over every request, each ``Request`` its own."""
    num_verifies: int = 0
    num_proposed: int = 0
    num_accepted: int = 0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        """One request's verify: ``num_proposed`` drafts, of which ``num_accepted`` kept."""
        if not 0 <= num_accepted <= num_proposed:
            raise ValueError(f"num_accepted ({num_accepted}) must be in [0, num_proposed = "
                             f"{num_proposed}]")
        self.num_verifies += 1
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens."""
        return self.num_accepted / self.num_proposed if self.num_proposed else math.nan

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per verify."""
        return self.num_accepted / self.num_verifies if self.num_verifies else math.nan

    @property
    def tokens_per_forward(self) -> float:
        """Emitted tokens per target forward: the accepted drafts plus the target's own token."""
        return 1 + self.mean_accepted_length


# --- in the engine's scheduler ----------------------------------------------------------------

def make_proposer(config: SpeculativeConfig
                  ) -> NgramProposer | ControlledProposer | DraftModelProposer:
    """The proposer the engine runs for ``config``."""
    k = config.num_speculative_tokens
    if config.method == "ngram":
        return NgramProposer(config.min_n, config.max_n, k)
    if config.method == "controlled":
        return ControlledProposer(config.acceptance, k, config.seed)
    return DraftModelProposer(config.draft_model, k)


def propose_drafts(proposer: NgramProposer | ControlledProposer | DraftModelProposer, bm, req,
                   budget: int, max_model_len: int, vocab_size: int | None = None) -> list[int]:
    """Draft tokens for a decode row of ``req`` (a ``labkit.engine.request.Request`` whose last
    token was just appended to ``bm``): at most k, no more than ``budget`` tokens, than its
    max_tokens and max_model_len could keep, and only if the blocks for them are free (drafts
    never preempt anyone). A controlled proposer reads ``req.reference`` (none: no drafts)."""
    room = min(budget, req.max_tokens - len(req.output_token_ids) - 1,
               max_model_len - req.num_tokens - 1)
    if room <= 0:
        return []
    if isinstance(proposer, ControlledProposer):
        if req.reference is None:
            return []
        drafts = proposer.propose(req.reference, len(req.output_token_ids), vocab_size,
                                  req.request_id)[:room]
    else:
        drafts = proposer.propose(req.token_ids(0, req.num_tokens))[:room]
    if drafts and not bm.can_append_draft(req.request_id, len(drafts)):
        return []
    return drafts


def verify_row(bm, row, targets: Sequence[int], stats: SpecDecodeStats) -> list[int]:
    """The tokens a verify row emits (a ``ScheduledSeq`` with ``num_draft`` drafts; ``targets``:
    the target's greedy choice at each of its num_draft + 1 positions): the drafts it agrees
    with, then its own. The rejected drafts' slots are rolled back in ``bm``; the accepted ones'
    KV, written by this row, counts as computed."""
    drafts = row.token_ids[-row.num_draft:]
    accepted, bonus = accept_greedy(drafts, targets)
    stats.record(row.num_draft, accepted)
    row.request.spec_stats.record(row.num_draft, accepted)
    if row.request_id in bm:  # else preempted while in flight (async): no KV is kept
        bm.accept_draft(row.request_id, accepted)
        row.request.num_computed_tokens += accepted
    return [*drafts[:accepted], bonus]


_ARGMAX = SamplingParams(max_tokens=1)  # sample() takes the argmax and draws nothing


def sample_with_drafts(logits: torch.Tensor, rows, params: Sequence[SamplingParams],
                       generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """logits: [num_sampled, vocab], ``row.num_logits`` per row of ``rows`` (``ScheduledSeq``s,
    with ``params`` and ``generators`` one per row) -> int64 [num_sampled], what the scheduler's
    ``update`` reads. A row without drafts, or a greedy request's verify row, is ``sample``d
    position by position (a verify row's argmaxes go through ``accept_greedy``). A sampled
    request's verify row is decided here by the rejection rule, with its own generator, and
    written as the choices that ``accept_greedy`` turns into the same tokens: the accepted
    drafts, then the replacement or bonus token (repeated over positions never reached)."""
    flat_params, flat_generators, verify = [], [], []
    start = 0
    for row, p, g in zip(rows, params, generators):
        n = row.num_logits
        rejection = row.num_draft > 0 and n > 0 and not p.greedy
        if rejection:
            verify.append((start, row, p, g))
        flat_params += [_ARGMAX if rejection else p] * n
        flat_generators += [None if rejection else g] * n
        start += n
    tokens = sample(logits, flat_params, flat_generators)
    for start, row, p, g in verify:
        n = row.num_logits
        probs = torch.stack([sampling_probs(logits[start + i].float(), p) for i in range(n)])
        emitted = rejection_sample_point_drafts(row.token_ids[-row.num_draft:], probs, g)
        chosen = emitted + [emitted[-1]] * (n - len(emitted))
        tokens[start:start + n] = torch.tensor(chosen, dtype=tokens.dtype, device=tokens.device)
    return tokens
