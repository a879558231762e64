"""`make record`: re-measure every recorded GPU figure on this CUDA host and write it as data.

Each entry names a function that takes no arguments, measures on the GPU and returns a
JSON-serialisable dict; :func:`labkit.recorded.save` adds the fingerprint, date and commit.
A notebook shows ``labkit.recorded.load(name)`` where no GPU is present.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

import labkit  # noqa: F401  (device set-up first)
from labkit import recorded
from labkit.lab import NOTEBOOK_DIR

ROOT = NOTEBOOK_DIR.parent

RECORDERS: dict[str, str] = {
    "device_peaks": "labkit.peaks:record",
    "launch_overhead": "labkit.launch_overhead:record",
    "graphs": "labkit.graph_experiments:record",
    "graph_pitfalls": "labkit.graph_pitfalls:record",
    "torch_compile": "labkit.recompiles:record",
    "overlap": "labkit.transfer:record",
    "attention": "benchmarks.attention:record",
    "engine": "benchmarks.engine:record",
    "prefill_decode": "labkit.prefill_decode:record",
    "experiment": "labkit.experiment:record",
    "tp_overlap": "labkit.tensor_parallel:record",
}


def _resolve(spec: str):
    module, _, func = spec.partition(":")
    if module.startswith("benchmarks.") and str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of scripts beside labkit/
    return getattr(importlib.import_module(module), func)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*", help=f"which to record (default all: {list(RECORDERS)})")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in RECORDERS]
    if unknown:
        parser.error(f"unknown recordings {unknown}; known: {list(RECORDERS)}")
    for name in args.names or RECORDERS:
        t0 = time.perf_counter()
        try:
            data = _resolve(RECORDERS[name])()
        except recorded.NeedsMoreGPUs as exc:
            if args.names:  # asked for by name: say why it cannot be made here
                raise
            print(f"skipped  {name:<20} (kept as committed): {exc}", flush=True)
            continue
        path = recorded.save(name, data)
        print(f"recorded {name:<20} -> {path} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
