"""Attention speeds read against the machine's two ceilings, for notebook 06.

A kernel at ``I`` FLOPs per byte can go no faster than ``min(matmul rate, I x bandwidth)``:
the roofline. Prefill sits far right (compute-bound), decode far left (bandwidth-bound).
``roofline_points`` places the results of ``benchmarks/attention.py`` (live, or recorded on a
GPU) on it, using the bytes and FLOPs of the benchmark's shapes as ``AttentionWorkload``
computes them; ``registry_points`` times the registry's backends here, as an engine calls them.
``targets`` scores the results against the kernels' speed targets (``TARGETS``), each with the
range of its rounds. The roofline figure is plotly; the bar figures are in ``figures``.
"""
from __future__ import annotations

import inspect
import math

import pandas as pd
import plotly.graph_objects as go
import torch

from labkit.lessons.attention_backends.compare import (
    AttentionWorkload,
    registry_table,
    time_registry,
)
from labkit.measure.rounds import Spread

# The shapes of benchmarks/attention.py (tests check that its defaults still match).
PREFILL = {"batch": 4, "heads": 32, "seq": 4096, "head_dim": 128}
DECODE = {"batch": 64, "q_heads": 32, "kv_heads": 8, "context": 4096, "head_dim": 128,
          "block_size": 16}
LONG_CONTEXT = 32768
TILE_BEFORE = "split, 64-key tiles, no prefetch"  # the long-context rows of the earlier tile


def prefill_workload() -> AttentionWorkload:
    p = PREFILL
    lens = (p["seq"],) * p["batch"]
    return AttentionWorkload(lens, lens, p["heads"], p["heads"], p["head_dim"], torch.bfloat16,
                             paged=False, name="prefill")


def decode_workload(batch: int | None = None, context: int | None = None,
                    kv_cache_dtype: str = "auto") -> AttentionWorkload:
    d = DECODE
    batch, context = batch or d["batch"], context or d["context"]
    return AttentionWorkload((1,) * batch, (context,) * batch, d["q_heads"], d["kv_heads"],
                             d["head_dim"], torch.bfloat16, block_size=d["block_size"],
                             kv_cache_dtype=kv_cache_dtype, name=f"decode B{batch} ctx {context}")


def source_excerpt(obj, first: str, last: str | None = None) -> str:
    """Lines of ``obj``'s source from the first containing ``first`` to the next containing
    ``last`` (or just that line), numbered as in the file. Unwraps Triton's jit/autotune."""
    while hasattr(obj, "fn"):
        obj = obj.fn
    lines, start = inspect.getsourcelines(obj)
    i = next((n for n, line in enumerate(lines) if first in line), None)
    if i is None:
        raise ValueError(f"{first!r} is not in the source of {obj.__name__}")
    j = i if last is None else next((n for n in range(i, len(lines)) if last in lines[n]), None)
    if j is None:
        raise ValueError(f"{last!r} does not follow {first!r} in the source of {obj.__name__}")
    return "".join(f"{start + n:4d}  {lines[n]}" for n in range(i, j + 1))


def result_of(data: dict | None, section: str, peer: str):
    """One peer's result in a benchmark section; None where the section failed or is absent."""
    value = (data or {}).get(section)
    return value.get(peer) if isinstance(value, dict) else None


def spread_of(result) -> Spread | None:
    """A benchmark result's time in us over its rounds (one value where it was recorded without
    rounds); None for a peer that did not run."""
    if not isinstance(result, dict) or "us" not in result:
        return None
    return Spread.of(result.get("rounds_us") or [result["us"]])


def ratio_of(a, b) -> Spread | None:
    """a's time over b's, taken within each round where both have rounds (how many times faster
    b is); from the medians where either was recorded without rounds; None if either is absent."""
    sa, sb = spread_of(a), spread_of(b)
    if sa is None or sb is None:
        return None
    if sa.rounds == sb.rounds > 1:
        return Spread.of([x / y for x, y in zip(sa.values, sb.values)])
    return Spread.of([sa.median / sb.median])


def fraction_of_copy(result, copy_gbps) -> Spread | None:
    """A decode result's GB/s over the copy bandwidth, per round."""
    s = spread_of(result)
    if s is None or "gbps" not in result or not copy_gbps:
        return None
    kilobytes = result["gbps"] * result["us"]  # GB/s x us: the bytes it moved, fixed per call
    return Spread.of([kilobytes / us / copy_gbps for us in s.values])


