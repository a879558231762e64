"""Guards and recompilation under changing shapes; reduce-overhead's two surprises.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch

from labkit.graphs import bucket_for
from labkit.measure import bench
from labkit.tools.recorded import json_columns

STRATEGIES = ("static", "automatic", "dynamic", "buckets")
_DYNAMIC = {"static": False, "automatic": None, "dynamic": True, "buckets": False}
BATCH_TRACE = (8, 12, 5, 16, 9, 3, 20, 7, 14, 11, 6, 24, 1, 10, 13, 4)


def recompile_limit() -> int:
    """How many graphs Dynamo keeps per function before it falls back to eager."""
    cfg = torch._dynamo.config
    return int(getattr(cfg, "recompile_limit", None) or cfg.cache_size_limit)


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


@contextlib.contextmanager
def dynamo_warnings_as_text():
    """Dynamo's warnings (the recompile limit's among them) print whole under the cell as plain
    text, prefixed "Dynamo warned", instead of going to stderr: a notebook shows stderr as a red
    box that reads as a crash. Nothing is dropped; torch's own handlers come back afterwards."""
    class _Print(logging.Handler):
        def emit(self, record):
            print(f"Dynamo warned ({record.name}): {record.getMessage()}")

    logger = logging.getLogger("torch._dynamo")
    saved = logger.handlers[:]
    logger.handlers = [_Print(logging.WARNING)]
    try:
        yield
    finally:
        logger.handlers = saved


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
    belong to Dynamo and are the same whichever backend compiles the graphs. Dynamo's warning
    when a function hits the recompile limit is shown, as plain text: it is the one sign a user
    gets.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if strategy == "buckets":
        bucket_for(max(sizes), buckets)  # fail before compiling anything
    counter = CompileCounter(backend)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=counter, dynamic=_DYNAMIC[strategy])
    rows, err = [], 0.0
    with captured_logs("recompiles") as messages, dynamo_warnings_as_text(), torch.no_grad():
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


# --- reduce-overhead (CUDA Graphs under torch.compile): its two surprises, GPU only ---------
def _need_cuda(what: str) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs a CUDA device: mode='reduce-overhead' captures CUDA "
                           "Graphs, and on a CPU Inductor skips them. The notebook shows the "
                           "recorded GPU result instead "
                           "(labkit.tools.recorded.load('torch_compile', 'recompiles')).")
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
            t = bench.measure(f, lambda total=total, x=x: (total, x), device=dev, repeats=repeats, rotate=False)
        skips = [m.split(". Found from")[0] for m in messages if "skipping cudagraphs" in m]
        results[name] = {"cudagraph_skips": counters["inductor"]["cudagraph_skips"] - before,
                         "skip_reasons": sorted(set(skips)), "steady_us": t.median_us}
    torch._dynamo.reset()
    results["mutating_skipped"] = results["mutating"]["cudagraph_skips"] > 0
    results["functional_skipped"] = results["functional"]["cudagraph_skips"] > 0
    return results


def record() -> dict:
    """`make record`: the modes' steady state in interleaved rounds with their GPU kernel time,
    static against dynamic=True, cold and warm-cache starts in fresh processes, the
    reduce-overhead gotchas and the Triton code, all on the full-size block."""
    from labkit.lessons.torch_compile import cold_start, modes
    from labkit.lessons.torch_compile.pipeline import (
        BlockConfig,
        inductor_code,
        make_block,
    )

    dev = _need_cuda("record")
    cfg, tokens = BlockConfig(dim=2048, hidden=8192), 8
    block = make_block(cfg, dev, torch.bfloat16)
    x = torch.randn(tokens, cfg.dim, device=dev, dtype=torch.bfloat16)
    steady = modes.steady_state(block, x, modes.MODES, rounds=7)
    dynamic = modes.dynamic_cost(block, x, rounds=7)
    starts = cold_start.cold_and_warm(modes.MODES, dim=cfg.dim, hidden=cfg.hidden, tokens=tokens,
                                      device="cuda", dtype="bfloat16", rounds=3)
    stage = inductor_code(block, x)
    return {"block": {"dim": cfg.dim, "hidden": cfg.hidden, "batch": tokens, "dtype": "bfloat16"},
            "steady": modes.steady_record(steady),
            "autotune_log_lines": len(steady.autotune_log),
            "dynamic": modes.steady_record(dynamic),
            "cold_starts": json_columns(starts),
            "output_overwritten": output_overwritten(),
            "mutated_input": mutated_input_skips_graphs(),
            "triton_kernels": stage.kernels, "extern_calls": stage.extern_calls,
            "triton_source": stage.kernel_source(0, max_lines=40)}
