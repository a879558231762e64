"""benchmarks/engine.py's output: the printed report, the verdict on a target, and the files.

``verdict`` says whether a ratio's whole range clears a target; ``report`` prints the sections'
throughput table and every ratio with its range; ``write`` saves engine.csv and engine.json.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

from labkit.measure.rounds import Spread


def verdict(spread: Spread | None, target: float) -> str:
    """A target is met only when every round clears it; a range that straddles it is noise."""
    if spread is None:
        return "not measured"
    if spread.above(target):
        return f"meets the {target:g}x target in every round"
    if spread.median > target:
        return f"the range straddles the {target:g}x target: not met"
    return f"misses the {target:g}x target"


def report(results: dict, spreads: dict, *, quick: bool, system_prompt_len: int,
           target: float) -> None:
    """The sections' table, then each ratio with its range (and the target's verdict)."""
    print(f"{'section':<24}{'tokens':>9}{'seconds':>10}{'tok/s':>11}{'range':>19}{'TTFT ms':>10}"
          f"{'TPOT ms':>10}")
    for name, s in results["sections"].items():
        if "error" in s:
            print(f"{name:<24} FAILED: {s['error'][:200]}")
            continue
        span = f"{s['tokens_per_s_low']:,.0f}-{s['tokens_per_s_high']:,.0f}"
        print(f"{name:<24}{s['output_tokens']:>9,}{s['seconds']:>10.2f}{s['tokens_per_s']:>11,.0f}"
              f"{span:>19}{s['ttft_median_ms'] or float('nan'):>10.1f}"
              f"{s['tpot_median_ms'] or float('nan'):>10.2f}"
              + (f"  ({s['triton_compiles']} Triton compiles inside the clock)"
                 if s.get("triton_compiles") else ""))
    ratio = spreads["ratio_vs_transformers"]
    if ratio is not None:
        print(f"labkit / transformers: {ratio:.2fx} ({verdict(ratio, target)}"
              f"{'; quick mode: not the target workload' if quick else ''})")
    if spreads["mode_gain"] is not None:
        mode = results.get("cudagraph_mode", "the default")
        print(f"cudagraph_mode {mode} / full_decode_only: {spreads['mode_gain']:.2fx}")
        if results.get("mode_gain_ceiling"):
            c = results["mode_gain_ceiling"]
            print(f"  full_decode_only ran {c['steps']} of {c['of_steps']} steps outside its "
                  f"decode graphs, {c['share']:.1%} of its time: were they free, no mode could "
                  f"gain more than {c['ceiling']:.2f}x on this workload")
    if spreads["graphs_gain"] is not None:
        print(f"CUDA Graphs on / off (both unfused): {spreads['graphs_gain']:.2fx}")
    if spreads["compile_gain"] is not None:
        print(f"compile=True (Inductor-fused plain ops) / hand-fused Triton ops, same graphs: "
              f"{spreads['compile_gain']:.2fx}")
    if spreads["fused_gain"] is not None:
        print(f"fused layer ops on / off: {spreads['fused_gain']:.2fx}")
    if spreads["prefix_gain"] is not None:
        hit = results["sections"]["prefix_cached"]["prefix_hit_rate"]
        print(f"shared {system_prompt_len}-token system prompt: prefix hit rate {hit:.1%}, "
              f"caching on / off {spreads['prefix_gain']:.2fx}")
    if results.get("compile_start"):
        c = results["compile_start"]
        cold, warm = c["cold"], c["warm"]
        print(f"compile=True ({cold.get('cudagraph_mode')}), first generate in a fresh "
              f"process: cold {cold['first_generate_s']:.1f} s (compile "
              f"{cold['compile_s']:.1f}, capture {cold.get('capture_ms', 0) / 1e3:.1f}), warm "
              f"{warm['first_generate_s']:.1f} s (compile {warm['compile_s']:.1f}, capture "
              f"{warm.get('capture_ms', 0) / 1e3:.1f})")
    if "greedy_agreement" in results:
        g = results["greedy_agreement"]
        print(f"greedy outputs identical to transformers: {g['identical']}/{g['requests']}; "
              f"first token identical {g['first_token_identical']}/{g['requests']}; median "
              f"common prefix {g['median_common_prefix']} tokens"
              f"{'' if quick else ' (bf16 rounding may flip near-ties on random weights)'}")


def write(results: dict, out_dir: Path) -> None:
    """engine.csv (a row per section) and engine.json (everything) in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cols = ["section", "output_tokens", "seconds", "tokens_per_s", "ttft_median_ms",
            "tpot_median_ms", "prefix_hit_rate", "error"]
    with open(out_dir / "engine.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        writer.writeheader()
        for name, section in results["sections"].items():
            writer.writerow({"section": name, **section})
    (out_dir / "engine.json").write_text(json.dumps(results, indent=1, default=str))
    print(f"wrote {out_dir / 'engine.csv'} and {out_dir / 'engine.json'}")