def _point(rows, workload: AttentionWorkload, label: str, result) -> None:
    s = spread_of(result)
    if s is None:
        return  # a peer that could not run in the benchmark
    seconds = s.median * 1e-6
    rows.append({"workload": workload.name, "backend": label, "us": s.median, "us_low": s.low,
                 "us_high": s.high, "rounds": int(s.rounds),
                 "flops_per_byte": workload.flops() / workload.bytes_moved(),
                 "tflops": workload.flops() / seconds / 1e12,
                 "gbps": workload.bytes_moved() / seconds / 1e9})


def roofline_points(data: dict) -> pd.DataFrame:
    """One row per measured (workload, peer) of a ``benchmarks/attention.py`` result."""
    rows = []
    prefill = prefill_workload()
    for peer, result in (data.get("prefill") or {}).items():
        _point(rows, prefill, peer, result)
    decode = decode_workload()
    for peer in ("auto", "checked", "sdpa flash", "flex"):
        _point(rows, decode, {"auto": "triton (ours)", "checked": "ours, checked"}.get(peer, peer),
               (data.get("decode") or {}).get(peer))
    for batch in (1, 2, 4):
        long = decode_workload(batch, LONG_CONTEXT)
        for mode in ("split (auto)", "no split"):
            result = (data.get("long_context") or {}).get(f"B{batch} {mode}")
            _point(rows, long, f"ours, {mode}", result)
    fp8 = (data.get("decode") or {}).get("fp8_e4m3") or (data.get("fp8") or {}).get("fp8_e4m3")
    _point(rows, decode_workload(kv_cache_dtype="fp8_e4m3"), "ours, fp8 cache", fp8)
    return pd.DataFrame(rows)


def registry_points(workloads: list[AttentionWorkload], device: str, *, rounds: int = 3,
                    repeats: int = 5, warmup: int = 1) -> pd.DataFrame:
    """Every compatible backend of the registry timed on each workload, here and now, called
    as an engine calls it; a backend that raises is a row with its error."""
    frames = [time_registry(w, device, rounds=rounds, repeats=repeats, warmup=warmup)
              for w in workloads]
    return registry_table(pd.concat(frames, ignore_index=True))


_SYMBOLS = ["circle", "square", "diamond", "triangle-up", "cross", "star", "x"]


def roofline_figure(points: pd.DataFrame, copy_gbps: float, matmul_tflops: float,
                    title: str) -> go.Figure:
    """Log-log: achieved TFLOP/s over FLOPs per byte, under min(matmul, intensity x bandwidth)."""
    lo = min(points.flops_per_byte.min(), 1.0) / 2
    hi = max(points.flops_per_byte.max(), 1e3) * 2
    ridge = matmul_tflops * 1e3 / copy_gbps  # FLOPs per byte where the two ceilings meet
    xs = sorted({lo, ridge, hi})
    fig = go.Figure(go.Scatter(x=xs, y=[min(matmul_tflops, x * copy_gbps / 1e3) for x in xs],
                               mode="lines", line={"color": "gray", "dash": "dash"},
                               name=f"roof: {copy_gbps:,.0f} GB/s copy, "
                                    f"{matmul_tflops:,.1f} TFLOP/s matmul"))
    symbols = {w: s for w, s in zip(points.workload.unique(), _SYMBOLS * 4)}
    for backend, g in points.groupby("backend", sort=False):  # colour: backend; shape: workload
        fig.add_scatter(x=g.flops_per_byte, y=g.tflops, mode="markers", name=backend,
                        marker={"size": 12, "symbol": [symbols[w] for w in g.workload]},
                        text=g.workload, hovertemplate="%{text}: %{x:.1f} FLOP/B, "
                                                       "%{y:.3g} TFLOP/s")
    for workload, symbol in symbols.items():  # legend entries for the shapes
        fig.add_scatter(x=[None], y=[None], mode="markers", name=f"shape: {workload}",
                        marker={"size": 10, "symbol": symbol, "color": "gray"})
    fig.update_layout(title=title, xaxis_title="arithmetic intensity (FLOPs per HBM byte)",
                      yaxis_title="TFLOP/s", xaxis_type="log", yaxis_type="log", height=520)
    return fig


# The speed targets of the attention kernels, stated once (the open kernel issue's): what each
# requires, and AIMS, the further marks aimed at. Each is met only when every round clears it.
TARGETS = {
    "prefill: ours vs SDPA flash (speed ratio)": 1.2,
    "prefill: ours vs FlexAttention (speed ratio)": 1.0,
    "prefill: ours vs SDPA cuDNN (speed ratio)": 1.0,
    "decode: ours, fraction of copy bandwidth": 0.8,
    "decode: ours vs SDPA flash (speed ratio)": 1.3,
    "long context B1, split: fraction of copy bandwidth": 0.8,
    "long context B2, split: fraction of copy bandwidth": 0.88,
    "long context B4, split: fraction of copy bandwidth": 0.88,
    "fp8 cache vs bf16 decode (speed ratio)": 1.75,
}
AIMS = {"prefill: ours vs SDPA cuDNN (speed ratio)": 1.15,
        "fp8 cache vs bf16 decode (speed ratio)": 1.9}


