"""A mixed step (one prompt chunk beside running decodes): its wall time against its GPU time.

    python benchmarks/mixed_step.py              # bench_1b on a GPU: 63 decodes + 512-token chunks
    python benchmarks/mixed_step.py --quick      # tiny model on a CPU, seconds

A running batch of ``num_decodes`` requests decodes while one long prompt arrives and is
prefilled ``chunk`` tokens a step: every step of that prompt is a mixed step of ``chunk +
num_decodes`` tokens. Per engine (``cudagraph_mode`` x ``async_scheduling``), per round:

* ``wall_ms``: the median time of one ``LLM.step()`` call over the prompt's middle chunks. With
  the plain loop that is the whole step, host work included (schedule, metadata, launches, the
  wait for the sampled tokens, the update); with async scheduling a call launches step N+1
  before it waits for step N, so in steady state it is the interval between steps, and the
  host's work hides behind the GPU's when it is shorter;
* ``gpu_ms``: one more such step's GPU time with the host out of the way (``gpu_time_ms``:
  the stream spins while the host queues the whole step, then events time it back to back);
* ``ratio`` = wall / GPU, chunk by chunk (the GPU times come from a second long prompt, at
  the same chunks: attention's cost grows with the context), the median over chunks. At 1.0
  the GPU never waits for the host.

The engines run in the same rounds, each round in a fresh shuffled order; each figure is the
median over rounds with its range, and a target is met only when every round clears it.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

import labkit  # noqa: F401  (device set-up before anything imports triton)
from labkit import check_positive_int
from labkit.device import describe, fingerprint, free_memory
from labkit.engine import LLM, ModelConfig, SamplingParams, random_model
from labkit.measure.bench import ENGINE_STEPS_L2
from labkit.measure.profile import trace
from labkit.measure.rounds import Spread

TARGET = 1.3  # issue "Graphs for every step": a replayed mixed step within 1.3x of its GPU time


@dataclass(frozen=True)
class MixedConfig:
    num_decodes: int = 63
    chunk: int = 512
    long_prompt: int = 7680        # 15 chunks of 512
    decode_prompt: int = 64
    measured_steps: int = 8        # timed steps per round, from the prompt's middle chunks
    rounds: int = 3
    max_position_embeddings: int = 8192
    kv_cache_memory: int = 4 * 2**30
    quick: bool = False
    modes: tuple[str, ...] = ("full_and_piecewise", "full_decode_only")
    seed: int = 0

    def __post_init__(self):
        for name in ("num_decodes", "chunk", "long_prompt", "decode_prompt", "measured_steps"):
            check_positive_int(name, getattr(self, name))
        if self.rounds < 3:
            raise ValueError(f"rounds must be at least 3 for a range, got {self.rounds}")
        if self.long_prompt < (self.measured_steps + 3) * self.chunk:
            raise ValueError(f"long_prompt={self.long_prompt} gives fewer than measured_steps + "
                             f"3 = {self.measured_steps + 3} chunks of {self.chunk}: lengthen it")

    @classmethod
    def small(cls) -> MixedConfig:
        return cls(num_decodes=7, chunk=32, long_prompt=32 * 8, decode_prompt=8,
                   measured_steps=4, max_position_embeddings=512, kv_cache_memory=2**24,
                   quick=True, modes=("none",))

    @property
    def model_config(self) -> ModelConfig:
        over = dict(max_position_embeddings=self.max_position_embeddings)
        return ModelConfig.tiny(**over) if self.quick else ModelConfig.bench_1b(**over)

    @property
    def chunks(self) -> int:
        return -(-self.long_prompt // self.chunk)


def make_engine(model, cfg: MixedConfig, mode: str, async_scheduling: bool) -> LLM:
    return LLM(model, enable_prefix_caching=False, enable_chunked_prefill=True,
               max_num_batched_tokens=cfg.chunk + cfg.num_decodes,
               max_num_seqs=cfg.num_decodes + 1, kv_cache_memory=cfg.kv_cache_memory,
               cudagraph_mode=mode, async_scheduling=async_scheduling)


def gpu_time_ms(llm: LLM, sleep_cycles: int = 10**8) -> float:
    """One step's GPU time with the host out of its way: the stream first spins for
    ``sleep_cycles`` (about 50 ms), long enough for the host to queue the whole step behind it;
    events then time the step's work back to back. (torch.profiler's kernel times are no use
    here: tracing each kernel of a replayed graph stretches the replay.)"""
    torch.cuda.synchronize(llm.device)
    start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    behind, complete = [], llm._complete
    # The plain loop's clock waits for the device as a step starts: it would wait out the spin.
    llm._now = lambda sync=True: LLM._now(llm, sync=False)

    def check(done):  # every launch is queued by now: was the stream still spinning?
        behind.append(not start.query())
        return complete(done)
    llm._complete = check
    try:
        torch.cuda._sleep(sleep_cycles)
        start.record()
        llm.step()
        end.record()
        torch.cuda.synchronize(llm.device)
    finally:
        del llm._complete, llm._now
    if not all(behind):
        raise RuntimeError("the step's launches outlasted the stream's spin, so its GPU time "
                           "would include the host's: raise sleep_cycles")
    return start.elapsed_time(end)


def _timed_chunks(llm: LLM, cfg: MixedConfig, prompt: list[int], time_one
                  ) -> tuple[list[float], list]:
    """Admit ``prompt``, then ``time_one(llm)`` for each of ``measured_steps`` steps from its
    third chunk on (the first two: admission, and async scheduling filling its pipeline); each
    timed step must be one chunk beside every decode. Then the prompt runs to its end.
    Returns (the times, the timed steps' records)."""
    rid = llm.add_request(prompt, SamplingParams(max_tokens=2))
    for _ in range(2):
        llm.step()
    first = len(llm.step_history)
    times = [time_one(llm) for _ in range(cfg.measured_steps)]
    steps = llm.step_history[first:first + cfg.measured_steps]
    mixed = [s for s in steps if s.stats.num_prefill_tokens == cfg.chunk
             and s.stats.num_decode_tokens == cfg.num_decodes]
    if len(steps) != cfg.measured_steps or len(mixed) != len(steps):
        raise RuntimeError(f"{len(steps) - len(mixed)} of the {len(steps)} timed steps were not "
                           f"a {cfg.chunk}-token chunk beside {cfg.num_decodes} decodes: "
                           f"{[s.stats for s in steps if s not in mixed][:2]}")
    while not any(o.request_id == rid for o in llm.step()):
        pass
    return times, steps


def _wall_ms(llm: LLM) -> float:
    t0 = time.perf_counter()
    llm.step()
    return (time.perf_counter() - t0) * 1e3


def one_round(llm: LLM, cfg: MixedConfig, seed: int, profile: bool = True) -> dict:
    """The running batch, then a long prompt whose middle chunks' ``step()`` calls are timed;
    on a GPU a second long prompt, each of the same chunks' GPU time (``gpu_time_ms``), and one
    more step profiled for its kernel count. Each ratio pairs a chunk with the same chunk of
    the other prompt (attention's cost grows with the chunk's context). Then every request runs
    to its end."""
    rng, vocab = random.Random(seed), llm.config.vocab_size
    # The decodes outlast both long prompts (their chunks and their outputs) by a margin.
    outlast = 3 * (cfg.chunks + 8)
    for _ in range(cfg.num_decodes):
        llm.add_request([rng.randrange(vocab) for _ in range(cfg.decode_prompt)],
                        SamplingParams(max_tokens=outlast))
    while llm.scheduler.waiting or not all(r.is_decode for r in llm.scheduler.running):
        llm.step()
    llm.step()

    def prompt():
        return [rng.randrange(vocab) for _ in range(cfg.long_prompt)]
    walls, steps = _timed_chunks(llm, cfg, prompt(), _wall_ms)
    out = {"wall_ms": statistics.median(walls), "walls_ms": walls,
           "graph": sorted({s.graph for s in steps}),
           "graph_tokens": sorted({s.graph_tokens for s in steps if s.graph_tokens})}
    if profile and llm.device.type == "cuda":  # on CPU there is no GPU time to set beside it
        gpus, _ = _timed_chunks(llm, cfg, prompt(), gpu_time_ms)
        ratios = [w / g for w, g in zip(walls, gpus)]
        out.update(gpu_ms=statistics.median(gpus), gpus_ms=gpus,
                   ratio=statistics.median(ratios), ratios=ratios)
        llm.add_request(prompt(), SamplingParams(max_tokens=2))
        for _ in range(3):
            llm.step()
        summary = trace(llm.step, warmup=0, device=llm.device).summary
        out.update(profiled_busy_ms=summary["gpu_busy_us"] / 1e3, kernels=summary["kernel_count"])
    while llm.has_unfinished_requests():
        llm.step()
    return out


def run(cfg: MixedConfig | None = None, quick: bool = False) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg is None:
        cfg = MixedConfig.small() if quick or device.type != "cuda" else MixedConfig()
    if device.type != "cuda" and cfg.modes != ("none",):
        cfg = replace(cfg, modes=("none",))  # no graphs without CUDA
    print(describe())
    print(f"L2: {ENGINE_STEPS_L2}")
    dtype = torch.float32 if cfg.quick else torch.bfloat16
    model = random_model(cfg.model_config, seed=cfg.seed, device=device, dtype=dtype)
    cases = [(mode, a) for mode in cfg.modes for a in (False, True)]
    engines = {c: make_engine(model, cfg, *c) for c in cases}
    for llm in engines.values():  # a rehearsal round: kernel variants compile before the clock
        one_round(llm, cfg, seed=-1, profile=False)
    per: dict = {c: [] for c in cases}
    order = random.Random(cfg.seed)
    for r in range(cfg.rounds):
        for c in order.sample(cases, len(cases)):
            per[c].append(one_round(engines[c], cfg, seed=1000 * r + cases.index(c)))
    del engines
    free_memory(device)
    rows = []
    for (mode, a), runs in per.items():
        wall = Spread.of([x["wall_ms"] for x in runs])
        row = {"cudagraph_mode": mode, "async_scheduling": a, "wall_ms": wall.as_dict(),
               "graph": runs[0]["graph"], "graph_tokens": runs[0]["graph_tokens"]}
        line = f"{mode:<20} async={str(a):<5} wall {wall:.2f} ms"
        if "gpu_ms" in runs[0]:
            gpu = Spread.of([x["gpu_ms"] for x in runs])
            ratio = Spread.of([x["ratio"] for x in runs])  # per round: the median chunk
            row.update(gpu_ms=gpu.as_dict(), ratio=ratio.as_dict(), met=ratio.below(TARGET),
                       kernels=runs[0]["kernels"],
                       profiled_busy_ms=[x["profiled_busy_ms"] for x in runs])
            line += (f"  GPU {gpu:.2f} ms  wall/GPU {ratio:.2f}x ("
                     f"{'within' if ratio.below(TARGET) else 'NOT within'} {TARGET}x in every "
                     f"round; {runs[0]['kernels']} kernels)")
        rows.append(row)
        print(f"{line}; steps ran {', '.join(runs[0]['graph'])}")
    return {"config": asdict(cfg), "fingerprint": fingerprint(), "target": TARGET, "rows": rows,
            "l2": ENGINE_STEPS_L2}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny model (automatic on CPU)")
    parser.add_argument("--out", type=Path, default=None, help="write mixed_step.json here")
    args = parser.parse_args()
    results = run(quick=args.quick)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "mixed_step.json").write_text(json.dumps(results, indent=1, default=str))
