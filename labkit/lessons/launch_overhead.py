"""Launch overhead: a chain of many tiny kernels, eager against CUDA Graph replay.

Each ``x.add_(1)`` is one elementwise kernel. Eager, the CPU pays Python, the dispatcher and
``cudaLaunchKernel`` for every one (microseconds), so a tiny kernel finishes long before the
next is launched and the GPU idles in between. A captured graph submits the whole chain with one
launch. Once one kernel takes longer than one launch, launches hide behind the GPU's work and
the graph stops mattering. Without a GPU the same experiment shows the CPU analogue: Python
dispatch per op against ``torch.compile`` (which also fuses the chain into one loop).
"""
from __future__ import annotations

from typing import Iterable

import pandas as pd
import torch

from labkit.measure import bench
from labkit.device import select_device
from labkit.graphs import capture_graph

MODES = ("eager", "graph", "compiled")


def tiny_kernels(x: torch.Tensor, n_kernels: int) -> torch.Tensor:
    """``n_kernels`` dependent elementwise kernels over ``x: [numel]`` (in place)."""
    for _ in range(n_kernels):
        x.add_(1.0)
    return x


def default_modes(device: torch.device) -> tuple[str, ...]:
    return ("eager", "graph") if device.type == "cuda" else ("eager", "compiled")


def capture_chain(x: torch.Tensor, n_kernels: int) -> torch.cuda.CUDAGraph:
    return capture_graph(lambda: tiny_kernels(x, n_kernels))[0]


_compiled_chains: dict[int, object] = {}


def compiled_chain(n_kernels: int):
    """One compiled chain per length; ``dynamic=True`` so every size reuses one compilation."""
    if n_kernels not in _compiled_chains:
        _compiled_chains[n_kernels] = torch.compile(
            lambda x: tiny_kernels(x, n_kernels), dynamic=True)
    return _compiled_chains[n_kernels]


def chain_runner(mode: str, numel: int, n_kernels: int, device: torch.device):
    """A zero-argument callable that runs the chain once in ``mode``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    x = torch.zeros(numel, device=device)
    if mode == "eager":
        return lambda: tiny_kernels(x, n_kernels)
    if mode == "graph":
        if device.type != "cuda":
            raise ValueError("mode='graph' needs a CUDA device; on CPU compare 'eager' with "
                             "'compiled' instead")
        return capture_chain(x, n_kernels).replay
    fn = compiled_chain(n_kernels)
    return lambda: fn(x)


def time_per_kernel(mode: str, numel: int, n_kernels: int, device="auto",
                    repeats: int = 15) -> bench.Timing:
    dev = select_device(device)
    run = chain_runner(mode, numel, n_kernels, dev)
    t = bench.measure(run, device=dev, warmup=3, repeats=repeats)
    scale = 1.0 / n_kernels
    return bench.Timing(t.median_us * scale, t.p20_us * scale, t.p80_us * scale,
                        t.min_us * scale, t.repeats, t.device, t.method)


def sweep(numels: Iterable[int], n_kernels: int = 64, modes: Iterable[str] | None = None,
          device="auto", repeats: int = 15) -> pd.DataFrame:
    """Time per kernel for each size and mode: the table behind notebook 01's main figure."""
    dev = select_device(device)
    rows = []
    for numel in numels:
        for mode in modes or default_modes(dev):
            t = time_per_kernel(mode, int(numel), n_kernels, dev, repeats)
            rows.append({"numel": int(numel), "bytes": int(numel) * 4, "mode": mode,
                         "us_per_kernel": t.median_us, "p20_us": t.p20_us, "p80_us": t.p80_us,
                         "device": str(dev)})
    return pd.DataFrame(rows)


def speedup_table(df: pd.DataFrame, base: str = "eager", fast: str | None = None) -> pd.DataFrame:
    """Per size: base and fast time per kernel and how much the fast mode saves."""
    fast = fast or next(m for m in df["mode"].unique() if m != base)
    wide = df.pivot(index="numel", columns="mode", values="us_per_kernel")
    out = pd.DataFrame({base: wide[base], fast: wide[fast]})
    out["speedup"] = out[base] / out[fast]
    out["saved_fraction"] = 1 - out[fast] / out[base]
    return out.reset_index()


def crossover(df: pd.DataFrame, base: str = "eager", fast: str | None = None,
              within: float = 0.10) -> int | None:
    """Smallest size from which the fast mode saves less than ``within`` of the time."""
    table = speedup_table(df, base, fast).sort_values("numel")
    small_gain = table[table.saved_fraction < within]
    return int(small_gain.numel.iloc[0]) if len(small_gain) else None


def sweep_figure(df: pd.DataFrame, title: str):
    import plotly.express as px

    fig = px.line(df, x="numel", y="us_per_kernel", color="mode", markers=True, log_x=True,
                  log_y=True, title=title,
                  labels={"numel": "elements per kernel (float32)", "us_per_kernel": "us per kernel"},
                  hover_data={"bytes": True, "p20_us": ":.2f", "p80_us": ":.2f"})
    return fig


def record() -> dict:
    """`make record`: the full GPU sweep and the two timelines (eager, graph replay)."""
    from labkit.measure.profile import trace

    dev = select_device("cuda")
    numels = [2**k for k in range(8, 27, 2)]
    df = sweep(numels, n_kernels=100, device=dev, repeats=20)
    eager = trace(chain_runner("eager", 4096, 30, dev), device=dev, warmup=2)
    graph = trace(chain_runner("graph", 4096, 30, dev), device=dev, warmup=2)
    return {"sweep": df.to_dict(orient="list"), "n_kernels": 100,
            "crossover_numel": crossover(df, "eager", "graph"),
            "trace_eager": eager.to_dict(), "trace_graph": graph.to_dict()}


def overhead_share(df: pd.DataFrame, mode: str = "eager") -> pd.DataFrame:
    """How much of each op's time is the fixed per-launch cost (its time at the smallest size)."""
    d = df[df["mode"] == mode].sort_values("numel")
    fixed = d.us_per_kernel.iloc[0]
    return pd.DataFrame({"numel": d.numel.values, "us_per_kernel": d.us_per_kernel.values,
                         "fixed_cost_share": (fixed / d.us_per_kernel).clip(upper=1.0).values})
