"""What a call costs once compiled: the modes, ``dynamic=True`` and the compiled entry, timed
fairly.

A small block at decode batch sizes is *host-bound*: its kernels finish long before Python has
launched the next one. Then a steady-state timing measures the host's work per call (Python,
Dynamo's guard check, Inductor's wrapper, the launches), not the kernels, and the profiler's
GPU kernel time is the figure that says so. So every mode here is timed in interleaved rounds
(A B C, A B C, ...: drift falls on every mode alike) and reported as a median with its range
over rounds, beside the GPU kernel time of one profiled call.

* ``default``: Inductor's fused kernels, launched from Python one by one;
* ``reduce-overhead``: the same code captured as CUDA Graphs and replayed (GPU only);
* ``max-autotune``: benchmarks matmul and kernel configurations while compiling, then replays
  CUDA Graphs as ``reduce-overhead`` does.

``max-autotune`` writes its benchmark table to stderr while it compiles; it is kept in the
result (``autotune_log``) instead of flooding the cell. Its "Autotune Choices Stats" lines (one
JSON summary per tuned op, meant for Inductor's compile-event log) are switched off at the source
with ``max_autotune_report_choices_stats``. Nothing else on stderr is touched.
"""
from __future__ import annotations

import contextlib
import io
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch
from torch._inductor import config as inductor_config

from labkit.device import synchronize
from labkit.measure.rounds import Rounds, interleaved
from labkit.tools.recorded import json_columns

MODES = ("default", "reduce-overhead", "max-autotune")
GRAPHED = ("reduce-overhead", "max-autotune")   # modes that replay CUDA Graphs on a GPU
# the lines Inductor's autotuner writes (select_algorithm.log_results), and nothing else
_AUTOTUNE_LINE = ("AUTOTUNE ", "strides: ", "dtypes: ", "  ", "SingleProcess AUTOTUNE",
                  "SubProcess AUTOTUNE")


class _AutotuneFilter(io.TextIOBase):
    """A stderr that keeps the autotuner's lines and passes every other line through."""

    def __init__(self, stream):
        self.stream, self.kept, self._partial = stream, [], ""

    def write(self, text: str) -> int:
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        for line in lines:
            if line.startswith(_AUTOTUNE_LINE):
                self.kept.append(line)
            else:
                self.stream.write(line + "\n")
        return len(text)

    def flush(self):
        if self._partial:
            (self.kept.append if self._partial.startswith(_AUTOTUNE_LINE)
             else self.stream.write)(self._partial)
            self._partial = ""
        self.stream.flush()


@contextlib.contextmanager
def autotune_log_kept():
    """Yields the list the autotuner's stderr lines go to; its choices-stats summary is not
    written at all. Logging (Dynamo's recompile-limit warning included) keeps its own handlers
    and is shown as usual."""
    keep = _AutotuneFilter(sys.stderr)
    # read while compiling: the first call of a compiled function must run inside this block
    with contextlib.redirect_stderr(keep), \
            inductor_config.patch(max_autotune_report_choices_stats=False):
        try:
            yield keep.kept
        finally:
            keep.flush()


