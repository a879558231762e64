"""labkit's engine against Hugging Face transformers on the same weights, in the same run.

    python benchmarks/engine.py --out results/            # the full benchmark on a GPU
    python benchmarks/engine.py --out /tmp/q --quick      # tiny model, seconds on a CPU

``BenchmarkConfig`` (fixed seed): a random-weight Llama (``ModelConfig.bench_1b``, bf16), 256
requests, prompts of 64..2048 random token ids, 32..512 output tokens each; stop tokens are
ignored, so every request produces exactly its output length. Sections, each run even if
another failed:

1. ``labkit``: ``LLM.generate`` over all requests at once, the engine's defaults (CUDA Graphs
   on in the default ``cudagraph_mode``, each layer's small ops as three fused kernels);
   ``labkit_full_decode_only``: full graphs for uniform decode steps only, every other step
   eager (mode_gain = labkit / this); ``labkit_compiled``: ``compile=True``, the same graphs
   with Inductor's fusion of the plain ops in place of labkit's hand-fused kernels
   (compile_gain = this / labkit)
2. ``labkit_unfused``: the same with ``fused_ops=False`` (fused_gain = labkit / this);
   ``labkit_eager``: ``enforce_eager=True``, unfused (graphs_gain = labkit_unfused / this)
3. ``prefix_cached`` / ``prefix_uncached``: every prompt behind one shared 1,024-token system
   prompt, prefix caching on and off (hit rate and throughput gain)
4. ``transformers``: ``LlamaForCausalLM.generate`` loaded from the same safetensors, static
   cache, decode forward under ``torch.compile``, batches of requests with similar prompt
   lengths, left padding, greedy, ``max_new_tokens`` = the batch's longest output. Only each
   request's own output tokens count as useful.
5. ``compile_start`` (the full run only, not ``--quick``, and only with ``labkit_compiled``
   among the sections): ``LLM(compile=True)``'s first generate in a fresh process with an
   empty Inductor cache (cold), then with the cache that left (warm).

Throughput is output tokens / wall time; warm-up (kernel JIT, graph capture, compilation) runs
before the clock starts, for both. The sections run in ``rounds`` rounds (default 3), each in a
fresh shuffled order, so the machine's drift lands on all of them alike: a section reports its
median pass with the range of its throughput, every ratio is the median of the per-round ratios
with their range, and the 2x target over transformers is met only when every round clears it. TTFT is from the moment all requests are handed over.
``--quick`` (and any run without CUDA): ``ModelConfig.tiny()``, 8 short requests, float32.
``record()`` returns the results dict for ``make record``.
"""
from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from typing import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import labkit  # noqa: F401  (device set-up before anything imports triton)
from labkit import check_positive_int
from labkit.device import describe, fingerprint, free_memory, synchronize
from labkit.engine import LLM, ModelConfig, SamplingParams, random_model, save_weights
from labkit.engine.compiled import compile_start
from labkit.engine.runner import resolve_cudagraph_mode
from labkit.lessons.putting_it_together.engine_report import report, write
from labkit.lessons.putting_it_together.transformers_peer import (
    TransformersPeer,
    summary,
)
from labkit.measure.bench import ENGINE_STEPS_L2, TritonCompiles
from labkit.measure.rounds import Spread

TARGET_VS_TRANSFORMERS = 2.0  # labkit's throughput over transformers', met in every round
SECTIONS = ("labkit", "labkit_compiled", "labkit_full_decode_only", "labkit_unfused",
            "labkit_eager", "prefix_cached", "prefix_uncached", "transformers")


@dataclass(frozen=True)
class BenchmarkConfig:
    """The benchmark's requests (drawn from ``seed`` by a torch generator, behind one shared
    system prompt), its model and dtype, and the limits both engines run under."""
    num_requests: int = 256
    prompt_lens: tuple[int, int] = (64, 2048)      # inclusive range
    output_lens: tuple[int, int] = (32, 512)
    system_prompt_len: int = 1024
    dtype: str = "bfloat16"
    quick: bool = False
    seed: int = 0
    init_std: float = 0.02
    hf_batch_size: int = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    rounds: int = 3              # passes over every section, each in a fresh shuffled order
    compile_start: bool = True   # time compile=True's cold and warm start in fresh processes

    def __post_init__(self):
        for name in ("prompt_lens", "output_lens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        check_positive_int("num_requests", self.num_requests)
        check_positive_int("hf_batch_size", self.hf_batch_size,
                           hint="requests per transformers generate() call")
        check_positive_int("rounds", self.rounds, hint="passes over every section")
        if self.rounds < 3:
            raise ValueError(f"rounds must be at least 3 for a range to mean anything, got "
                             f"{self.rounds}")

    @classmethod
    def small(cls) -> BenchmarkConfig:
        # A wide init keeps greedy argmaxes far from ties, so labkit and transformers must agree
        # token for token (the benchmark's own correctness guard).
        return cls(num_requests=8, prompt_lens=(4, 24), output_lens=(2, 8), system_prompt_len=32,
                   dtype="float32", quick=True, init_std=0.2, hf_batch_size=4,
                   max_num_seqs=8, max_num_batched_tokens=256, compile_start=False)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.tiny() if self.quick else ModelConfig.bench_1b()

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def requests(self) -> tuple[list[list[int]], list[int], list[int]]:
        """(prompts, output lengths, system prompt), the same for every run of this config."""
        g = torch.Generator().manual_seed(self.seed)
        vocab = self.model_config.vocab_size
        plens = torch.randint(self.prompt_lens[0], self.prompt_lens[1] + 1, (self.num_requests,),
                              generator=g).tolist()
        olens = torch.randint(self.output_lens[0], self.output_lens[1] + 1, (self.num_requests,),
                              generator=g).tolist()
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in plens]
        system = torch.randint(0, vocab, (self.system_prompt_len,), generator=g).tolist()
        return prompts, olens, system


