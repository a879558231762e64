"""Graph breaks: code TorchDynamo cannot put into one graph, and how to rewrite it so it can.

Dynamo records tensor operations without running them on real data. When Python needs a
*value* from a tensor (an ``if`` on it, ``.item()``, ``print``), or calls something Dynamo
cannot look into (a C extension, a function marked not traceable), the graph ends there:
Dynamo compiles what it has, runs the offending bytecode in plain Python, and starts a new
graph after it. Each break costs a round trip through Python, a host sync where a value is
read, and the fusion across the break. ``torch._dynamo.explain`` counts the graphs and says why
each break happened. Every example below has a fixed twin that computes the same thing in one
graph; the tests hold both to that.
"""
from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch


# --- 1. Python control flow on a tensor's value ------------------------------------------
def branch_on_value(x: torch.Tensor) -> torch.Tensor:  # x: [tokens, dim]
    if x.sum() > 0:  # Python needs a bool now: the graph must end to compute it
        return x * 2
    return x - 1


def branch_on_value_fixed(x: torch.Tensor) -> torch.Tensor:
    # Both sides are cheap: compute both and select per element, all inside the graph.
    return torch.where(x.sum() > 0, x * 2, x - 1)


# --- 2. .item(): a tensor value pulled into Python ---------------------------------------
def scale_by_item(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax().item()
    return torch.round(x / (amax + 1e-6) * 127)


def scale_by_item_fixed(x: torch.Tensor) -> torch.Tensor:
    amax = x.abs().amax()  # stays a 0-d tensor: no host sync, no break
    return torch.round(x / (amax + 1e-6) * 127)


# --- 3. print (logging) inside the compiled region -----------------------------------------
def print_inside(x: torch.Tensor) -> torch.Tensor:
    h = torch.relu(x)
    print("mean activation", h.mean())
    return h * 2


def print_inside_fixed(x: torch.Tensor) -> torch.Tensor:
    # Return what you want to log and print it outside the compiled function.
    h = torch.relu(x)
    return h * 2


# --- 4. a call Dynamo cannot trace ---------------------------------------------------------
@torch.compiler.disable
def _opaque_softclip(x: torch.Tensor) -> torch.Tensor:
    # Stands for a pybind/C++ extension or library code marked not traceable: Dynamo cannot
    # see inside, so it must leave the graph to call it.
    return torch.tanh(x / 3) * 3


@torch.library.custom_op("labkit::softclip", mutates_args=())
def softclip(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x / 3) * 3


@softclip.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    # Shape and dtype of the result without running it: all Dynamo needs to keep tracing.
    return torch.empty_like(x)


def unsupported_call(x: torch.Tensor) -> torch.Tensor:
    return _opaque_softclip(x * 2) + 1


def unsupported_call_fixed(x: torch.Tensor) -> torch.Tensor:
    # Registered as a custom op, the same code is one opaque node inside the graph.
    return softclip(x * 2) + 1


@dataclass(frozen=True)
class BreakExample:
    name: str
    broken: Callable
    fixed: Callable
    fix: str


EXAMPLES = (
    BreakExample("if on a tensor value", branch_on_value, branch_on_value_fixed,
                 "torch.where(cond, a, b): both branches computed, chosen per element"),
    BreakExample(".item()", scale_by_item, scale_by_item_fixed,
                 "keep the value as a 0-d tensor"),
    BreakExample("print", print_inside, print_inside_fixed,
                 "return what you log; print outside the compiled function"),
    BreakExample("untraceable call", unsupported_call, unsupported_call_fixed,
                 "wrap it as torch.library.custom_op (with a fake for shapes)"),
)


def _first_line(reason: str) -> str:
    line = reason.strip().splitlines()[0] if reason.strip() else reason
    return line[:160]


class _DropBreakWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().lstrip().startswith("Graph break")


@contextlib.contextmanager
def break_warnings_dropped():
    """Drop Dynamo's "Graph break ..." warnings (explain's table lists the same breaks); every
    other warning, the recompile-limit one included, still reaches its handlers."""
    drop, handlers = _DropBreakWarnings(), []
    logger = logging.getLogger("torch._dynamo")
    while logger is not None:
        handlers += logger.handlers
        logger = logger.parent if logger.propagate else None
    for h in handlers:
        h.addFilter(drop)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(drop)


def explain(fn: Callable, *args) -> dict:
    """Graph count, break count and one line per break reason, from ``torch._dynamo.explain``."""
    torch._dynamo.reset()
    with break_warnings_dropped(), contextlib.redirect_stdout(io.StringIO()):
        out = torch._dynamo.explain(fn)(*args)  # the print example prints while traced
    return {"graphs": out.graph_count, "breaks": out.graph_break_count,
            "reasons": [_first_line(r.reason) for r in out.break_reasons],
            "ops_per_graph": [len(ops) for ops in out.ops_per_graph]}


def break_table(x: torch.Tensor, examples=EXAMPLES) -> pd.DataFrame:
    """For each example, broken and fixed: graphs, breaks and why."""
    rows = []
    for ex in examples:
        for version, fn in (("broken", ex.broken), ("fixed", ex.fixed)):
            e = explain(fn, x)
            rows.append({"example": ex.name, "version": version, "graphs": e["graphs"],
                         "breaks": e["breaks"], "ops per graph": e["ops_per_graph"],
                         "reason": "; ".join(e["reasons"]) or "-",
                         "fix": ex.fix if version == "fixed" else ""})
    return pd.DataFrame(rows)


def graphs_of(table: pd.DataFrame, example: str, version: str = "broken") -> int:
    """How many graphs ``break_table`` found for one example's version."""
    row = table[(table.example == example) & (table.version == version)]
    if len(row) != 1:
        raise KeyError(f"break_table has no {version!r} row for {example!r}; its examples: "
                       f"{sorted(set(table.example))}")
    return int(row.graphs.iloc[0])


def same_result(ex: BreakExample, x: torch.Tensor) -> bool:
    """The fix must compute what the broken version computes (both eager, the reference)."""
    with contextlib.redirect_stdout(io.StringIO()):
        return bool(torch.equal(ex.broken(x), ex.fixed(x)))


def break_figure(table: pd.DataFrame):
    import plotly.express as px

    return px.bar(table, x="example", y="graphs", color="version", barmode="group",
                  title="graphs per function: a break splits one graph into two",
                  hover_data=["breaks", "reason"])
