"""Guards, recompilation, compile modes and what each costs; reduce-overhead's two surprises.

A compiled graph is only valid for what Dynamo assumed while tracing: the input's shapes,
dtypes, devices, and Python values it read. Those assumptions become *guards*, checked before
every call. A failed guard means a recompile; after ``recompile_limit`` of them Dynamo gives up
on that function and runs it eagerly. Three ways to live with shapes that change:

* ``dynamic=False``: every new shape is a new graph (fastest code per shape, most compiles);
* ``dynamic=True``: one graph with symbolic sizes (one compile, code that cannot specialise);
* **buckets**: pad the batch up to a few fixed sizes and compile once per bucket, exactly what
  ``labkit.graphs.GraphPool`` does for CUDA Graphs in notebook 02.
"""
from __future__ import annotations

import contextlib
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import pandas as pd
import torch

from labkit.device import synchronize
from labkit.graphs import bucket_for
from labkit.lessons.torch_compile.pipeline import no_caches
from labkit.measure import bench
from labkit.tools.recorded import json_columns

STRATEGIES = ("static", "automatic", "dynamic", "buckets")
_DYNAMIC = {"static": False, "automatic": None, "dynamic": True, "buckets": False}
BATCH_TRACE = (8, 12, 5, 16, 9, 3, 20, 7, 14, 11, 6, 24, 1, 10, 13, 4)


def recompile_limit() -> int:
    """How many graphs Dynamo keeps per function before it falls back to eager."""
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", None) or getattr(cfg, "cache_size_limit"))


