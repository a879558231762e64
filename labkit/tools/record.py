"""`make record`: re-measure every recorded GPU figure on this CUDA host and write it as data.

Each entry names a function that takes no arguments, measures on the GPU and returns a
JSON-serialisable dict; :func:`labkit.tools.recorded.save` adds the fingerprint, date and commit.
A notebook shows ``labkit.tools.recorded.load(stem, part)`` where no GPU is present.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

import labkit  # noqa: F401  (device set-up first)
from labkit.tools import recorded
from labkit.tools import REPO_ROOT as ROOT

# stem -> part -> the function that measures it: one recording file per notebook stem
RECORDERS: dict[str, dict[str, str]] = {
    "tour": {"peaks": "labkit.measure.peaks:record"},
    "launch_overhead": {"sweep": "labkit.lessons.launch_overhead:record"},
    "cuda_graphs": {"pool": "labkit.lessons.cuda_graphs.measurements:record",
                    "pitfalls": "labkit.lessons.cuda_graphs.pitfalls:record",
                    "engine_context": "labkit.lessons.cuda_graphs.engine_context:record"},
    "torch_compile": {"recompiles": "labkit.lessons.torch_compile.recompiles:record",
                      "engine_fusion": "labkit.lessons.torch_compile.engine_fusion:record"},
    "pinned_memory_streams": {"transfer": "labkit.lessons.pinned_memory_streams:record"},
    "attention_backends": {"kernels": "benchmarks.attention:record"},
    "prefill_vs_decode": {"steps": "labkit.lessons.prefill_vs_decode.forward:record",
                          "chunk_budgets": "labkit.lessons.prefill_vs_decode.chunk_budgets:record"},
    "putting_it_together": {"experiment": "labkit.lessons.putting_it_together.experiment:record",
                            "engine": "benchmarks.engine:record"},
    "multi_gpu_overlap": {"tp_mlp": "labkit.lessons.multi_gpu_overlap:record"},
    "mla": {"decode": "benchmarks.mla_decode:record"},
}


def resolve(spec: str):
    module, _, func = spec.partition(":")
    if module.startswith("benchmarks.") and str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # benchmarks/ is a folder of scripts beside labkit/
    return getattr(importlib.import_module(module), func)


def selected(names: list[str]) -> list[tuple[str, str]]:
    """``stem`` (all its parts) or ``stem/part`` -> (stem, part) pairs; none: everything."""
    chosen = []
    for name in names or list(RECORDERS):
        stem, _, part = name.partition("/")
        if stem not in RECORDERS or (part and part not in RECORDERS[stem]):
            known = [f"{s}/{p}" for s in RECORDERS for p in RECORDERS[s]]
            raise ValueError(f"unknown recording {name!r}; known: {list(RECORDERS)} or {known}")
        chosen += [(stem, p) for p in ([part] if part else RECORDERS[stem])]
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("names", nargs="*",
                        help=f"stems or stem/part to record (default all: {list(RECORDERS)})")
    args = parser.parse_args(argv)
    try:
        chosen = selected(args.names)
    except ValueError as exc:
        parser.error(str(exc))
    for stem, part in chosen:
        name, t0 = f"{stem}/{part}", time.perf_counter()
        try:
            data = resolve(RECORDERS[stem][part])()
        except recorded.NeedsMoreGPUs as exc:
            if args.names:  # asked for by name: say why it cannot be made here
                raise
            print(f"skipped  {name:<32} (kept as committed): {exc}", flush=True)
            continue
        path = recorded.save(stem, part, data)
        print(f"recorded {name:<32} -> {path} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
