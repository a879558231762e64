"""Launch overhead: a chain of many tiny kernels, eager against CUDA Graph replay.

Each ``x.add_(1)`` is one elementwise kernel. Eager, the CPU pays Python, the dispatcher and
``cudaLaunchKernel`` for every one (microseconds), so a tiny kernel finishes long before the
next is launched and the GPU idles in between. A captured graph submits the whole chain with one
launch. Once one kernel takes longer than one launch, launches hide behind the GPU's work and
the graph stops mattering. Without a GPU the same experiment shows the CPU analogue: Python
dispatch per op against ``torch.compile`` (which also fuses the chain into one loop).
"""
from __future__ import annotations

import statistics
from typing import Iterable

import pandas as pd
import torch

from labkit.measure import bench
from labkit.device import select_device
from labkit.graphs import capture_graph
from labkit.measure.rounds import Spread
from labkit.teaching import claim

MODES = ("eager", "graph", "compiled")


def tiny_kernels(x: torch.Tensor, n_kernels: int) -> torch.Tensor:
    """``n_kernels`` dependent elementwise kernels over ``x: [numel]`` (in place)."""
    for _ in range(n_kernels):
        x.add_(1.0)
    return x


def default_modes(device: torch.device) -> tuple[str, ...]:
    return ("eager", "graph") if device.type == "cuda" else ("eager", "compiled")


def capture_chain(x: torch.Tensor, n_kernels: int) -> torch.cuda.CUDAGraph:
    """The chain on ``x`` captured. The graph keeps no reference to ``x``: the caller must hold
    it for as long as the graph replays, or the replay writes memory freed for others."""
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
        graph = capture_chain(x, n_kernels)

        def replay() -> torch.Tensor:
            graph.replay()
            return x  # held by this closure as long as the graph is
        return replay
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
          device="auto", repeats: int = 7, rounds: int = 3) -> pd.DataFrame:
    """Time per kernel for each size and mode: the table behind notebook 01's main figure.

    Every (size, mode) chain is timed once per round, all of them in turn within a round, so a
    busy spell of the machine lands on every size alike instead of on whichever ran then.
    ``us_per_kernel`` is the median of the round medians, ``low_us``/``high_us`` their range,
    ``p20_us``/``p80_us`` the median of the rounds' percentiles."""
    from labkit.measure.rounds import interleaved

    dev = select_device(device)
    modes = tuple(modes or default_modes(dev))
    cases = {(int(n), m): chain_runner(m, int(n), n_kernels, dev) for n in numels for m in modes}
    names = {f"{m}@{n}": (n, m) for n, m in cases}
    timed = interleaved({name: cases[key] for name, key in names.items()}, rounds=rounds,
                        repeats=repeats, device=dev)
    scale = 1.0 / n_kernels
    rows = []
    for name, (numel, mode) in names.items():
        per_round = timed.timings[name]
        medians = timed.us(name)
        rows.append({"numel": numel, "bytes": numel * 4, "mode": mode,
                     "us_per_kernel": medians.median * scale, "low_us": medians.low * scale,
                     "high_us": medians.high * scale,
                     "p20_us": statistics.median(t.p20_us for t in per_round) * scale,
                     "p80_us": statistics.median(t.p80_us for t in per_round) * scale,
                     "device": str(dev)})
    return pd.DataFrame(rows)


def flat_cost_rounds(numels: Iterable[int], n_kernels: int, device="auto", rounds: int = 5,
                     samples: int = 10) -> dict[int, list[float]]:
    """The eager chain at each size of ``numels`` (the sweep's two smallest), one sample of
    each in turn (A B A B ...), ``samples`` turns a round: per round, each size's fastest sample,
    in us per kernel. Taking turns every sample puts a busy spell of the machine (another
    process holding the core for a few ms) on both sizes, not on whichever ran then, and the
    fastest sample of a round is the cost itself: a busy machine only ever adds time."""
    from labkit.measure.rounds import interleaved

    dev = select_device(device)
    sizes = [int(n) for n in numels]
    timed = interleaved({str(n): chain_runner("eager", n, n_kernels, dev) for n in sizes},
                        rounds=rounds * samples, repeats=1, warmup=0, device=dev)
    out = {}
    for n in sizes:
        each = [t.min_us / n_kernels for t in timed.timings[str(n)]]
        out[n] = [min(each[r * samples:(r + 1) * samples]) for r in range(rounds)]
    return out


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
    df = sweep(numels, n_kernels=100, device=dev, repeats=8, rounds=5)
    eager = trace(chain_runner("eager", 4096, 30, dev), device=dev, warmup=2)
    graph = trace(chain_runner("graph", 4096, 30, dev), device=dev, warmup=2)
    return {"sweep": df.to_dict(orient="list"), "n_kernels": 100,
            "crossover_numel": crossover(df, "eager", "graph"),
            "trace_eager": eager.to_dict(), "trace_graph": graph.to_dict()}


