"""The requests every putting_it_together study runs: a seeded workload and the engine options
that serve all of it at once. The experiment and the engine-step views both build on it."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from labkit import check_positive_int
from labkit.engine import SamplingParams


@dataclass(frozen=True)
class Workload:
    """Requests drawn from one seed: prompt and output lengths uniform in the inclusive ranges."""
    num_requests: int = 16
    prompt_len: tuple[int, int] = (16, 256)
    output_len: tuple[int, int] = (16, 64)
    seed: int = 0

    def __post_init__(self):
        check_positive_int("num_requests", self.num_requests)
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (low, high) with 1 <= low <= high, got "
                                 f"{(lo, hi)}")
            object.__setattr__(self, name, (lo, hi))  # a list from a notebook, kept hashable

    @property
    def max_len(self) -> int:
        return self.prompt_len[1] + self.output_len[1]

    def lengths(self) -> tuple[list[int], list[int]]:
        """Each request's (prompt lengths, output lengths): drawn from the seed alone, so a plan
        made without a model is the schedule of any model's run, whatever its vocabulary."""
        rng = random.Random(self.seed)
        prompt = [rng.randint(*self.prompt_len) for _ in range(self.num_requests)]
        output = [rng.randint(*self.output_len) for _ in range(self.num_requests)]
        return prompt, output

    def requests(self, vocab_size: int) -> tuple[list[list[int]], list[SamplingParams]]:
        check_positive_int("vocab_size", vocab_size)
        prompt, output = self.lengths()
        ids = random.Random(f"{self.seed}: token ids")  # its own stream: lengths stay as drawn
        prompts = [[ids.randrange(vocab_size) for _ in range(n)] for n in prompt]
        return prompts, [SamplingParams(max_tokens=n) for n in output]


def engine_options(workload: Workload, block_size: int = 16) -> dict:
    """LLM options for the workload: every request runs at once, the cache holds them all,
    and prefix caching is off so a repeat of the workload computes exactly what the first did."""
    blocks = workload.num_requests * math.ceil(workload.max_len / block_size)
    return {"num_blocks": blocks, "block_size": block_size,
            "max_num_seqs": workload.num_requests, "max_model_len": workload.max_len,
            "max_num_batched_tokens": max(2048, workload.num_requests),
            "enable_prefix_caching": False}
