"""The experiment's peers as they declare themselves: which backend the engine does not time on
a device, and whose limit it is that a backend cannot be captured in a CUDA Graph, read from
``labkit.attention.BACKENDS`` so that every label follows the code it describes."""
from __future__ import annotations

import re

import pandas as pd
import torch

from labkit.attention import BACKENDS, CPU_SLOW


def engine_limit(name: str, device: torch.device) -> str | None:
    """Why ``name`` is not timed in the engine on ``device``, from its declaration in
    ``labkit.attention.BACKENDS`` (None: time it). On a GPU that is a backend whose declaration
    says it is compiled for fixed shapes: each engine step brings a new KV length, so Dynamo
    recompiles until its limit and then runs unfused; the row says the limit is labkit's
    wrapper, as declared, not FlexAttention's."""
    b = BACKENDS[name]
    fixed = getattr(b, "fixed_shapes", None)
    if fixed is None:  # no field for it: read the declared compile settings in the notes
        fixed = bool(re.search(r"fixed shapes|dynamic=False", b.notes))
    if device.type == "cuda" and fixed:
        return (f"not timed: labkit's {name} wrapper is compiled for fixed shapes and every "
                f"engine step brings a new KV length, so it would time recompiles "
                f"(declared: {b.notes or b.summary})")
    return None


def graph_limit(name: str) -> str | None:
    """Whose limit it is that ``name`` cannot be captured in a CUDA Graph, and why, as its
    declaration in ``labkit.attention.BACKENDS`` states it (None where it declares none)."""
    limit = getattr(BACKENDS.get(name), "limits", {}).get("CUDA Graph capture")
    return f"{limit.by}: {limit.why}" if limit is not None else None


def slow_here(device: torch.device) -> dict[str, str]:
    """Backends that would run here but slowly, with why: on CPU the interpreted or uncompiled
    ones, on a GPU those :func:`engine_limit` rules out."""
    if device.type != "cpu":
        return {name: why for name in BACKENDS if (why := engine_limit(name, device))}
    return {name: f"not run, to keep this run short: {why.split(';')[0]}"
            for name, why in CPU_SLOW.items()}


def peer_notes(names=None) -> pd.DataFrame:
    """Each backend's own declaration: what it is, whether a graph can capture it, and its
    limits, read from ``labkit.attention.BACKENDS`` so the table follows the code."""
    rows = [{"backend": n, "summary": BACKENDS[n].summary,
             "cuda_graphs": BACKENDS[n].cuda_graphs, "graph capture limit": graph_limit(n) or "",
             "paged_reads": BACKENDS[n].paged_reads, "notes": BACKENDS[n].notes}
            for n in (names or BACKENDS)]
    return pd.DataFrame(rows)