@contextlib.contextmanager
def captured_logs(artifact: str):
    """Collect the messages of one ``torch._logging`` artifact (``"recompiles"``, ``"cudagraphs"``).

    Yields the list the messages are appended to. They are kept, not printed; logging settings
    are reset to torch's defaults afterwards.
    """
    messages: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    try:
        torch._logging.set_logs(**{artifact: True})
    except TypeError as e:  # an unknown keyword
        raise RuntimeError(f"torch {torch.__version__} has no logging artifact {artifact!r}; "
                           "see torch._logging.set_logs for the names it knows") from e
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.endswith(f".__{artifact}")]
    if not loggers:
        torch._logging.set_logs()
        raise RuntimeError(f"torch {torch.__version__} has no logging artifact {artifact!r}; "
                           "see torch._logging.set_logs for the names it knows")
    handler, propagate = _Keep(), [lg.propagate for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        yield messages
    finally:
        for lg, prop in zip(loggers, propagate):
            lg.removeHandler(handler)
            lg.propagate = prop
        torch._logging.set_logs()


class CompileCounter:
    """A backend that counts compiles and calls that ran a compiled graph, then runs ``backend``."""

    def __init__(self, backend: str = "eager"):
        self.backend = backend
        self.compiles = 0
        self.graph_calls = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        self.compiles += 1
        compiled = lookup_backend(self.backend)(gm, example_inputs)

        def run(*args):
            self.graph_calls += 1
            return compiled(*args)

        return run


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:  # x: [n, ...] -> [rows, ...]
    if rows <= x.shape[0]:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


@dataclass
class RecompileReport:
    strategy: str
    compiles: int
    reasons: list[str]              # first failed guard of each recompile, in order
    calls: pd.DataFrame = field(repr=False)
    max_abs_err: float = 0.0

    @property
    def eager_fallbacks(self) -> int:
        return int((~self.calls["ran_compiled"]).sum())


def _first_failure(message: str) -> str:
    lines = [ln.strip() for ln in message.splitlines() if ln.strip().startswith("- ")]
    reason = lines[0][2:] if lines else message.strip().splitlines()[-1].strip()
    if "0/1 specialization" in reason or re.search(r"2 <= .*size\(\)\[\d+\]", reason):
        # sizes 0 and 1 always get their own graph, even with dynamic=True
        reason = reason.split("  #")[0] + "  (sizes 0 and 1 are specialised)"
    return reason


def run_shapes(fn: Callable, sizes: Sequence[int], strategy: str, make_input: Callable,
               buckets: Sequence[int] = (4, 8, 16, 32), backend: str = "eager") -> RecompileReport:
    """Call ``torch.compile(fn)`` on batches of ``sizes`` rows with one shape strategy.

    ``fn`` must treat rows independently (as a model's per-token layers do), so padded rows
    cannot change the real ones. ``backend="eager"`` keeps this fast: guards and recompiles
    belong to Dynamo and are the same whichever backend compiles the graphs.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "buckets":
        bucket_for(max(sizes), buckets)  # fail before compiling anything
    counter = CompileCounter(backend)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counter, dynamic=_DYNAMIC[strategy])
    rows, err = [], 0.0
    with captured_logs("recompiles") as messages, torch.no_grad():
        # the recompile-limit warning is noise here: the report counts the fallbacks
        logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
        for n in sizes:
            x = make_input(n)
            before = (counter.compiles, counter.graph_calls)
            if strategy == "buckets":
                run_as = bucket_for(n, buckets)
                out = compiled(pad_rows(x, run_as))[:n]
            else:
                run_as, out = n, compiled(x)
            err = max(err, float((out - fn(x)).abs().max()))
            rows.append({"batch": n, "ran_as": run_as,
                         "compiled_now": counter.compiles > before[0],
                         "ran_compiled": counter.graph_calls > before[1]})
    return RecompileReport(strategy, counter.compiles, [_first_failure(m) for m in messages],
                           pd.DataFrame(rows), err)


def compare_strategies(fn: Callable, sizes: Sequence[int], make_input: Callable,
                       buckets: Sequence[int] = (4, 8, 16, 32),
                       strategies: Sequence[str] = STRATEGIES) -> dict[str, RecompileReport]:
    return {s: run_shapes(fn, sizes, s, make_input, buckets) for s in strategies}


def strategy_table(reports: dict[str, RecompileReport]) -> pd.DataFrame:
    return pd.DataFrame([{"strategy": r.strategy, "dynamic": _DYNAMIC[r.strategy],
                          "compiles": r.compiles, "recompiles": len(r.reasons),
                          "calls that fell back to eager": r.eager_fallbacks,
                          "max |out - eager|": r.max_abs_err} for r in reports.values()])


def strategy_figure(reports: dict[str, RecompileReport]):
    """Cumulative compiles over the sequence of batch sizes, one line per strategy."""
    import plotly.express as px

    frames = []
    for r in reports.values():
        d = r.calls.assign(call=range(1, len(r.calls) + 1), strategy=r.strategy,
                           compiles=r.calls["compiled_now"].cumsum())
        frames.append(d)
    df = pd.concat(frames)
    return px.line(df, x="call", y="compiles", color="strategy", markers=True,
                   hover_data=["batch", "ran_as", "ran_compiled"],
                   title=f"compiles as batch sizes change (recompile limit {recompile_limit()})")


def guard_overhead(entries: int = 8, dim: int = 16, repeats: int = 15) -> pd.DataFrame:
    """Per-call cost of entering a compiled function: Dynamo's frame hook and its guard checks.

    The work is one tiny add, so what is measured is the overhead. With ``entries`` cached
    graphs (one per shape), a call whose graph was compiled first also checks the guards of the
    others before it finds its own.
    """
    def tiny(x):
        return x + 1

    sizes = list(range(1, entries + 1))
    x_first = torch.randn(sizes[0] + 1, dim)
    rows = [("eager", bench.measure(tiny, lambda: (x_first,), device="cpu", repeats=repeats,
                                    calls_per_sample=200, rotate=False))]
    torch._dynamo.reset()
    one = torch.compile(tiny, backend="eager", dynamic=False)
    rows.append(("compiled, 1 graph cached", bench.measure(
        one, lambda: (x_first,), device="cpu", repeats=repeats, calls_per_sample=200,
        rotate=False)))
    torch._dynamo.reset()
    many = torch.compile(tiny, backend="eager", dynamic=False)
    for n in sizes:
        many(torch.randn(n + 1, dim))
    rows.append((f"compiled, {entries} graphs cached", bench.measure(
        many, lambda: (x_first,), device="cpu", repeats=repeats, calls_per_sample=200,
        rotate=False)))
    torch._dynamo.reset()
    eager_us = rows[0][1].median_us
    return pd.DataFrame([{"call": name, "us_per_call": t.median_us,
                          "extra_us_vs_eager": t.median_us - eager_us} for name, t in rows])


def compile_modes(model: torch.nn.Module, x: torch.Tensor, modes: Sequence[str] = ("default",),
                  repeats: int = 20, cold: bool = True) -> pd.DataFrame:
    """First call (compile) against steady-state latency, eager and per mode.

    ``cold`` switches Inductor's caches off so the first call pays the full compile, as on a
    fresh machine; a warm on-disk cache makes a second start much cheaper.
    """
    rows = []
    with torch.no_grad():
        t0 = time.perf_counter()
        expected = model(x)
        synchronize(x.device)
        first = time.perf_counter() - t0
        t = bench.measure(model, lambda: (x,), device=x.device, repeats=repeats, rotate=False)
        rows.append({"mode": "eager", "first_call_s": first, "steady_us": t.median_us,
                     "p20_us": t.p20_us, "p80_us": t.p80_us, "max_abs_err": 0.0})
        for mode in modes:
            torch._dynamo.reset()
            compiled = torch.compile(model, mode=None if mode == "default" else mode)
            with no_caches() if cold else contextlib.nullcontext():
                t0 = time.perf_counter()
                out = compiled(x).clone()  # reduce-overhead: the next call overwrites its output
                synchronize(x.device)
                first = time.perf_counter() - t0
                t = bench.measure(compiled, lambda: (x,), device=x.device, repeats=repeats,
                                  rotate=False)
            rows.append({"mode": mode, "first_call_s": first, "steady_us": t.median_us,
                         "p20_us": t.p20_us, "p80_us": t.p80_us,
                         "max_abs_err": float((out.float() - expected.float()).abs().max())})
    torch._dynamo.reset()
    df = pd.DataFrame(rows)
    df["speedup_vs_eager"] = df.steady_us.iloc[0] / df.steady_us
    df["calls_to_repay_compile"] = [
        (r.first_call_s * 1e6) / max(df.steady_us.iloc[0] - r.steady_us, 1e-9)
        if r.mode != "eager" and r.steady_us < df.steady_us.iloc[0] else float("nan")
        for r in df.itertuples()]
    return df


def modes_figure(df: pd.DataFrame, title: str):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("first call (s)", "steady state (us/call)"))
    fig.add_trace(go.Bar(x=df["mode"], y=df["first_call_s"], name="first call"), row=1, col=1)
    fig.add_trace(go.Bar(x=df["mode"], y=df["steady_us"], name="steady state",
                         error_y=dict(type="data", symmetric=False,
                                      array=df["p80_us"] - df["steady_us"],
                                      arrayminus=df["steady_us"] - df["p20_us"])), row=1, col=2)
    fig.update_layout(title=title, showlegend=False)
    return fig


# --- reduce-overhead (CUDA Graphs under torch.compile): its two surprises, GPU only ---------
def _need_cuda(what: str) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA device: mode='reduce-overhead' captures CUDA "
                           "Graphs, and on a CPU Inductor skips them. The notebook shows the "
                           "recorded GPU result instead (labkit.tools.recorded.load('torch_compile')).")
    return torch.device("cuda")


def output_overwritten(numel: int = 4096) -> dict:
    """Keep the output of one call, make another: the first output's memory is reused."""
    dev = _need_cuda("output_overwritten")

    def step(x):
        return x * 2 + 1

    torch._dynamo.reset()
    f = torch.compile(step, mode="reduce-overhead")
    first_in, second_in = torch.ones(numel, device=dev), torch.full((numel,), 5.0, device=dev)
    for _ in range(3):  # warm-up run, recording, first replay
        f(first_in)
    kept = f(first_in)  # should hold 3.0
    f(second_in)        # writes 11.0 into the same buffer
    try:
        kept_value, error = float(kept[0]), None
    except RuntimeError as e:  # cudagraph trees notice the access and refuse
        kept_value, error = None, str(e).split(" Stack trace")[0]
    safe = f(first_in).clone()
    f(second_in)
    torch._dynamo.reset()
    return {"expected": 3.0, "kept_value": kept_value, "kept_reference_error": error,
            "overwritten": error is not None or kept_value != 3.0,
            "clone_value": float(safe[0]), "clone_is_right": float(safe[0]) == 3.0}


def mutated_input_skips_graphs(numel: int = 4096, repeats: int = 30) -> dict:
    """An in-place update of a plain input makes Inductor run that graph without CUDA Graphs."""
    from torch._dynamo.utils import counters

    dev = _need_cuda("mutated_input_skips_graphs")

    def accumulate(total, x):  # total: [numel], updated in place
        total.add_(x)
        return total * 2

    def accumulate_fixed(total, x):  # returns the new total instead of mutating the input
        new_total = total + x
        return new_total, new_total * 2

    results = {}
    for name, fn in (("mutating", accumulate), ("functional", accumulate_fixed)):
        torch._dynamo.reset()
        total, x = torch.zeros(numel, device=dev), torch.ones(numel, device=dev)
        before = counters["inductor"]["cudagraph_skips"]
        with captured_logs("cudagraphs") as messages:
            f = torch.compile(fn, mode="reduce-overhead")
            for _ in range(3):
                f(total, x)
            t = bench.measure(f, lambda: (total, x), device=dev, repeats=repeats, rotate=False)
        skips = [m.split(". Found from")[0] for m in messages if "skipping cudagraphs" in m]
        results[name] = {"cudagraph_skips": counters["inductor"]["cudagraph_skips"] - before,
                         "skip_reasons": sorted(set(skips)), "steady_us": t.median_us}
    torch._dynamo.reset()
    results["mutating_skipped"] = results["mutating"]["cudagraph_skips"] > 0
    results["functional_skipped"] = results["functional"]["cudagraph_skips"] > 0
    return results


def record() -> dict:
    """`make record`: modes on the full-size block, the reduce-overhead gotchas, Triton code."""
    from labkit.lessons.torch_compile.pipeline import BlockConfig, inductor_code, make_block

    dev = _need_cuda("record")
    cfg = BlockConfig(dim=2048, hidden=8192)
    block = make_block(cfg, dev, torch.bfloat16)
    x = torch.randn(8, cfg.dim, device=dev, dtype=torch.bfloat16)
    modes = compile_modes(block, x, ("default", "reduce-overhead", "max-autotune"), repeats=50)
    stage = inductor_code(block, x)
    return {"block": {"dim": cfg.dim, "hidden": cfg.hidden, "batch": 8, "dtype": "bfloat16"},
            "modes": json_columns(modes),
            "output_overwritten": output_overwritten(),
            "mutated_input": mutated_input_skips_graphs(),
            "triton_kernels": stage.kernels, "extern_calls": stage.extern_calls,
            "triton_source": stage.kernel_source(0, max_lines=40)}
