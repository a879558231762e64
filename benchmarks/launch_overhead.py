"""Launch overhead on this GPU: time per tiny kernel, eager against CUDA Graph replay.

    python benchmarks/launch_overhead.py --out results/

Prints per-kernel times and the replay speed-up for each kernel size, measured in one run, and
writes them as CSV. On a CPU it compares eager with torch.compile instead.
"""
import argparse
from pathlib import Path

import labkit
from labkit.lessons import launch_overhead as lo


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--n-kernels", type=int, default=100)
    args = parser.parse_args()
    dev = labkit.select_device("auto")
    sizes = [2**k for k in range(8, 27, 2)] if dev.type == "cuda" else [2**k for k in range(4, 21, 4)]
    df = lo.sweep(sizes, n_kernels=args.n_kernels, device=dev, repeats=20)
    table = lo.speedup_table(df)
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "launch_overhead.csv", index=False)
    print(labkit.device.describe())
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"crossover (gain < 10%) at {lo.crossover(df)} elements per kernel")


if __name__ == "__main__":
    main()