def verdict(spread: Spread | None, required: float) -> str:
    """'met' only when every round clears the target; 'within noise' when the range straddles
    it (the spread is as large as the margin); 'missed' when every round falls short."""
    if spread is None:
        return "not measured"
    if spread.above(required):
        return "met"
    return "within noise" if spread.high >= required else "missed"


def targets(data: dict) -> pd.DataFrame:
    """The attention kernels' speed targets, each computed from ``data`` per round, with its
    median, range and verdict; a missing result is never met."""
    def get(section, peer):
        return result_of(data, section, peer)

    copy = data.get("copy_gbps")
    ours = get("prefill", "triton (ours)")
    decode = get("decode", "auto")
    bf16 = decode if get("decode", "fp8_e4m3") else get("fp8", "bf16")
    fp8 = get("decode", "fp8_e4m3") or get("fp8", "fp8_e4m3")
    measured = {
        "prefill: ours vs SDPA flash (speed ratio)": ratio_of(get("prefill", "sdpa flash"), ours),
        "prefill: ours vs FlexAttention (speed ratio)": ratio_of(get("prefill", "flex"), ours),
        "prefill: ours vs SDPA cuDNN (speed ratio)": ratio_of(get("prefill", "sdpa cudnn"), ours),
        "decode: ours, fraction of copy bandwidth": fraction_of_copy(decode, copy),
        "decode: ours vs SDPA flash (speed ratio)": ratio_of(get("decode", "sdpa flash"), decode),
        **{f"long context B{b}, split: fraction of copy bandwidth":
           fraction_of_copy(get("long_context", f"B{b} split (auto)"), copy) for b in (1, 2, 4)},
        "fp8 cache vs bf16 decode (speed ratio)": ratio_of(bf16, fp8),
    }
    rows = []
    marks = [(name, need, "must") for name, need in TARGETS.items()]
    marks += [(name, need, "aim") for name, need in AIMS.items()]
    for name, need, kind in marks:
        s = measured[name]
        rows.append({"target": name if kind == "must" else f"{name}: aim",
                     "measured": s.median if s else math.nan,
                     "low": s.low if s else math.nan, "high": s.high if s else math.nan,
                     "rounds": s.rounds if s else 0, "required": need, "kind": kind,
                     "verdict": verdict(s, need)})
    df = pd.DataFrame(rows)
    df["met"] = df.verdict == "met"
    return df


def block_sweep_table(data: dict) -> pd.DataFrame | None:
    """The benchmark's block-size sweep as decode's fraction of the copy bandwidth, one row per
    block size and one column per context (both in tokens); None where it was not measured."""
    sweep = data.get("block_sweep")
    if not isinstance(sweep, list) or not sweep:  # a failed section is a dict with its error
        return None
    table = pd.DataFrame(sweep).astype({"block_size": "int64", "context": "int64",
                                        "batch": "int64"})
    return table.pivot(index="block_size", columns="context", values="fraction_of_copy")


MEASURED_EARLIER = "measured earlier in this gpu-check run by benchmarks/attention.py"


def live_results(with_registry: bool = False) -> dict:
    """Run ``benchmarks/attention.py`` here (a CUDA GPU): the dict ``make record`` keeps (the
    notebook times the registry itself, so by default the benchmark leaves that section out).
    Inside ``make gpu-check``, which ran the benchmark before its notebooks, its results are
    read instead (``labkit.tools.run_results``), with ``measured_by`` saying so."""
    from labkit.tools.run_results import this_run
    saved = this_run("attention.json")
    registry = (saved or {}).get("registry")  # a failed section is {"error": "..."}
    ran = isinstance(registry, dict) and not isinstance(registry.get("error"), str)
    if saved is not None and (not with_registry or ran):
        return {**saved, "measured_by": MEASURED_EARLIER}
    from labkit.tools.record import resolve
    return resolve("benchmarks.attention:run")(None, with_registry=with_registry)


def live_source(data: dict, gpu: str) -> str:
    """How a notebook labels ``live_results``: measured now, or earlier in this run."""
    return f"{data.get('measured_by', 'measured now')} on {gpu}"
