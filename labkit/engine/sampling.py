"""How the next token is chosen from a row of logits: greedy, or sampled with temperature and
top-p (nucleus), each request from its own seeded generator.

A request's generator belongs to the request, not to the batch: which other requests share its
steps, and in which order, then never changes what it samples. The same seed gives the same
tokens run after run (on one device type and dtype: logits are not bit-identical across them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from operator import index

import torch

from labkit import check_positive_int


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0   # 0: greedy (argmax); higher: flatter distribution
    top_p: float = 1.0         # keep the smallest set of tokens holding this much probability
    seed: int | None = None    # None: drawn from the LLM's seed, one per request
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        check_positive_int("max_tokens", self.max_tokens, hint="tokens to generate")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got "
                             f"{self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) \
                or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {self.seed!r}")
        try:
            if any(isinstance(t, bool) for t in self.stop_token_ids):
                raise TypeError  # True is not a token id
            stops = tuple(index(t) for t in self.stop_token_ids)
        except TypeError:
            raise ValueError(f"stop_token_ids must be ints, got {self.stop_token_ids!r}") from None
        if any(t < 0 for t in stops):  # a negative id is never sampled: it would never stop
            raise ValueError(f"stop_token_ids must be token ids >= 0, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def top_p_probs(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs: [vocab] -> [vocab] renormalised over the nucleus: the most likely tokens whose
    mass reaches ``top_p``. The most likely token always stays."""
    if top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # mass of the tokens ranked above each one
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    kept = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return kept / kept.sum()


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits: [vocab] -> float32 [vocab], the distribution a sampled request draws from: the
    softmax at its temperature, renormalised over its top-p nucleus."""
    # Shifted by the row maximum and divided in float64, a tiny temperature gives 0 for the
    # top token and -inf for the rest (float32 overflows to inf - inf = NaN below ~1e-38).
    scaled = (logits.double() - logits.max()) / params.temperature
    return top_p_probs(torch.softmax(scaled, dim=-1).float(), params.top_p)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [num_rows, vocab] -> int64 [num_rows] on the logits' device.

    Greedy rows take the argmax (all at once); each sampled row draws from its own generator.
    """
    if logits.shape[0] != len(params) or len(params) != len(generators):
        raise ValueError(f"{logits.shape[0]} rows of logits, {len(params)} params and "
                         f"{len(generators)} generators: need one of each per row")
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    for i, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        tokens[i] = torch.multinomial(sampling_probs(logits[i], p), 1, generator=g)[0]
    return tokens


def request_generator(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)