# --- labkit -----------------------------------------------------------------------------------

def run_labkit(model, prompts, olens, cfg: BenchmarkConfig, *, enforce_eager=False,
               enable_prefix_caching=True, fused_ops=None, cudagraph_mode=None, compile=False
               ) -> tuple[dict, list[list[int]]]:
    llm = LLM(model, enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching,
              fused_ops=fused_ops, cudagraph_mode=cudagraph_mode, compile=compile,
              max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
              max_model_len=min(cfg.model_config.max_position_embeddings,
                                cfg.system_prompt_len + cfg.prompt_lens[1] + cfg.output_lens[1]))
    try:
        # Warm-up: the workload's own prompt lengths with other token ids (no prefix hits carried
        # over) and short outputs, so every kernel variant the clock will see (chunk sizes,
        # split or not, one-token stores) is JIT-compiled before it starts.
        g = torch.Generator().manual_seed(cfg.seed + 1)
        warm = [torch.randint(0, cfg.model_config.vocab_size, (len(p),), generator=g).tolist()
                for p in prompts]
        llm.generate(warm, [SamplingParams(max_tokens=1 + k % 8) for k in range(len(warm))])
        before = llm.stats
        params = [SamplingParams(max_tokens=n) for n in olens]  # greedy, no stop tokens
        first = len(llm.step_history)
        with TritonCompiles() as compiles:  # should stay 0: the warm-up compiled them
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            synchronize(llm.device)
            seconds = time.perf_counter() - t0
        errors = [f"request {o.index}: {o.error}" for o in outs if o.error]
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
        after = llm.stats
        hits = after.prefix_hit_tokens - before.prefix_hit_tokens
        admitted = hits + after.prefill_tokens - before.prefill_tokens
        return summary(
            sum(len(o.token_ids) for o in outs), seconds, [o.ttft_s for o in outs],
            [o.tpot_s for o in outs], backend=llm.backend,
            graph_steps=after.num_graph_steps - before.num_graph_steps,
            piecewise_steps=after.num_piecewise_steps - before.num_piecewise_steps,
            steps=after.num_steps - before.num_steps,
            preemptions=after.preemptions - before.preemptions,
            prefix_hit_rate=round(hits / admitted, 4) if admitted else 0.0,
            triton_compiles=compiles.count,
            step_kinds=step_kinds(llm.step_history[first:])), \
            [o.token_ids for o in outs]
    finally:
        del llm
        free_memory(model.embed_tokens.device)  # one section's cache must not crowd the next


def step_kinds(records) -> dict:
    """Steps, tokens and wall seconds per way a step ran (``StepRecord.graph``: "full",
    "piecewise", "eager"...). Each step is charged the time from the previous step's end (the
    first, from its own start) to its own end: the charges partition the run even where async
    scheduling overlaps one step's launch with the last one's compute."""
    kinds: dict[str, dict] = {}
    prev = records[0].start_s if records else 0.0
    for r in records:
        k = kinds.setdefault(r.graph, {"steps": 0, "seconds": 0.0, "tokens": 0})
        k["steps"] += 1
        k["seconds"] += max(r.end_s - prev, 0.0)
        k["tokens"] += r.stats.num_tokens
        prev = max(prev, r.end_s)
    return kinds


