"""The experiment's peers as they declare themselves: which backend is too slow to time on a CPU,
and whose limit it is that a backend cannot be captured in a CUDA Graph, read from
``labkit.attention`` so that every label follows the code it describes."""
from __future__ import annotations

import pandas as pd
import torch

from labkit.attention import BACKENDS, CPU_SLOW


def graph_limit(name: str) -> str | None:
    """Whose limit it is that ``name`` cannot be captured in a CUDA Graph, and why, as its
    declaration in ``labkit.attention.BACKENDS`` states it (None where it declares none)."""
    limit = getattr(BACKENDS.get(name), "limits", {}).get("CUDA Graph capture")
    return f"{limit.by}: {limit.why}" if limit is not None else None


def slow_here(device: torch.device) -> dict[str, str]:
    """Backends that would run here but slowly, with why: on CPU the interpreted or uncompiled
    ones (``CPU_SLOW``); on a GPU none (flex compiles with dynamic shapes, so a new step's
    lengths do not recompile it)."""
    if device.type != "cpu":
        return {}
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
