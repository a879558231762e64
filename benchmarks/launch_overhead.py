"""Launch overhead on this GPU: time per tiny kernel, eager against CUDA Graph replay.

    python benchmarks/launch_overhead.py --out results/

For each kernel size the two modes are timed in interleaved rounds (eager, graph, eager, ...),
so the replay speed-up is a median with its range over rounds, and writes them as CSV. On a
CPU it compares eager with torch.compile instead.
"""
import argparse
from pathlib import Path

import pandas as pd

import labkit
from labkit.lessons import launch_overhead as lo
from labkit.measure.rounds import interleaved

GAIN_AT_TINY = 2.0  # replay of the smallest kernels must be this much faster in every round
L2 = ("not flushed: this times host launch cost, each call a chain of kernels over one buffer "
      "(as a model's layers pass activations on); a flush before a sample would reach only the "
      "chain's first kernel, and would hide host time behind it")


def size_rounds(numel: int, n_kernels: int, dev, rounds: int) -> dict:
    eager_mode, fast_mode = lo.default_modes(dev)
    timed = interleaved({m: lo.chain_runner(m, numel, n_kernels, dev)
                         for m in (eager_mode, fast_mode)}, rounds=rounds, device=dev,
                        warmup=3, repeats=20)
    eager, fast = timed.us(eager_mode), timed.us(fast_mode)
    gain = timed.ratio(eager_mode, fast_mode)
    return {"numel": numel, "mode": fast_mode,
            "eager_us_per_kernel": eager.median / n_kernels,
            "fast_us_per_kernel": fast.median / n_kernels,
            "speedup": gain.median, "speedup_low": gain.low, "speedup_high": gain.high,
            "rounds": gain.rounds, "_gain": gain}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--n-kernels", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dev = labkit.select_device("auto")
    sizes = [2**k for k in range(8, 27, 2)] if dev.type == "cuda" else [2**k for k in range(4, 21, 4)]
    rows = [size_rounds(n, args.n_kernels, dev, args.rounds) for n in sizes]
    tiny_gain = rows[0].pop("_gain")
    for r in rows[1:]:
        r.pop("_gain")
    table = pd.DataFrame(rows).assign(l2=L2)
    args.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(args.out / "launch_overhead.csv", index=False)
    print(labkit.device.describe())
    print(table.drop(columns="l2").to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"L2: {L2}")
    small = table[table.speedup_high < 1.10]
    print("crossover (every round gains < 10%) at "
          f"{int(small.numel.iloc[0]) if len(small) else 'no measured size'} elements per kernel")
    met = tiny_gain.above(GAIN_AT_TINY)
    print(f"target: {table['mode'].iloc[0]} >= {GAIN_AT_TINY}x at {sizes[0]:,} elements: "
          f"{tiny_gain:.2fx} -> {'met' if met else 'NOT met (the range does not clear it)'}")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