def compiled(model: Callable, mode: str, *, dynamic: bool | None = False) -> Callable:
    """``torch.compile(model)`` in ``mode``; Dynamo keys its cache on the backend, so several
    modes of one model live side by side and each call finds its own graph."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    return torch.compile(model, mode=None if mode == "default" else mode, dynamic=dynamic)


def _caller(fn: Callable, x: torch.Tensor, graphed: bool) -> Callable[[], torch.Tensor]:
    if graphed:
        def step():
            # a new step: the previous call's outputs (static graph memory) may be reused
            torch.compiler.cudagraph_mark_step_begin()
            return fn(x)
        return step
    return lambda: fn(x)


# Samples per case per round. A host-bound call takes a few hundred microseconds, so a round's
# median of this many moves only when the host stalls for longer than half of them together
# (tens of milliseconds): one short stall of the host cannot flip a round's order.
REPEATS = 200


@dataclass
class Steady:
    """Steady state per case: wall time per call over interleaved rounds, and one profiled call."""
    rounds: Rounds
    gpu: dict[str, dict]                      # case -> the profiler's summary (GPU: kernel time)
    first_call_s: dict[str, float]            # in this process: compile + first run
    max_abs_err: dict[str, float]
    autotune_log: list[str] = field(default_factory=list)

    def table(self) -> pd.DataFrame:
        t = wall_table(self.rounds)
        t["gpu_kernel_us"] = [self.gpu.get(c, {}).get("gpu_busy_us") for c in t["mode"]]
        t["kernels"] = [self.gpu.get(c, {}).get("kernel_count") for c in t["mode"]]
        t["first_call_in_process_s"] = [self.first_call_s.get(c) for c in t["mode"]]
        t["max_abs_err"] = [self.max_abs_err.get(c, 0.0) for c in t["mode"]]
        return t


def _time_cases(model: Callable, x: torch.Tensor, fns: dict[str, tuple[Callable, bool]],
                rounds: int, repeats: int, profile: bool) -> tuple[Rounds, dict]:
    from labkit.measure.profile import trace

    cases = {name: _caller(fn, x, graphed) for name, (fn, graphed) in fns.items()}
    # a recompile while timing would time the compiler: make it an error instead
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        timed = interleaved(cases, rounds=rounds, device=x.device, repeats=repeats)
        gpu = {name: trace(run, device=x.device, warmup=1).summary
               for name, run in cases.items()} if profile else {}
    return timed, gpu


def _first_calls(model, x, fns) -> tuple[dict, dict, list[str]]:
    first, err = {}, {}
    with torch.no_grad(), autotune_log_kept() as log:
        expected = model(x)
        for name, (fn, graphed) in fns.items():
            t0 = time.perf_counter()
            out = _caller(fn, x, graphed)().clone()  # graphed: the next call reuses its output
            synchronize(x.device)
            first[name] = time.perf_counter() - t0
            err[name] = float((out.float() - expected.float()).abs().max())
    return first, err, list(log)


def steady_state(model: torch.nn.Module, x: torch.Tensor, modes: Sequence[str] = ("default",),
                 rounds: int = 5, repeats: int = REPEATS, profile: bool | None = None) -> Steady:
    """Eager and each compile mode, compiled first, then timed in interleaved rounds; with
    ``profile`` (default: on a GPU) one profiled call per case gives its GPU kernel time."""
    torch._dynamo.reset()
    on_gpu = x.device.type == "cuda"
    fns = {"eager": (model, False)}
    fns.update({m: (compiled(model, m), on_gpu and m in GRAPHED) for m in modes})
    first, err, log = _first_calls(model, x, fns)
    timed, gpu = _time_cases(model, x, fns, rounds, repeats, on_gpu if profile is None else profile)
    torch._dynamo.reset()
    return Steady(timed, gpu, first, err, log)


def dynamic_cost(model: torch.nn.Module, x: torch.Tensor, rounds: int = 5, repeats: int = REPEATS,
                 profile: bool | None = None) -> Steady:
    """The runtime price of ``dynamic=True`` under Inductor: the same block compiled for this
    shape and with symbolic sizes, timed on the same input in interleaved rounds."""
    torch._dynamo.reset()
    fns = {"static": (compiled(model, "default", dynamic=False), False),
           "dynamic=True": (compiled(model, "default", dynamic=True), False)}
    first, err, log = _first_calls(model, x, fns)
    timed, gpu = _time_cases(model, x, fns, rounds, repeats,
                             x.device.type == "cuda" if profile is None else profile)
    torch._dynamo.reset()
    return Steady(timed, gpu, first, err, log)


def guard_rounds(entries: int = 8, dim: int = 16, rounds: int = 5, repeats: int = 15) -> Rounds:
    """Per-call cost of entering a compiled function: Dynamo's frame hook, its guard checks and
    the FX graph's own Python call.

    The work is one tiny add compiled with the ``eager`` backend, so what is timed is the entry
    as a whole; the guard check alone is not separated from the rest.
    ``entries`` graphs cached (one per shape) against one: a call to the first-compiled shape
    may check other entries' guards before it finds its own.
    """
    def tiny(x):
        return x + 1

    x = torch.randn(2, dim)
    torch._dynamo.reset()
    one = torch.compile(tiny, backend="eager", dynamic=False)
    many = torch.compile(lambda t: tiny(t), backend="eager", dynamic=False)  # its own code object
    one(x)
    for n in range(2, entries + 2):
        many(torch.randn(n, dim))
    calls = 200  # per sample: the clock's resolution is far above one call

    def batch(fn):
        def run():
            for _ in range(calls):
                fn(x)
        return run

    cases = {"eager": batch(tiny), "compiled, 1 graph cached": batch(one),
             f"compiled, {entries} graphs cached": batch(many)}
    with torch._dynamo.config.patch(error_on_recompile=True):
        timed = interleaved(cases, rounds=rounds, device="cpu", repeats=repeats)
    torch._dynamo.reset()
    per_call = {k: tuple(_scaled(t, 1 / calls) for t in v) for k, v in timed.timings.items()}
    return Rounds(per_call, timed.orders)


def _scaled(t, k):
    from dataclasses import replace
    return replace(t, median_us=t.median_us * k, p20_us=t.p20_us * k, p80_us=t.p80_us * k,
                   min_us=t.min_us * k)


def wall_table(r: Rounds) -> pd.DataFrame:
    """One row per case: wall time per call, its median, range and every round's value."""
    rows = []
    for case in r.timings:
        s = r.us(case)
        rows.append({"mode": case, "wall_us": s.median, "wall_low_us": s.low,
                     "wall_high_us": s.high, "wall_rounds_us": list(s.values),
                     "gpu_kernel_us": None})
    return pd.DataFrame(rows)


def steady_figure(table: pd.DataFrame, title: str):
    """Wall time per call (median, range over rounds) beside the GPU kernel time of one call."""
    import plotly.graph_objects as go

    fig = go.Figure(go.Bar(
        x=table["mode"], y=table["wall_us"], name="wall time per call (median of rounds)",
        error_y={"type": "data", "symmetric": False,
                 "array": table["wall_high_us"] - table["wall_us"],
                 "arrayminus": table["wall_us"] - table["wall_low_us"]}))
    if table["gpu_kernel_us"].notna().any():
        fig.add_trace(go.Bar(x=table["mode"], y=table["gpu_kernel_us"],
                             name="GPU kernel time per call (profiler)"))
    fig.update_layout(title=title, barmode="group", yaxis_title="us per call")
    return fig


def steady_record(steady: Steady) -> dict:
    """A recording's columns: the table without the per-call outputs."""
    return json_columns(steady.table())
