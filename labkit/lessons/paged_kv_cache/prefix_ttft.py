"""The time a prefix-cache hit saves: time to first token through labkit's engine, with prefix
caching on and off, for bursts of requests behind one shared system prompt.

Two engines over the same model, alike in every setting but ``enable_prefix_caching``, serve the
same bursts: ``burst`` requests arriving at once, each the shared system prompt followed by its
own fresh question, each asking for one token (so a request's time is its TTFT: admission,
prefill, the first sample). With caching on, the system prompt's full blocks are found in the
cache (a warm-up burst put them there) and only the questions are prefilled; off, every request
prefills its whole prompt. The two cases alternate in interleaved rounds
(:func:`labkit.measure.rounds.interleaved`), each round's figure the median TTFT over all its
requests, so the machine's drift lands on both alike. On a CPU the rounds run on one intra-op
thread (see :func:`one_thread_on_cpu`).
"""
from __future__ import annotations

import statistics
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from labkit import check_positive_int
from labkit.engine import LLM, ModelConfig, SamplingParams, random_model
from labkit.measure.bench import Timing
from labkit.measure.rounds import Rounds, Spread, interleaved

CACHED, UNCACHED = "prefix_cached", "prefix_uncached"


@dataclass(frozen=True)
class PrefixTTFT:
    """Both cases' TTFT per round, and what each request found in the prefix cache."""
    rounds: Rounds
    system_prompt_len: int
    question_len: int
    burst: int
    block_size: int
    cached_tokens: dict[str, int]   # per case: the fewest prompt tokens a timed request hit
    model: str

    @property
    def prompt_len(self) -> int:
        return self.system_prompt_len + self.question_len

    def ttft_ms(self, case: str) -> Spread:
        """The case's median TTFT per round, in milliseconds: median and range over rounds."""
        return Spread.of([us / 1e3 for us in self.rounds.us(case).values])

    def speedup(self) -> Spread:
        """Uncached TTFT over cached TTFT, taken within each round."""
        return self.rounds.ratio(UNCACHED, CACHED)

    def table(self):
        return self.rounds.table().assign(median_ms=lambda t: t.median_us / 1e3,
                                          low_ms=lambda t: t.low_us / 1e3,
                                          high_ms=lambda t: t.high_us / 1e3)[
            ["case", "median_ms", "low_ms", "high_ms", "relative_range", "rounds"]]


def model_for(device: torch.device, quick: bool, context: int, seed: int = 0):
    """On a GPU (not quick) the benchmarks' ~1B model in bf16; otherwise the tiny model in
    float32, its position table long enough for ``context`` tokens."""
    if device.type == "cuda" and not quick:
        config = ModelConfig.bench_1b()
    else:
        config = ModelConfig.tiny(max_position_embeddings=max(256, context))
    if config.max_position_embeddings < context:
        raise ValueError(f"{context} tokens of context exceed the model's "
                         f"max_position_embeddings={config.max_position_embeddings}: use a "
                         "shorter system prompt")
    return random_model(config, seed=seed, device=device)


@contextmanager
def one_thread_on_cpu(device: torch.device):
    """One intra-op thread while timing on a CPU, the previous count restored after. The tiny
    model's ops are too small to gain from a second thread, which only adds wake-ups; where the
    cores are shared, each op also waits for both threads to be scheduled, and that wait, not
    the prefill, is what the clock would measure."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def ttft_timer(fn, *, device=None, warmup: int = 1, repeats: int = 3) -> Timing:
    """A ``timer`` for :func:`interleaved`: ``fn()`` serves one burst and returns its outputs;
    the Timing is over every request's TTFT in ``repeats`` bursts, after ``warmup`` bursts."""
    for _ in range(warmup):
        fn()
    ttfts_us = sorted(o.ttft_s * 1e6 for _ in range(repeats) for o in fn())
    p20, p80 = np.percentile(ttfts_us, [20, 80])
    return Timing(statistics.median(ttfts_us), float(p20), float(p80), ttfts_us[0],
                  len(ttfts_us), str(device), "engine TTFT")


def time_prefix_ttft(model, *, system_prompt_len: int, question_len: int = 16, burst: int = 4,
                     rounds: int = 3, repeats: int = 5, block_size: int = 16, seed: int = 0
                     ) -> PrefixTTFT:
    """TTFT with prefix caching on and off (see the module docstring), ``rounds`` interleaved
    rounds of ``repeats`` bursts per case, each round after one warm-up burst per case."""
    for name, value in (("system_prompt_len", system_prompt_len), ("question_len", question_len),
                        ("burst", burst), ("repeats", repeats)):
        check_positive_int(name, value)
    config = model.config
    prompt_len = system_prompt_len + question_len
    blocks_per_request = -(-(prompt_len + 1) // block_size)
    settings = dict(block_size=block_size, max_model_len=prompt_len + 1, max_num_seqs=burst,
                    # every running request, the cached prompt and room for cached questions
                    num_blocks=(2 * burst + 1) * blocks_per_request)
    engines = {CACHED: LLM(model, enable_prefix_caching=True, **settings),
               UNCACHED: LLM(model, enable_prefix_caching=False, **settings)}
    g = torch.Generator().manual_seed(seed)
    system = torch.randint(0, config.vocab_size, (system_prompt_len,), generator=g).tolist()
    # Each case draws the same questions in the same order: both serve identical bursts.
    questions = {case: torch.Generator().manual_seed(seed + 1) for case in engines}
    hits: dict[str, list[int]] = {case: [] for case in engines}
    one_token = SamplingParams(max_tokens=1)

    def serve(case: str):
        q = questions[case]
        prompts = [system + torch.randint(0, config.vocab_size, (question_len,),
                                          generator=q).tolist() for _ in range(burst)]
        outs = engines[case].generate(prompts, one_token)
        failed = [o.error for o in outs if o.error]
        if failed:
            raise RuntimeError(f"{len(failed)} of the burst's requests failed: {failed[0]}")
        hits[case] += [o.num_cached_tokens for o in outs]
        return outs

    with one_thread_on_cpu(engines[CACHED].device):
        timed = interleaved({case: (lambda case=case: serve(case)) for case in engines},
                            rounds=rounds, warmup=1, repeats=repeats, timer=ttft_timer)
    name = (f"{config.num_hidden_layers} layers, width {config.hidden_size}, "
            f"{str(next(model.parameters()).dtype).replace('torch.', '')}")
    # The first warm-up burst with caching on computes the system prompt: count timed ones only.
    per_round = 1 + repeats
    counted = {case: [h for i, h in enumerate(hits[case]) if (i // burst) % per_round]
               for case in engines}
    return PrefixTTFT(timed, system_prompt_len, question_len, burst, block_size,
                      {case: min(v) for case, v in counted.items()}, name)
