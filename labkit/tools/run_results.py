"""Benchmark results that this `make gpu-check` run measured already, for its notebooks to read.

``gpu_check`` runs the benchmarks before the notebooks, each saving its JSON into one folder,
and names that folder (``RESULTS_ENV``) and the time the run started (``STARTED_ENV``) in the
environment of the notebooks it then executes. A notebook that would run the same benchmark
again reads that file instead: the same machine and code, minutes earlier in the same run, so
the GPU is not asked to time the same thing twice. A file written before the run started, or on
another machine, is not used; anywhere the variables are unset (a learner's own run, ``make
run``, a test) every notebook measures for itself.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

RESULTS_ENV = "LABKIT_RUN_RESULTS"
STARTED_ENV = "LABKIT_RUN_STARTED"


def run_environment(folder: Path, started: float) -> dict[str, str]:
    """The variables that hand ``folder``'s results, written after ``started`` (seconds since
    the epoch), to the notebooks of the same run (the folder made absolute: a notebook runs
    in its own directory)."""
    return {RESULTS_ENV: str(Path(folder).resolve()), STARTED_ENV: repr(float(started))}


def this_run(filename: str, fingerprint: dict | None = None) -> dict | None:
    """The ``results`` of ``filename`` (as ``labkit.measure.bench.save_results`` wrote it) when
    this run's benchmarks wrote it on this machine; None otherwise."""
    folder = os.environ.get(RESULTS_ENV)
    if not folder:
        return None
    path = Path(folder) / filename
    started = float(os.environ.get(STARTED_ENV, "inf"))
    if not path.is_file() or path.stat().st_mtime < started:
        return None
    saved = json.loads(path.read_text())
    if fingerprint is None:
        from labkit.device import fingerprint as here
        fingerprint = here()
    if saved.get("fingerprint") != fingerprint or not isinstance(saved.get("results"), dict):
        return None
    return saved["results"]
