"""See what the CPU and the GPU did: ``trace(fn)`` -> event table -> plotly timeline + summary.

The profiler (Kineto/CUPTI) records CPU ops, CUDA runtime calls and GPU kernels, and ties each
launch to the kernel it started through a correlation id. That link is the lesson: a gap on the
GPU lane that starts where a launch starts on the CPU lane is launch overhead, and graphs or
compilation are the fix; a GPU lane that is busy end to end means launches are not the problem.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch.profiler import ProfilerActivity, profile, record_function

from labkit.device import fingerprint, select_device, synchronize
from labkit.measure.events import EVENT_COLUMNS, parse_chrome_trace, summarize, thin
from labkit.measure.timeline import timeline_figure

WINDOW = "labkit.trace"
# Kineto announces every profiler start and stop on stderr, for USDT probes, at a severity above
# ERROR: no log level hides these lines and keeps its errors, so they are filtered by prefix.
PROFILER_NOTICE = b"USDT:"


@contextlib.contextmanager
def without_profiler_notices():
    """Send the process's stderr (fd 2, where the profiler's C++ side writes) to a file for the
    block, then write back every line but Kineto's ``USDT:`` start/stop notices, so a real
    error still shows. A notebook kernel forwards fd 2 into red boxes under the cell."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to filter
        yield
        return
    with tempfile.TemporaryFile() as held:
        sys.stderr.flush()
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = b"".join(line for line in held if not line.startswith(PROFILER_NOTICE))
            while kept:
                kept = kept[os.write(2, kept):]


@dataclass
class Trace:
    events: pd.DataFrame
    summary: dict
    fingerprint: dict = field(default_factory=dict)
    chrome_trace: dict | None = field(default=None, repr=False)

    def summary_table(self) -> pd.DataFrame:
        """One row per summary figure; a count prints as 150, a time or fraction to 3 decimals."""
        values = {k: round(v, 3) if isinstance(v, float) else v for k, v in self.summary.items()}
        return pd.DataFrame({"value": pd.Series(values, dtype=object)})

    def figure(self, title: str = "", max_events: int = 2500):
        return timeline_figure(self.events, title=title, max_events=max_events)

    def export_chrome(self, path: str | os.PathLike) -> str:
        """Write the raw trace; open it at ui.perfetto.dev or chrome://tracing."""
        if self.chrome_trace is None:
            raise ValueError("this trace was rebuilt from saved events and has no raw trace")
        with open(path, "w") as f:
            json.dump(self.chrome_trace, f)
        return str(path)

    def to_dict(self, max_events: int = 1500) -> dict:
        kept, _ = thin(self.events, max_events)
        return {"events": kept.round(3).to_dict(orient="list"), "summary": self.summary,
                "fingerprint": self.fingerprint}

    @classmethod
    def from_dict(cls, d: dict) -> Trace:
        return cls(events=pd.DataFrame(d["events"], columns=EVENT_COLUMNS), summary=d["summary"],
                   fingerprint=d.get("fingerprint", {}))


def trace(fn: Callable, *args, device: str | torch.device = "auto", warmup: int = 1,
          **kwargs) -> Trace:
    """Trace one call of ``fn(*args, **kwargs)`` under torch.profiler.

    ``warmup`` untraced calls come first; then the profiler runs a discarded step (its own
    start-up, milliseconds of CUPTI set-up, would otherwise look like launch cost), a settling
    call, and the call that is kept. So ``fn`` runs ``warmup + 3`` times and must be repeatable.
    """
    dev = select_device(device)
    activities = [ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    for _ in range(warmup):
        fn(*args, **kwargs)
    synchronize(dev)
    # One profiled-but-discarded step first: the profiler's own start-up (CUPTI set-up on the
    # first launch, milliseconds) would otherwise look like the first kernel's launch cost.
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=1, repeat=1)
    with warnings.catch_warnings(), without_profiler_notices():
        warnings.simplefilter("ignore", UserWarning)
        with profile(activities=activities, schedule=schedule) as prof:
            for step in range(2):
                # In the recorded step, a first call absorbs what the switch to recording costs;
                # only the second, inside the WINDOW annotation, is kept.
                for name in ("labkit.settle", WINDOW) if step else ("labkit.settle",):
                    with record_function(name):
                        fn(*args, **kwargs)
                        synchronize(dev)
                prof.step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            raw = json.load(f)
    events = parse_chrome_trace(raw, window=WINDOW)
    return Trace(events=events, summary=summarize(events), fingerprint=fingerprint(),
                 chrome_trace=raw)
