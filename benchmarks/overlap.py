"""Overlap utilities on this GPU, against what the hardware does without them.

    python benchmarks/overlap.py --out results/ [--strict]

1. Host-to-device bandwidth, measured in one run: copies through ``PinnedStagingPool`` (the
   producer writes its batch straight into the staged pinned buffer) against raw copies from
   one pinned tensor, with pageable copies and the pool fed from pageable memory (one extra
   CPU memcpy per copy) beside them. Target: the pool reaches >= 90% of pinned bandwidth for
   copies of 16 MB and more.
2. ``Prefetcher`` wall time, with compute per batch a bit longer than its copy: against
   max(copy, compute) (target: within 10%) and against copy + compute (what no overlap gives).

Prints both tables with their ratios and writes overlap_bandwidth.csv, overlap_prefetch.csv.
``--strict`` exits 1 when a target is missed.
"""
import argparse
import math
import sys
from pathlib import Path

import pandas as pd
import torch

import labkit
from labkit.measure import bench
from labkit.lessons import pinned_memory_streams as transfer
from labkit.overlap import PinnedStagingPool, Prefetcher

BANDWIDTH_TARGET, PREFETCH_TARGET, TARGET_FROM_BYTES = 0.90, 1.10, 16 << 20


def per_call_us(fn, dev, calls: int, repeats: int) -> float:
    """Host clock around ``calls`` calls and a synchronize: whichever stream a copy ran on, it
    is inside the interval (events recorded on a consumer stream that only waits for the copy
    stream can time none of the copies)."""
    def sample():
        for _ in range(calls):
            fn()
        torch.cuda.synchronize(dev)

    return bench.measure(sample, device="cpu", warmup=1, repeats=repeats).median_us / calls


def bandwidth(sizes, dev, repeats=8, calls=16) -> pd.DataFrame:
    rows = []
    for nbytes in sizes:
        pageable = torch.ones(nbytes, dtype=torch.uint8)
        pinned = pageable.pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        pool = PinnedStagingPool(2, dev)
        pool.reserve(nbytes)

        def through_pool():
            pool.stage((nbytes,), torch.uint8)   # the producer fills this in place
            pool.submit().wait()

        runs = {"pageable": lambda: dst.copy_(pageable, non_blocking=True),
                "pinned": lambda: dst.copy_(pinned, non_blocking=True),
                "pool": through_pool,
                "pool_from_pageable": lambda: pool.to_device(pageable)}
        row = {"bytes": nbytes}
        for name, fn in runs.items():
            row[f"{name}_gbps"] = nbytes / per_call_us(fn, dev, calls, repeats) / 1e3
        row["pool_vs_pinned"] = row["pool_gbps"] / row["pinned_gbps"]
        row["pool_waits"] = pool.stats.waits
        rows.append(row)
    return pd.DataFrame(rows)


def prefetch(dev, n_batches=24, rows=2048, cols=4096, runs=3) -> pd.DataFrame:
    batches = transfer.host_batches(n_batches, rows, cols, pinned=True)
    w = transfer.weight(cols, dev)
    x = batches[0].to(dev)
    copy_ms = bench.measure(lambda: x.copy_(batches[0], non_blocking=True), device=dev,
                            warmup=2, repeats=10).median_us / 1e3
    one_ms = bench.measure(lambda: transfer.compute(x, w, 1), device=dev, warmup=2,
                           repeats=10).median_us / 1e3
    matmuls = max(1, math.ceil(1.2 * copy_ms / one_ms))   # compute a bit longer than the copy
    compute_ms = bench.measure(lambda: transfer.compute(x, w, matmuls), device=dev, warmup=1,
                               repeats=10).median_us / 1e3
    out = []
    for overlap in (False, True):
        walls = []
        for _ in range(runs + 1):   # the first run warms up the allocator and the streams
            pf = Prefetcher(batches, dev, overlap=overlap)
            for b in pf:
                transfer.compute(b, w, matmuls)
            walls.append(pf.stats.wall_ms)
        wall = sorted(walls[1:])[len(walls[1:]) // 2]
        total_copy, total_compute = n_batches * copy_ms, n_batches * compute_ms
        out.append({"overlap": overlap, "batches": n_batches, "batch_bytes": rows * cols * 4,
                    "matmuls": matmuls, "copy_ms": total_copy, "compute_ms": total_compute,
                    "max_ms": max(total_copy, total_compute),
                    "sum_ms": total_copy + total_compute, "wall_ms": wall,
                    "wall_vs_max": wall / max(total_copy, total_compute),
                    "wall_vs_sum": wall / (total_copy + total_compute)})
    return pd.DataFrame(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args()
    dev = labkit.select_device("auto")
    print(labkit.device.describe())
    if dev.type != "cuda":
        print("overlap: pinned memory, copy streams and DMA need a CUDA device; nothing to "
              "measure here (notebook 04 shows the recorded H200 figures)")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    bw = bandwidth([1 << 20, 16 << 20, 64 << 20, 256 << 20], dev)
    pf = prefetch(dev)
    bw.to_csv(args.out / "overlap_bandwidth.csv", index=False)
    pf.to_csv(args.out / "overlap_prefetch.csv", index=False)
    fmt = lambda v: f"{v:.3f}"   # noqa: E731
    print("\nhost-to-device GB/s, one run:")
    print(bw.to_string(index=False, float_format=fmt))
    print("\nprefetcher, ms for all batches:")
    print(pf.to_string(index=False, float_format=fmt))
    worst_bw = bw[bw.bytes >= TARGET_FROM_BYTES].pool_vs_pinned.min()
    wall_vs_max = float(pf[pf.overlap].wall_vs_max.iloc[0])
    checks = [(f"pool >= {BANDWIDTH_TARGET:.0%} of pinned from {TARGET_FROM_BYTES >> 20} MB",
               worst_bw >= BANDWIDTH_TARGET, f"worst {worst_bw:.1%}"),
              (f"prefetcher wall <= {PREFETCH_TARGET:.2f} x max(copy, compute)",
               wall_vs_max <= PREFETCH_TARGET, f"{wall_vs_max:.3f} x")]
    for what, ok, got in checks:
        print(f"target {'met' if ok else 'MISSED'}: {what} ({got})")
    return 1 if args.strict and not all(ok for _, ok, _ in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
