"""The compatibility matrix: the backends' declarations as one table.

Rows are what must be checked before choosing (model, cache, request, graph, hardware), columns
are the backends in priority order. Generated from ``backends.BACKENDS`` each time, so the
notebook and the README show exactly what selection checks; nothing is typed twice.
"""
from __future__ import annotations

import pandas as pd

from labkit.attention.backends import ATTENTION_KINDS, BACKENDS, PRIORITY, Backend


def _dims(values) -> str:
    if values is None:
        return "any"
    values = list(values)
    if len(values) > 6 and all(b - a == values[1] - values[0] for a, b in zip(values, values[1:])):
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


def compatibility_matrix(backends: dict[str, Backend] | None = None) -> pd.DataFrame:
    """DataFrame indexed by (category, check), one column per backend in priority order."""
    backends = backends or BACKENDS
    names = [n for n in PRIORITY if n in backends] + [n for n in backends if n not in PRIORITY]
    index = pd.MultiIndex.from_tuples([(c, what) for c, what, _ in ROWS],
                                      names=["category", "check"])
    data = {name: [read(backends[name]) for _, _, read in ROWS] for name in names}
    return pd.DataFrame(data, index=index)


def matrix_markdown(backends: dict[str, Backend] | None = None) -> str:
    """The same table as GitHub Markdown (no extra dependency such as tabulate)."""
    df = compatibility_matrix(backends)
    header = ["category", "check", *df.columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for (category, check), row in df.iterrows():
        cells = [category, check, *(str(v).replace("|", "/") for v in row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