def launch_bound(df: pd.DataFrame, base: str = "eager", fast: str = "graph") -> pd.DataFrame:
    """Per size, what bounds an eager kernel: its launch or its own work.

    Launches are asynchronous, so an eager chain runs at ``max(launch, kernel)`` per kernel, not
    their sum: the CPU launches kernel i+1 while the GPU runs kernel i. ``launch_floor_us`` is
    the eager time of the smallest kernels (pure launch cost: the median of the two smallest
    sizes); a replayed graph pays no launches, so its time is the kernel's own. ``model_us`` is
    ``max(launch_floor, replayed)``, ``bound`` says which term wins, and ``launch_share`` how
    much of the eager time the graph removes."""
    table = speedup_table(df, base, fast).sort_values("numel")
    floor = float(table[base].iloc[:2].median())
    model = table[fast].clip(lower=floor)
    return pd.DataFrame({
        "numel": table.numel.values, base: table[base].values, fast: table[fast].values,
        "launch_floor_us": floor, "model_us": model.values,
        "model_error": (table[base] / model - 1).values,
        "bound": ["launch" if floor >= f else "kernel" for f in table[fast]],
        "launch_share": (1 - table[fast] / table[base]).clip(lower=0.0).values})


# ----------------------------------------------------------------------- what the notebook claims
def sweep_claims(df: pd.DataFrame, fast: str, *, expect_crossover: bool = True, recorded=None,
                 within: float = 0.10, flat: dict[int, list[float]] | None = None) -> list:
    """The sweep's three claims, computed from ``df`` (``recorded``: the recording they were
    checked against, where ``df`` came from one): tiny kernels cost a flat launch each, the fast
    mode removes most of it, and (``expect_crossover``: a graph over sizes up to tens of millions
    of elements) from some size on it stops mattering. A compiled CPU chain also fuses its adds,
    so it keeps winning at every size: there the third claim is not made. ``flat``: the two
    smallest sizes timed against each other (``flat_cost_rounds``); without it (a recording)
    the flat cost is read from ``df``, one value per size."""
    # The 20th percentile of each size's samples: the cost itself, without what a busy machine
    # adds to some of them (a recording without percentiles uses its medians).
    column = "p20_us" if "p20_us" in df else "us_per_kernel"
    table = speedup_table(df.assign(us_per_kernel=df[column]), "eager", fast).sort_values("numel")
    tiny = table.iloc[:2]
    lo_us, hi_us = float(tiny.eager.min()), float(tiny.eager.max())
    if flat is not None:
        (n_a, a), (n_b, b) = sorted(flat.items())
        lo_us, hi_us = min(min(a), min(b)), max(max(a), max(b))
        tiny = pd.DataFrame({"numel": [n_a, n_b]})
        ratio = Spread.of([max(x, y) / min(x, y) for x, y in zip(a, b)])
    else:
        ratio = Spread.of([hi_us / lo_us])
    first = table.iloc[0]
    cross = crossover(df, "eager", fast, within)
    where = f" on {recorded.fingerprint['gpu']}" if recorded is not None else ""
    made = [
        claim("Tiny eager kernels cost about the same whatever they compute{where}: "
              "{lo_us:.2f}-{hi_us:.2f} us per kernel at {a:,} and {b:,} elements "
              "(within {ratio:.2fx}{how}): a fixed cost per launch.",
              ratio.below(1.6), where=where,
              how=", the two taking turns sample by sample" if ratio.rounds > 1 else "", lo_us=lo_us, hi_us=hi_us,
              a=int(tiny.numel.iloc[0]), b=int(tiny.numel.iloc[1]), ratio=ratio,
              recorded=recorded),
        claim("{fast} takes {fast_us:.2f} us per kernel at {n:,} elements against {eager_us:.2f} "
              "us eager{where}: {x:.1f}x less.", first.speedup > 2, fast=fast,
              fast_us=float(first[fast]), n=int(first.numel), eager_us=float(first.eager),
              where=where, x=float(first.speedup), recorded=recorded)]
    if expect_crossover:
        made.append(claim(
            "From {cross} elements per kernel {fast} saves less than {within:.0%}{where}: the "
            "kernels are then long enough to hide the next launch.",
            cross is not None and cross > first.numel,  # it saved more than that before
            cross=f"{cross:,}" if cross is not None else "no measured size",
            fast=fast, within=within, where=where, recorded=recorded))
    return made


