"""labkit's engine against Hugging Face transformers on the same weights, in the same run.

    python benchmarks/engine.py --out results/            # the full benchmark on a GPU
    python benchmarks/engine.py --out /tmp/q --quick      # tiny model, seconds on a CPU

``BenchmarkConfig`` (fixed seed): a random-weight Llama (``ModelConfig.bench_1b``, bf16), 256
requests, prompts of 64..2048 random token ids, 32..512 output tokens each; stop tokens are
ignored, so every request produces exactly its output length. Sections, each run even if
another failed:

1. ``labkit``: ``LLM.generate`` over all requests at once, the engine's defaults (CUDA Graphs
   on, each layer's small ops as three fused kernels)
2. ``labkit_unfused``: the same with ``fused_ops=False`` (fused_gain = labkit / this);
   ``labkit_eager``: ``enforce_eager=True``, unfused (graphs_gain = labkit_unfused / this)
3. ``prefix_cached`` / ``prefix_uncached``: every prompt behind one shared 1,024-token system
   prompt, prefix caching on and off (hit rate and throughput gain)
4. ``transformers``: ``LlamaForCausalLM.generate`` loaded from the same safetensors, static
   cache, decode forward under ``torch.compile``, batches of requests with similar prompt
   lengths, left padding, greedy, ``max_new_tokens`` = the batch's longest output. Only each
   request's own output tokens count as useful.

Throughput is output tokens / wall time; warm-up (kernel JIT, graph capture, compilation) runs
before the clock starts, for both. TTFT is from the moment all requests are handed over.
``--quick`` (and any run without CUDA): ``ModelConfig.tiny()``, 8 short requests, float32.
``record()`` returns the results dict for ``make record``.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import labkit  # noqa: F401  (device set-up before anything imports triton)
from labkit import check_positive_int
from labkit.measure.bench import TritonCompiles
from labkit.device import describe, fingerprint, free_memory, synchronize
from labkit.engine import LLM, ModelConfig, SamplingParams, random_model, save_weights
from labkit.lessons.putting_it_together.transformers_peer import run_transformers, summary

SECTIONS = ("labkit", "labkit_unfused", "labkit_eager", "prefix_cached", "prefix_uncached",
            "transformers")


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

    def __post_init__(self):
        for name in ("prompt_lens", "output_lens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)}")
        check_positive_int("num_requests", self.num_requests)
        check_positive_int("hf_batch_size", self.hf_batch_size,
                           hint="requests per transformers generate() call")

    @classmethod
    def small(cls) -> "BenchmarkConfig":
        # A wide init keeps greedy argmaxes far from ties, so labkit and transformers must agree
        # token for token (the benchmark's own correctness guard).
        return cls(num_requests=8, prompt_lens=(4, 24), output_lens=(2, 8), system_prompt_len=32,
                   dtype="float32", quick=True, init_std=0.2, hf_batch_size=4,
                   max_num_seqs=8, max_num_batched_tokens=256)

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
               enable_prefix_caching=True, fused_ops=None) -> tuple[dict, list[list[int]]]:
    llm = LLM(model, enforce_eager=enforce_eager, enable_prefix_caching=enable_prefix_caching,
              fused_ops=fused_ops,
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
            steps=after.num_steps - before.num_steps,
            preemptions=after.preemptions - before.preemptions,
            prefix_hit_rate=round(hits / admitted, 4) if admitted else 0.0,
            triton_compiles=compiles.count), \
            [o.token_ids for o in outs]
    finally:
        del llm
        free_memory(model.embed_tokens.device)  # one section's cache must not crowd the next


# --- the run ----------------------------------------------------------------------------------

def _section(results, name, fn, device):
    try:
        summary, tokens = fn()
        results["sections"][name] = summary
        return tokens
    except Exception as exc:  # noqa: BLE001  (a failed section is reported; the rest go on)
        print(f"  {name}: FAILED ({type(exc).__name__}: {str(exc)[:300]})")
        results["sections"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        free_memory(device)
        return None


def _ratio(results, a, b) -> float | None:
    sa, sb = results["sections"].get(a, {}), results["sections"].get(b, {})
    if sa.get("tokens_per_s") and sb.get("tokens_per_s"):
        return sa["tokens_per_s"] / sb["tokens_per_s"]
    return None


def run(out_dir: Path | None = None, quick: bool = False, config: BenchmarkConfig | None = None
        ) -> dict:
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
               "device": device.type, "fingerprint": fingerprint(), "sections": {}}
    print(f"{cfg.num_requests} requests, {sum(map(len, prompts)):,} prompt tokens, "
          f"{requested:,} output tokens, "
          f"{cfg.model_config.num_parameters() / 1e9:.2f}B parameters, {cfg.dtype}")
    model = random_model(cfg.model_config, seed=cfg.seed, device=device, dtype=cfg.torch_dtype,
                         std=cfg.init_std)
    ours = _section(results, "labkit", lambda: run_labkit(model, prompts, olens, cfg), device)
    _section(results, "labkit_unfused",
             lambda: run_labkit(model, prompts, olens, cfg, fused_ops=False), device)
    _section(results, "labkit_eager",
             lambda: run_labkit(model, prompts, olens, cfg, enforce_eager=True, fused_ops=False),
             device)
    shared = [system + p for p in prompts]
    _section(results, "prefix_cached", lambda: run_labkit(model, shared, olens, cfg), device)
    _section(results, "prefix_uncached",
             lambda: run_labkit(model, shared, olens, cfg, enable_prefix_caching=False),
             device)
    with tempfile.TemporaryDirectory(prefix="labkit_bench_") as tmp:
        theirs = None
        try:
            save_weights(model, tmp)
            del model
            free_memory(device)
            theirs = _section(results, "transformers",
                              lambda: run_transformers(
                                  tmp, prompts, olens, device=device, dtype=cfg.torch_dtype,
                                  batch_size=cfg.hf_batch_size,
                                  compile_forward=device.type == "cuda" and not cfg.quick),
                              device)
        except Exception as exc:  # noqa: BLE001
            results["sections"]["transformers"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  transformers: FAILED ({type(exc).__name__}: {exc})")
    results["ratio_vs_transformers"] = _ratio(results, "labkit", "transformers")
    results["graphs_gain"] = _ratio(results, "labkit_unfused", "labkit_eager")
    results["fused_gain"] = _ratio(results, "labkit", "labkit_unfused")
    results["prefix_gain"] = _ratio(results, "prefix_cached", "prefix_uncached")
    if ours is not None and theirs is not None:
        same = sum(a == b for a, b in zip(ours, theirs))
        first = sum(a[:1] == b[:1] for a, b in zip(ours, theirs))
        common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                  for a, b in zip(ours, theirs)]
        results["greedy_agreement"] = {"requests": len(ours), "identical": same,
                                       "first_token_identical": first,
                                       "median_common_prefix": statistics.median(common)}
    _report(results, cfg)
    if out_dir is not None:
        _write(results, Path(out_dir))
    return results


def _report(results, cfg: BenchmarkConfig) -> None:
    print(f"{'section':<17}{'tokens':>9}{'seconds':>10}{'tok/s':>11}{'TTFT ms':>10}"
          f"{'TPOT ms':>10}")
    for name in SECTIONS:
        s = results["sections"][name]
        if "error" in s:
            print(f"{name:<17} FAILED: {s['error'][:200]}")
            continue
        print(f"{name:<17}{s['output_tokens']:>9,}{s['seconds']:>10.2f}{s['tokens_per_s']:>11,.0f}"
              f"{s['ttft_median_ms'] or float('nan'):>10.1f}"
              f"{s['tpot_median_ms'] or float('nan'):>10.2f}"
              + (f"  ({s['triton_compiles']} Triton compiles inside the clock)"
                 if s.get("triton_compiles") else ""))
    ratio = results["ratio_vs_transformers"]
    if ratio is not None:
        verdict = "meets" if ratio >= 2 else "misses"
        print(f"labkit / transformers: {ratio:.2f}x ({verdict} the 2x target"
              f"{'; quick mode: not the target workload' if cfg.quick else ''})")
    if results["graphs_gain"] is not None:
        print(f"CUDA Graphs on / off (both unfused): {results['graphs_gain']:.2f}x")
    if results["fused_gain"] is not None:
        print(f"fused layer ops on / off: {results['fused_gain']:.2f}x")
    if results["prefix_gain"] is not None:
        hit = results["sections"]["prefix_cached"]["prefix_hit_rate"]
        print(f"shared {cfg.system_prompt_len}-token system prompt: prefix hit rate {hit:.1%}, "
              f"caching on / off {results['prefix_gain']:.2f}x")
    if "greedy_agreement" in results:
        g = results["greedy_agreement"]
        print(f"greedy outputs identical to transformers: {g['identical']}/{g['requests']}; "
              f"first token identical {g['first_token_identical']}/{g['requests']}; median "
              f"common prefix {g['median_common_prefix']} tokens"
              f"{'' if cfg.quick else ' (bf16 rounding may flip near-ties on random weights)'}")


def _write(results, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    cols = ["section", "output_tokens", "seconds", "tokens_per_s", "ttft_median_ms",
            "tpot_median_ms", "prefix_hit_rate", "error"]
    with open(out_dir / "engine.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        for name in SECTIONS:
            writer.writerow({"section": name, **results["sections"][name]})
    (out_dir / "engine.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out_dir / 'engine.csv'} and {out_dir / 'engine.json'}")


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
    args = parser.parse_args()
    cfg = None
    if args.hf_batch_size is not None:
        quick = args.quick or not torch.cuda.is_available()
        base = BenchmarkConfig.small() if quick else BenchmarkConfig()
        cfg = BenchmarkConfig(**{**asdict(base), "hf_batch_size": args.hf_batch_size})
    run(args.out, quick=args.quick, config=cfg)
