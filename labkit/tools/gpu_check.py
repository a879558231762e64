"""`make gpu-check`: on a CUDA host, everything a CPU run cannot check, into one folder.

1. the GPU-marked tests, 2. every benchmark in benchmarks/ (each takes ``--out DIR``),
3. every notebook with DEVICE="cuda" at full size. Each step's log, the executed notebooks, the
benchmarks' CSVs and a summary land in ``--out``. A notebook that would run a benchmark the
run has just run reads its results instead (``labkit.tools.run_results``): the GPU times each
thing once.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import labkit
from labkit.device import describe, fingerprint, select_device
from labkit.tools import REPO_ROOT as ROOT
from labkit.tools.run_notebooks import execute, notebooks, summary_table, write_claims
from labkit.tools.run_results import run_environment


def _step(name: str, cmd: list[str], out: Path, timeout_s: int) -> dict:
    t0 = time.perf_counter()
    log = out / f"{name}.log"
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, f"timed out after {timeout_s} s\n{e.stdout or ''}"
    log.write_text(text)
    tail = "\n".join(text.strip().splitlines()[-25:])
    print(f"--- {name}: rc={rc} ({time.perf_counter() - t0:.0f} s)\n{tail}\n", flush=True)
    return {"step": name, "rc": rc, "seconds": round(time.perf_counter() - t0, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--skip", nargs="*", default=[], choices=["tests", "notebooks", "benchmarks"])
    parser.add_argument("--notebooks", nargs="*", default=[], help="stem prefixes (default all)")
    parser.add_argument("--tests", nargs="*", default=[], help="test files (default: all of tests/)")
    parser.add_argument("--benchmarks", nargs="*", default=[], help="benchmark stems (default all)")
    args = parser.parse_args(argv)
    select_device("cuda")  # a clear error on a host with no GPU
    started = time.time()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "fingerprint.json").write_text(json.dumps(fingerprint(), indent=1))
    print(describe(), flush=True)
    steps = []
    if "tests" not in args.skip:
        steps.append(_step("tests-gpu", [sys.executable, "-m", "pytest", "-q", "-m", "gpu",
                                         f"--junitxml={out / 'tests-gpu.xml'}", *args.tests],
                           out, 1800))
    shared = {}  # what the notebooks may read instead of measuring again
    if "benchmarks" not in args.skip:
        for bench in sorted((ROOT / "benchmarks").glob("*.py")):
            if args.benchmarks and bench.stem not in args.benchmarks:
                continue
            steps.append(_step(f"bench-{bench.stem}", [sys.executable, str(bench), "--out",
                                                       str(out / "benchmarks")], out, 1200))
        shared = run_environment(out / "benchmarks", started)
    if "notebooks" not in args.skip:
        runs = []
        for path in notebooks():
            if args.notebooks and not any(path.stem.startswith(n) for n in args.notebooks):
                continue
            with mock.patch.dict(os.environ, shared):  # the kernel papermill starts inherits it
                run = execute(path, out / "notebooks", {"DEVICE": "cuda", "QUICK": False})
            print(f"notebook {run.notebook}: {run.status} in {run.seconds} s {run.error[-2000:]}",
                  flush=True)
            runs.append(run)
        table = summary_table(runs)
        (out / "notebooks.txt").write_text(table + "\n")
        write_claims(runs, out / "claims.md")
        print(table, flush=True)
        steps += [{"step": f"notebook {r.notebook}", "rc": int(r.status != "ok"),
                   "seconds": r.seconds, "claims": len(r.claims),
                   "claims_failed": r.claims_failed, "slowest_cells": r.slowest_cells}
                  for r in runs]
    (out / "summary.json").write_text(json.dumps(steps, indent=1))
    failed = [s["step"] for s in steps if s["rc"] != 0]
    print(f"gpu-check: {len(steps) - len(failed)} passed, {len(failed)} failed {failed or ''}")
    print(f"results in {out}  ({labkit.__version__}; {describe()})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