def timeline_claims(eager: dict, fast: dict, fast_mode: str, n_kernels: int, *,
                    recorded=None) -> list:
    """What the two timelines show, from their summaries (``Trace.summary``): on a GPU, how
    busy the GPU was eager and replayed, and where an eager kernel's host time goes; on a CPU,
    how many top-level calls each made."""
    where = f" on {recorded.fingerprint['gpu']}" if recorded is not None else ""
    if "gpu_busy_fraction" in eager:
        host, api = eager.get("cpu_us_per_launch"), eager.get("launch_api_us")
        measured = host is not None and api is not None
        return [
            claim("Eager{where}, the GPU ran kernels {busy:.0%} of the chain's span: it spent "
                  "the rest waiting for the next launch.", eager["gpu_busy_fraction"] < 0.5,
                  where=where, busy=eager["gpu_busy_fraction"], recorded=recorded),
            claim("Replayed from a graph, the GPU was busy {fast_busy:.0%} of the span, against "
                  "{busy:.0%} eager.", fast["gpu_busy_fraction"] > eager["gpu_busy_fraction"],
                  fast_busy=fast["gpu_busy_fraction"], busy=eager["gpu_busy_fraction"],
                  recorded=recorded),
            claim("Each eager kernel costs the host {host} us, of which cudaLaunchKernel is "
                  "{api} us: the rest is Python and PyTorch's dispatcher. A replay removes all "
                  "of that host work, not only the launch call.", measured and api < host,
                  host=f"{host:.1f}" if measured else "?", api=f"{api:.1f}" if measured else "?",
                  recorded=recorded),
        ]
    return [
        claim("Eager, every one of the {n} adds is its own top-level call on the CPU timeline: "
              "{ops} of them.", eager["top_level_ops"] == n_kernels, n=n_kernels,
              ops=eager["top_level_ops"]),
        claim("{mode}, the same chain makes {fast_ops} top-level call(s) instead of {ops}.",
              fast["top_level_ops"] < eager["top_level_ops"], mode=fast_mode.capitalize(),
              fast_ops=fast["top_level_ops"], ops=eager["top_level_ops"]),
    ]


def per_kernel_rounds(chains: dict[str, tuple[str, int]], numel: int, device, rounds: int = 3,
                      repeats: int = 15) -> dict:
    """Each chain ``name: (mode, n_kernels)`` of ``numel``-element ops, the chains taking turns
    one sample each, ``repeats`` turns a round: ``{name}_us``, each round's fastest sample in
    microseconds per kernel. Taking turns every sample puts a busy spell of the machine on every
    chain alike, and a busy machine only ever adds time, so the fastest is the cost itself."""
    from labkit.measure.rounds import interleaved

    dev = select_device(device)
    timed = interleaved({k: chain_runner(mode, numel, n, dev) for k, (mode, n) in chains.items()},
                        rounds=rounds * repeats, repeats=1, warmup=0, device=dev)
    out = {}
    for k, (_, n) in chains.items():
        each = [t.min_us / n for t in timed.timings[k]]
        out[f"{k}_us"] = [min(each[r * repeats:(r + 1) * repeats]) for r in range(rounds)]
    return out


def chain_rounds(numel: int, n_kernels: int, factor: int, device, rounds: int = 3,
                 repeats: int = 15) -> dict:
    """Per-kernel eager time of a chain of ``n_kernels`` and one ``factor`` times longer."""
    return per_kernel_rounds({"base": ("eager", n_kernels), "longer": ("eager", factor * n_kernels)},
                             numel, device, rounds, repeats)


def chain_length_claim(base_us, longer_us, n_kernels: int, factor: int, numel: int):
    """The prediction's answer: a chain ``factor`` times longer takes about ``factor`` times as
    long (a cost per kernel), not about as long (a cost per chain): per kernel it stays within
    2x of the shorter chain's in every round. ``base_us`` and ``longer_us``: per-kernel times,
    one per round (or one number each)."""
    from labkit.measure.rounds import Spread

    base = Spread.of(base_us if isinstance(base_us, (list, tuple)) else [base_us])
    longer = Spread.of(longer_us if isinstance(longer_us, (list, tuple)) else [longer_us])
    ratio = Spread.of([b / a for a, b in zip(base.values, longer.values)])
    whole = Spread.of([factor * v for v in ratio.values])
    return claim("A chain of {longer_n} kernels costs {longer_us:.2f} us per kernel at {numel:,} "
                 "elements against {base_us:.2f} us in the {n}-kernel chain, so the whole chain "
                 "took {whole:.1fx} as long for {factor}x the kernels: the cost is paid per "
                 "kernel (a cost per chain would have kept it near 1x).",
                 ratio.above(0.5) and ratio.below(2.0), longer_n=factor * n_kernels,
                 longer_us=longer, numel=numel, base_us=base, n=n_kernels, whole=whole,
                 factor=factor)
