"""CUDA Graph pool on this GPU: an 8-layer, width-2048 decode stack, eager against replay.

    python benchmarks/graphs.py --out results/

Prints, from one run: eager vs replayed step time per batch (target at batch 8: >= 4x), the
pool's overhead over a bare torch.cuda.CUDAGraph replay of the same bucket (target <= 5%),
the time to capture 10 buckets (target < 2 s) and predicted vs captured graph memory.
"""
import argparse
import json
from pathlib import Path

import pandas as pd

import labkit
from labkit.lessons.cuda_graphs import measurements as gx
from labkit.graphs import GraphPool


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    dev = labkit.select_device("auto")
    print(labkit.device.describe())
    if dev.type != "cuda":
        print("no GPU: CUDA Graphs need one; nothing to measure here")
        return
    stack = gx.make_stack(dev)
    pool = GraphPool(stack, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
    times = gx.step_times(stack, [1, 4, 8, 16, 64, 256], pool)
    overhead = gx.pool_overhead(stack, batch=8)
    capture = gx.capture_costs(stack)
    args.out.mkdir(parents=True, exist_ok=True)
    times.to_csv(args.out / "graphs_step_times.csv", index=False)
    (args.out / "graphs.json").write_text(json.dumps(
        {"overhead": overhead, "capture": capture}, indent=1, default=str))
    print(times.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    at8 = times[times.batch == 8].iloc[0]
    print(f"\nbatch 8: eager {at8.eager_us:.1f} us, replay {at8.graph_us:.1f} us -> "
          f"{at8.speedup:.2f}x (target >= 4x: {'met' if at8.speedup >= 4 else 'NOT met'})")
    print(pd.Series(overhead).to_string(float_format=lambda v: f"{v:.4f}"))
    ov = overhead["overhead_vs_bare"]
    print(f"pool overhead over a bare replay: {ov:+.1%} (target <= 5%: {'met' if ov <= 0.05 else 'NOT met'})")
    print(f"capture {capture['keys']} buckets: {capture['capture_s']:.2f} s "
          f"(target < 2 s: {'met' if capture['capture_s'] < 2 else 'NOT met'}); memory predicted "
          f"{capture['predicted_MiB']:.0f} MiB, captured {capture['captured_MiB']:.0f} MiB")


if __name__ == "__main__":
    main()
