"""The registry call against the bare kernel, for appendix 06a: why notebook 06's live roofline
(the registry, called as an engine's Python code calls it once per step) and the benchmark (the
bare kernels, engine-style arguments, graphs where they capture) give different times for the
same kernels. ``registry_split`` splits each registry time into host time and the GPU's kernel
time (the profiler's), and that into the bare kernel's and the wrapper's extra GPU work;
``registry_claims`` says so, one sentence per pair, each checked for consistency.
"""
from __future__ import annotations

import pandas as pd

from labkit.lessons.attention_backends.claims_speed import not_claimed
from labkit.lessons.attention_backends.roofline import result_of, spread_of
from labkit.teaching import claim

# (workload, registry backend, the benchmark's bare kernels: section, peers). Where SDPA may
# dispatch to more than one kernel, the fastest of them is the bare kernel's lower bound.
PAIRS = [
    ("prefill", "triton", "prefill", ("triton (ours)",)),
    ("prefill", "flex", "prefill", ("flex",)),
    ("prefill", "sdpa", "prefill", ("sdpa flash", "sdpa cudnn")),
    ("decode B64 ctx 4096", "triton", "decode", ("auto",)),
    ("decode B64 ctx 4096", "flex", "decode", ("flex",)),
    ("decode B64 ctx 4096", "sdpa", "decode", ("sdpa flash",)),
]
SPLIT_COLUMNS = ["workload", "backend", "kernels", "wall_us", "wall_high_us", "gpu_us",
                 "host_us", "bare", "bare_us", "extra_gpu_us"]


def registry_split(registry: pd.DataFrame | None, data: dict) -> pd.DataFrame:
    """One row per pair of ``PAIRS`` that both sides measured: the registry's wall time (median,
    and the top of its range), its GPU kernel time and kernel count (an integer), the host time
    (wall minus GPU, never below zero), the bare kernel's time and the GPU time above it."""
    rows = []
    if registry is not None and "gpu_us" in registry:
        for workload, backend, section, peers in PAIRS:
            mine = registry[(registry.workload == workload) & (registry.backend == backend)
                            & registry.error.isna()]
            bares = {p: spread_of(result_of(data, section, p)) for p in peers}
            bares = {p: s for p, s in bares.items() if s is not None}
            if mine.empty or not bares or pd.isna(mine.gpu_us.iloc[0]):
                continue
            peer = min(bares, key=lambda p: bares[p].median)
            r, bare = mine.iloc[0], bares[peer].median
            gpu = float(r.gpu_us)
            rows.append({"workload": workload, "backend": backend, "kernels": r.kernels,
                         "wall_us": float(r.us), "wall_high_us": float(r.us_high),
                         "gpu_us": gpu, "host_us": max(0.0, float(r.us) - gpu), "bare": peer,
                         "bare_us": bare, "extra_gpu_us": gpu - bare})
    return pd.DataFrame(rows, columns=SPLIT_COLUMNS).astype({"kernels": "Int64"})


def registry_claims(registry: pd.DataFrame | None, data: dict, *, where: str = "",
                    recorded=None) -> list:
    """One sentence per row of ``registry_split``. Holds when the split is consistent: the GPU
    time is no more than the wall time and no less than the bare kernel's (the two measured the
    same shapes)."""
    split = registry_split(registry, data)
    if split.empty:
        return not_claimed("registry section (wall and GPU kernel time per backend, for the "
                           "shapes the benchmark also measured)")
    return [claim(
        "{workload}, `{backend}` through the registry{where}: {wall:.0f} us wall (median, range "
        "over rounds), of which the GPU ran {k} kernel(s) for {gpu:.0f} us; the benchmark's bare "
        "`{peer}` takes {bare:.0f} us. Host time (GPU idle) is {host:.0f} us; the wrapper's "
        "extra GPU work {extra}.",
        r.gpu_us <= 1.1 * r.wall_high_us and r.gpu_us >= 0.8 * r.bare_us, workload=r.workload,
        backend=r.backend, where=where, wall=r.wall_us,
        k=int(r.kernels) if pd.notna(r.kernels) else "?", gpu=r.gpu_us, peer=r.bare,
        bare=r.bare_us, host=r.host_us, extra=_extra_gpu(r.extra_gpu_us), recorded=recorded)
        for r in split.itertuples()]


def _extra_gpu(us: float) -> str:
    """The registry's kernel time above the bare kernel's: two separate measurements, so a
    difference below zero says there is none, not that the wrapper saved time."""
    if us < 0:
        return (f"none measurable (the registry's kernels took {-us:.0f} us less than the bare "
                "kernel timed in the benchmark: the two measurements' noise)")
    return f"{us:.0f} us"


def registry_limits(registry: pd.DataFrame | None, data: dict) -> pd.DataFrame:
    """Every backend or peer that raised instead of running, with its error: a limit shown."""
    rows = []
    if registry is not None and len(registry):
        for r in registry[registry.error.notna()].itertuples():
            rows.append({"where": f"registry, {r.workload}", "backend": r.backend,
                         "error": r.error})
    for section in ("prefill", "decode", "long_context"):
        for peer, result in ((data or {}).get(section) or {}).items():
            if isinstance(result, dict) and "error" in result:
                rows.append({"where": f"benchmark, {section}", "backend": peer,
                             "error": result["error"]})
    return pd.DataFrame(rows, columns=["where", "backend", "error"])
