"""The compatibility matrix: the backends' declarations as one table.

Rows are what must be checked before choosing (model, cache, request, graph, hardware), columns
are the backends in priority order. Generated from ``backends.BACKENDS`` each time, so the
notebook and the README show exactly what selection checks; nothing is typed twice.

A cell a backend declares a limit for says whose limit it is: ``never (limit: labkit's
wrapper)`` is a "no" that better labkit code would lift, ``(limit: the library)`` one it would
not. ``limits_table`` lists every such cell with its reason.
"""
from __future__ import annotations

from itertools import pairwise

import pandas as pd

from labkit.attention.backends import ATTENTION_KINDS, BACKENDS, PRIORITY, Backend


def _dims(values) -> str:
    if values is None:
        return "any"
    values = list(values)
    if len(values) > 6 and all(b - a == values[1] - values[0] for a, b in pairwise(values)):
        return f"{values[0]}..{values[-1]} step {values[1] - values[0]}"
    return ", ".join(map(str, values))


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _cc(cc) -> str:
    return "any" if cc is None else f"{cc[0]}.{cc[1]}+"


# (category, what is checked, how a backend's declaration reads in that row)
ROWS = [
    ("model", "query dtypes", lambda b: ", ".join(str(d).replace("torch.", "") for d in b.dtypes)),
    ("model", "head dims", lambda b: _dims(b.head_dims)),
    *[("model", kind, lambda b, k=kind: _yes(k in b.attention_kinds)) for kind in ATTENTION_KINDS],
    ("model", "sliding window", lambda b: _yes(b.sliding_window)),
    ("cache", "KV cache dtypes", lambda b: ", ".join(b.kv_cache_dtypes)),
    ("cache", "KV scale granularity", lambda b: ", ".join(b.kv_scales) or "-"),
    ("cache", "block sizes", lambda b: _dims(b.block_sizes)),
    ("cache", "paged KV", lambda b: b.paged_reads),
    ("request", "mixed prefill + decode", lambda b: _yes(b.mixed_batches)),
    ("graph", "CUDA Graph capture", lambda b: b.cuda_graphs.replace("_", " ")),
    ("hardware", "devices", lambda b: ", ".join(b.devices)),
    ("hardware", "compute capability", lambda b: _cc(b.min_compute_capability)),
    ("hardware", "fp8 cache needs", lambda b: (_cc(b.fp8_min_compute_capability)
                                               if "fp8_e4m3" in b.kv_cache_dtypes else "-")),
]


CHECKS = tuple(what for _, what, _ in ROWS)  # what a Backend's limits may be keyed by


def _ordered(backends: dict[str, Backend] | None) -> dict[str, Backend]:
    backends = backends or BACKENDS
    for b in backends.values():
        unknown = sorted(set(b.limits) - set(CHECKS))
        if unknown:
            raise ValueError(f"backend {b.name!r} declares limits for {unknown}, which are not "
                             f"checks of the matrix; known: {list(CHECKS)}")
    names = [n for n in PRIORITY if n in backends] + [n for n in backends if n not in PRIORITY]
    return {n: backends[n] for n in names}


def _cell(backend: Backend, check: str, read, whose: bool) -> str:
    value, limit = read(backend), backend.limit(check)
    return f"{value} (limit: {limit.by})" if whose and limit is not None else value


def compatibility_matrix(backends: dict[str, Backend] | None = None, *,
                         whose: bool = True) -> pd.DataFrame:
    """DataFrame indexed by (category, check), one column per backend in priority order;
    ``whose`` (default) appends whose limit a declared limit is."""
    backends = _ordered(backends)
    index = pd.MultiIndex.from_tuples([(c, what) for c, what, _ in ROWS],
                                      names=["category", "check"])
    data = {name: [_cell(b, what, read, whose) for _, what, read in ROWS]
            for name, b in backends.items()}
    return pd.DataFrame(data, index=index)


def limits_table(backends: dict[str, Backend] | None = None) -> pd.DataFrame:
    """One row per declared limit: the cell, whose limit it is, whether labkit's own code could
    lift it, and why."""
    rows = [{"backend": name, "category": category, "check": what, "cell": read(b),
             "limited by": b.limit(what).by, "labkit could lift it": b.limit(what).labkits,
             "why": b.limit(what).why}
            for name, b in _ordered(backends).items()
            for category, what, read in ROWS if b.limit(what) is not None]
    return pd.DataFrame(rows, columns=["backend", "category", "check", "cell", "limited by",
                                       "labkit could lift it", "why"])


def unexplained_cells(backends: dict[str, Backend] | None = None) -> list[tuple[str, str, str]]:
    """(backend, check, cell) of every "no" / "never" cell with no declared limit: each one
    should say whose limit it is."""
    return [(name, what, read(b)) for name, b in _ordered(backends).items()
            for _, what, read in ROWS if read(b) in ("no", "never") and b.limit(what) is None]


def _markdown(df: pd.DataFrame) -> list[str]:
    lines = ["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
    for _, row in df.iterrows():
        lines.append("| " + " | ".join(str(v).replace("|", "/") for v in row) + " |")
    return lines


def matrix_markdown(backends: dict[str, Backend] | None = None) -> str:
    """The matrix as GitHub Markdown (no extra dependency such as tabulate), then its limits:
    whose each one is and why."""
    matrix = _markdown(compatibility_matrix(backends).reset_index())
    limits = limits_table(backends).drop(columns=["category", "labkit could lift it"])
    return "\n".join([*matrix, "", *_markdown(limits)])


README_START, README_END = "<!-- compatibility-matrix:start -->", "<!-- compatibility-matrix:end -->"


def sync_readme(path, write: bool = False) -> bool:
    """Is the README's matrix (between the markers) the generated one? ``write`` refreshes it."""
    from pathlib import Path

    text = Path(path).read_text()
    head, _, rest = text.partition(README_START)
    _, _, tail = rest.partition(README_END)
    fresh = f"{head}{README_START}\n{matrix_markdown()}\n{README_END}{tail}"
    if write and fresh != text:
        Path(path).write_text(fresh)
    return fresh == text


if __name__ == "__main__":  # python -m labkit.attention.matrix README.md: refresh the README's copy
    import sys

    sync_readme(sys.argv[1], write=True)