def mode_gain_ceiling(section: dict | None) -> dict | None:
    """From a ``full_decode_only`` pass: the share of its wall time spent in steps no full
    decode graph replays (prefills, mixed steps), and the most any cudagraph_mode that replays
    them could gain on this workload: the whole run over the rest, were those steps free."""
    kinds = (section or {}).get("step_kinds")
    if not kinds:
        return None
    total = sum(k["seconds"] for k in kinds.values())
    other = sum(k["seconds"] for name, k in kinds.items() if name != "full")
    if total <= other:  # no decode graph replayed (a CPU's run): no ceiling to give
        return None
    return {"steps": sum(k["steps"] for name, k in kinds.items() if name != "full"),
            "of_steps": sum(k["steps"] for k in kinds.values()), "share": other / total,
            "ceiling": total / (total - other)}


# --- the run ---------------------------------------------------------------------------------

def _attempt(name, fn, errors, label: str | None = None):
    """One section's pass (or set-up), printed with its seconds as it ends (``label``, default
    ``name``), so a run cut short still shows where its time went; a failure is kept (the first
    one per section) and the rest go on."""
    began = time.perf_counter()
    try:
        out = fn()
    except Exception as exc:  # noqa: BLE001  (a failed section is reported; the rest go on)
        print(f"  {label or name}: FAILED after {time.perf_counter() - began:.1f} s "
              f"({type(exc).__name__}: {str(exc)[:300]})", flush=True)
        errors.setdefault(name, f"{type(exc).__name__}: {exc}")
        return None
    print(f"  {label or name}: {time.perf_counter() - began:.1f} s", flush=True)
    return out


def _ratio(passes, a, b) -> Spread | None:
    """Throughput of ``a`` over ``b``, taken within each round (both ran in it): its median
    and range over the rounds."""
    if a not in passes or b not in passes:
        return None
    per = [ra["tokens_per_s"] / rb["tokens_per_s"] for ra, rb in zip(passes[a], passes[b])
           if ra and rb and ra.get("tokens_per_s") and rb.get("tokens_per_s")]
    return Spread.of(per) if per else None


def _median_pass(runs: list[dict]) -> dict:
    """The pass with the median throughput, and the throughput of every pass beside it."""
    tps = [r["tokens_per_s"] for r in runs]
    mid = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    return mid | {"rounds_tokens_per_s": tps, "tokens_per_s_low": min(tps),
                  "tokens_per_s_high": max(tps)}


RATIOS = {"ratio_vs_transformers": ("labkit", "transformers"),
          "graphs_gain": ("labkit_unfused", "labkit_eager"),
          "fused_gain": ("labkit", "labkit_unfused"),
          "mode_gain": ("labkit", "labkit_full_decode_only"),
          "compile_gain": ("labkit_compiled", "labkit"),
          "prefix_gain": ("prefix_cached", "prefix_uncached")}


