"""CUDA Graph pool on this GPU: an 8-layer, width-2048 decode stack, eager against replay.

    python benchmarks/graphs.py --out results/

Every comparison runs in interleaved rounds and prints its median with the range over rounds;
a target is met only when the whole range clears it. Prints: eager vs replayed step time per
batch with the GPU's busy time beside each (target at batch 8: >= 4x), the pool's overhead over
a bare torch.cuda.CUDAGraph replay of the same bucket (target <= 5%), the time to capture every
bucket of a fresh pool (target < 2 s) and predicted vs captured graph memory. Every timed step
reads the stack's weights (766 MiB in bf16), far over twice the L2: no flush, and ``l2`` says so.
"""
import argparse
import json
from pathlib import Path

import labkit
from labkit.graphs import GraphPool
from labkit.lessons.cuda_graphs import measurements as gx
from labkit.measure.bench import l2_statement

SPEEDUP_AT_8 = 4.0
POOL_OVERHEAD = 0.05
CAPTURE_S = 2.0


class Verdict:
    """A spread against a target: met only when every round clears it."""

    def __init__(self, spread, target: float, above: bool):
        self.spread, self.target, self.above = spread, target, above
        self.met = spread.above(target) if above else spread.below(target)
        self.median_clears = spread.median > target if above else spread.median < target

    def __str__(self) -> str:
        sign = ">=" if self.above else "<="
        if self.met:
            return f"target {sign} {self.target:g}: met in every round"
        if self.median_clears:
            return (f"target {sign} {self.target:g}: NOT met (the median clears it, the range "
                    "straddles it: noise, not a result)")
        return f"target {sign} {self.target:g}: NOT met"


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--rounds", type=int, default=gx.ROUNDS)
    args = parser.parse_args()
    dev = labkit.select_device("auto")
    print(labkit.device.describe())
    if dev.type != "cuda":
        print("no GPU: CUDA Graphs need one; nothing to measure here")
        return
    stack = gx.make_stack(dev, max_batch=max(gx.BUCKETS))
    pool = GraphPool(stack, buckets=gx.BUCKETS)
    pool.capture(gx.hidden(stack, 1))
    l2 = l2_statement(sum(p.numel() * p.element_size() for p in stack.parameters()), dev)
    print(f"L2 (steps and pool overhead): {l2}")
    steps = gx.step_rounds(stack, [1, 4, 8, 16, 64, 256], pool, rounds=args.rounds, profile=True)
    overhead = gx.pool_overhead(stack, batch=8, rounds=args.rounds)
    capture = gx.capture_rounds(stack, gx.hidden(stack, 1), gx.BUCKETS, rounds=args.rounds)
    table = gx.step_table(steps)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "graphs_step_times.csv", index=False)
    (args.out / "graphs.json").write_text(json.dumps(
        {"steps": steps, "overhead": overhead, "capture": capture, "l2": l2}, indent=1,
        default=str))
    print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))

    i = steps["batch"].index(8)
    gain = gx.ratio(steps["eager_us"][i], steps["graph_us"][i])
    print(f"\nbatch 8 ({args.rounds} interleaved rounds): eager {gx.spread(steps['eager_us'][i]):.1f} us "
          f"(GPU busy {steps['eager_gpu_us'][i]:.1f} us: the eager side is host time), replay "
          f"{gx.spread(steps['graph_us'][i]):.1f} us -> {gain:.2fx}; "
          f"{Verdict(gain, SPEEDUP_AT_8, above=True)}")
    ov = gx.overhead_vs_bare(overhead)
    for case, per_round in overhead["rounds"].items():
        print(f"  {case:>22}: {gx.spread(per_round):.2f} us")
    print(f"pool overhead over a bare replay: {ov:+.2%}; {Verdict(ov, POOL_OVERHEAD, above=False)}")
    seconds = gx.spread(capture["capture_s"])
    print(f"capture {capture['keys']} buckets: {seconds:.3f} s; "
          f"{Verdict(seconds, CAPTURE_S, above=False)}; memory predicted "
          f"{capture['predicted_MiB']:.0f} MiB, captured {max(capture['captured_MiB']):.0f} MiB")


if __name__ == "__main__":
    main()