def run(out_dir: Path | None = None, quick: bool = False, config: BenchmarkConfig | None = None,
        sections: Sequence[str] | None = None) -> dict:
    """Every section once per round, ``cfg.rounds`` rounds, each in a fresh shuffled order
    (drawn from the seed): a section's figures are its median pass, every ratio the median of
    the per-round ratios with their range. ``sections``: only these (default all); a ratio
    whose sections did not both run is None."""
    chosen = tuple(SECTIONS if sections is None else sections)
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown or not chosen:
        raise ValueError(f"sections must be names of {list(SECTIONS)}, got {list(chosen)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = config
    if cfg is None:
        cfg = BenchmarkConfig.small() if quick or device.type != "cuda" else BenchmarkConfig()
    print(describe())
    if device.type != "cuda" and not quick:
        print("no CUDA device: running the quick workload (tiny model, float32)")
    if cfg.quick:
        print("quick mode: tiny model, float32, transformers without torch.compile")
    prompts, olens, system = cfg.requests()
    requested = sum(olens)
    results = {"workload": {**asdict(cfg), "config": cfg.model_config.to_dict(),
                            "requested_output_tokens": requested,
                            "prompt_tokens": sum(map(len, prompts))},
               "device": device.type, "fingerprint": fingerprint(), "sections": {},
               "cudagraph_mode": resolve_cudagraph_mode(None, False, device), "l2": ENGINE_STEPS_L2}
    print(f"{cfg.num_requests} requests, {sum(map(len, prompts)):,} prompt tokens, "
          f"{requested:,} output tokens, "
          f"{cfg.model_config.num_parameters() / 1e9:.2f}B parameters, {cfg.dtype}; "
          f"{cfg.rounds} rounds; L2: {ENGINE_STEPS_L2}")
    model = random_model(cfg.model_config, seed=cfg.seed, device=device, dtype=cfg.torch_dtype,
                         std=cfg.init_std)
    shared = [system + p for p in prompts]
    labkit_runs = {
        "labkit": lambda: run_labkit(model, prompts, olens, cfg),
        # Inductor's fusion of the plain ops in place of the hand-fused kernels, same graphs
        "labkit_compiled": lambda: run_labkit(model, prompts, olens, cfg, compile=True),
        # Full graphs for uniform decode only, every other step eager; on CPU, where there are
        # no full graphs, every step eager.
        "labkit_full_decode_only": lambda: run_labkit(
            model, prompts, olens, cfg,
            cudagraph_mode="full_decode_only" if device.type == "cuda" else "none"),
        "labkit_unfused": lambda: run_labkit(model, prompts, olens, cfg, fused_ops=False),
        "labkit_eager": lambda: run_labkit(model, prompts, olens, cfg, enforce_eager=True,
                                           fused_ops=False),
        "prefix_cached": lambda: run_labkit(model, shared, olens, cfg),
        "prefix_uncached": lambda: run_labkit(model, shared, olens, cfg,
                                              enable_prefix_caching=False),
    }
    errors: dict[str, str] = {}
    passes: dict[str, list] = {name: [] for name in chosen}
    tokens: dict[str, list] = {}
    rng = random.Random(cfg.seed)
    with tempfile.TemporaryDirectory(prefix="labkit_bench_") as tmp:
        peer = None if "transformers" not in chosen else _attempt(
            "transformers", lambda: (save_weights(model, tmp), TransformersPeer(
                tmp, prompts, olens, device=device, dtype=cfg.torch_dtype,
                batch_size=cfg.hf_batch_size,
                compile_forward=device.type == "cuda" and not cfg.quick))[1], errors,
            "transformers set-up")
        runs = dict(labkit_runs, transformers=peer.run if peer is not None else None)
        try:
            for r in range(cfg.rounds):
                for name in rng.sample(chosen, len(chosen)):
                    if runs[name] is None or name in errors:
                        passes[name].append(None)
                        continue
                    out = _attempt(name, runs[name], errors, f"round {r + 1}/{cfg.rounds}: {name}")
                    passes[name].append(out[0] if out else None)
                    if out and r == 0:
                        tokens[name] = out[1]
        finally:
            if peer is not None:
                peer.close()
    for name in chosen:
        done = [p for p in passes[name] if p]
        results["sections"][name] = ({"error": errors[name]} if name in errors or not done
                                     else _median_pass(done))
    spreads = {key: _ratio(passes, *pair) for key, pair in RATIOS.items()}
    for key, spread in spreads.items():
        results[key] = spread.median if spread is not None else None
    results["ratios"] = {key: None if s is None else s.as_dict() for key, s in spreads.items()}
    results["mode_gain_ceiling"] = mode_gain_ceiling(results["sections"].get(
        "labkit_full_decode_only"))
    target = spreads["ratio_vs_transformers"]
    results["target"] = {"ratio_vs_transformers": TARGET_VS_TRANSFORMERS,
                         "met": bool(target is not None and target.above(TARGET_VS_TRANSFORMERS))}
    ours, theirs = tokens.get("labkit"), tokens.get("transformers")
    if ours is not None and theirs is not None:
        same = sum(a == b for a, b in zip(ours, theirs))
        first = sum(a[:1] == b[:1] for a, b in zip(ours, theirs))
        common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b in zip(ours, theirs)]
        results["greedy_agreement"] = {"requests": len(ours), "identical": same,
                                       "first_token_identical": first,
                                       "median_common_prefix": statistics.median(common)}
    if cfg.compile_start and "labkit_compiled" in chosen:
        # Inductor's on-disk cache: empty, then as the first run left it
        results["compile_start"] = _attempt("compile_start", lambda: compile_start(
            cfg.model_config, device=device.type, dtype=cfg.dtype, cudagraph_mode=None),
            errors)
    report(results, spreads, quick=cfg.quick, system_prompt_len=cfg.system_prompt_len,
           target=TARGET_VS_TRANSFORMERS)
    if out_dir is not None:
        write(results, Path(out_dir))
    return results


def record() -> dict:
    """For ``make record``: the full workload on this GPU, as plain data."""
    return run(None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for the CSV and JSON")
    parser.add_argument("--quick", action="store_true",
                        help="tiny model, 8 short requests, float32 (automatic without CUDA)")
    parser.add_argument("--hf-batch-size", type=int, default=None,
                        help="requests per transformers generate() call (default 64)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="passes over every section, shuffled each time (default 3)")
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=None,
                        help="run only these sections (default all), e.g. labkit "
                             "labkit_compiled")
    args = parser.parse_args()
    cfg = None
    changes = {k: v for k, v in (("hf_batch_size", args.hf_batch_size),
                                 ("rounds", args.rounds)) if v is not None}
    if changes:
        quick = args.quick or not torch.cuda.is_available()
        base = BenchmarkConfig.small() if quick else BenchmarkConfig()
        cfg = BenchmarkConfig(**{**asdict(base), **changes})
    run(args.out, quick=args.quick, config=cfg, sections=args.sections)
