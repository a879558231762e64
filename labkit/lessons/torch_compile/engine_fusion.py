"""The engine's own model three ways, each replayed from CUDA graphs (notebook 03a).

A decode step's work outside the matmuls and attention is a few dozen small ops a layer (two
RMSNorms, RoPE, SiLU-times-up, residual adds, casts). Three ways to run them:

* **eager ops**: plain torch, one kernel per op (``fused_ops=False``);
* **hand-fused Triton**: labkit's three layer kernels, written by hand (``fused_ops=True``,
  ``kernels/layer_ops.py``): residual add + RMSNorm, RoPE in place, SiLU-times-up;
* **Inductor**: ``compile=True``: Dynamo traces the forward with attention as an opaque op, and
  Inductor generates its own fused kernels for each piece between attentions (the KV store is
  an opaque op too, ``labkit::store_kv``, called from inside its piece).

:func:`fusion_table` builds one engine per way on the same weights, counts the kernels one decode
step launches (the profiler's census, named by what each kernel does), times a decode step at
each batch replayed from a graph (and eagerly, to show the host's share) in interleaved rounds,
and records how long each engine took to build (Dynamo and Inductor's compile included) and
how many graphs it captured. :func:`census_claims` and :func:`step_claims` say what they
show.
"""
from __future__ import annotations

import re
import time
from collections import Counter

import pandas as pd
import torch

from labkit.device import select_device, synchronize
from labkit.teaching import claim

VARIANTS = {"eager ops": {"fused_ops": False},
            "hand-fused Triton": {"fused_ops": True},
            "Inductor (compile=True)": {"compile": True}}

HAND_FUSED = {"_add_rms_norm_kernel": "residual add + RMSNorm", "_rope_kernel": "RoPE",
              "_silu_mul_kernel": "SiLU x up",
              # kernels/skinny_linear.py: a step of few rows, its norm and SiLU folded in
              "_gemv_kernel": "matmul with norm / RoPE / SiLU x up (one row)",
              "_skinny_kernel": "matmul with norm / SiLU x up (up to 16 rows)"}
MATMUL = re.compile(r"nvjet|gemm|cutlass|xmma|splitKreduce|cublas|sm90_", re.I)


def kernel_family(name: str) -> str:
    """What a GPU kernel (by its profiler name) does in a decode step: a matmul, attention, the
    KV store, one of labkit's hand-fused layer kernels, an Inductor kernel (named by the ops it
    fused), or a plain torch kernel (one op)."""
    if name in HAND_FUSED:
        return f"hand-fused: {HAND_FUSED[name]}"
    if name.startswith(("triton_poi_", "triton_red_", "triton_per_")):
        ops = name.split("fused_", 1)[1] if "fused_" in name else name
        ops = re.sub(r"_\d+$", "", ops)
        return f"Inductor: {ops}"
    if "paged_attention" in name or "merge_splits" in name:
        return "attention"
    if "store_kv" in name:
        return "KV store"
    if MATMUL.search(name):
        return "matmul"
    return "torch op"


def census(names: list[str]) -> pd.Series:
    """Kernels of one step by family, most launched first."""
    return pd.Series(Counter(kernel_family(n) for n in names), dtype="int64").sort_values(
        ascending=False)


def step_kernels(llm, context_len: int, device) -> list[str]:
    """The GPU kernels of one batch-1 decode step of ``llm`` (eager: the graphs replay the same
    kernels), in launch order."""
    from labkit.lessons.putting_it_together.padding import decode_step_inputs
    from labkit.measure.profile import trace
    args = decode_step_inputs(llm, 1, context_len)
    with torch.inference_mode():
        t = trace(lambda: llm.runner.decode_forward(*args), device=device, warmup=1)
    ev = t.events
    gpu = ev[ev.lane.str.startswith("GPU") & (ev.kind == "kernel")].sort_values("start_us")
    return gpu.name.tolist()


def fusion_table(model, batches=(1, 64), context_len: int = 512, rounds: int = 3,
                 variants=tuple(VARIANTS)) -> tuple[pd.DataFrame, dict]:
    """One engine per way of running the small ops (``variants``, names of ``VARIANTS``) on
    ``model``'s weights, under the device's default graph mode. Returns (a row per variant and
    batch: build seconds, the compile seconds within them and any compiling after (a
    recompile for a new shape), graphs captured, kernels per step, eager and replayed step
    times with their ranges; {variant: that step's kernel names})."""
    from labkit.engine import LLM
    from labkit.lessons.putting_it_together.padding import decode_step_times

    device = model.embed_tokens.device
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise ValueError(f"variants must be names of VARIANTS {list(VARIANTS)}, got {unknown}")
    rows, names = [], {}
    blocks = -(-context_len // 16) + 1
    for variant in variants:
        synchronize(device)
        t0 = time.perf_counter()
        llm = LLM(model, max_num_seqs=max(batches), max_model_len=context_len,
                  num_blocks=blocks, **VARIANTS[variant])
        synchronize(device)
        build_s = time.perf_counter() - t0
        compiled = llm.runner.compiled
        compile_s = compiled.stats.compile_s if compiled is not None else 0.0
        memory = llm.runner.graph_memory()
        names[variant] = step_kernels(llm, context_len, device) if device.type == "cuda" else []
        times = decode_step_times(llm, list(batches), context_len, rounds=rounds)
        for _, t in times.iterrows():
            rows.append({
                "variant": variant, "batch": int(t.batch), "build_s": build_s,
                "compile_s": compile_s,  # within build_s (graph captures run the forward)
                "compile_later_s": (compiled.stats.compile_s - compile_s
                                    if compiled is not None else 0.0),
                "graphs": int(sum(r["count"] for r in memory)),
                "capture_s": sum(r["capture_ms"] for r in memory) / 1e3,
                "kernels": len(names[variant]) or None,
                **{c: t[c] for c in ("eager_ms", "eager_low_ms", "eager_high_ms", "graph_ms",
                                     "graph_low_ms", "graph_high_ms") if c in t}})
        del llm
    return pd.DataFrame(rows), names


def census_table(names: dict) -> pd.DataFrame:
    """Kernels per decode step by family (rows) and variant (columns); 0 where none."""
    return pd.DataFrame({v: census(n) for v, n in names.items()}).fillna(0).astype("int64")


def census_claims(names: dict, recorded=None) -> list:
    """What the census shows, each checked: how many kernels each way launches a step, and
    what Inductor fused against what the hand-fused path leaves to plain torch."""
    kernels = {v: len(n) for v, n in names.items()}
    eager, hand, ind = "eager ops", "hand-fused Triton", "Inductor (compile=True)"
    made = [claim(
        "A batch-1 decode step launches {e} kernels with plain torch ops, {h} with the "
        "hand-fused layer kernels and {i} with Inductor's: fusing removes launches, not the "
        "matmuls or attention.", kernels[hand] < kernels[eager] > kernels[ind],
        e=kernels[eager], h=kernels[hand], i=kernels[ind], recorded=recorded)]
    fused_by_inductor = sorted({kernel_family(n)[len("Inductor: "):] for n in names[ind]
                                if kernel_family(n).startswith("Inductor")})
    left = {v: int(census(names[v]).get("torch op", 0)) for v in (hand, ind)}
    made.append(claim(
        "Inductor generated {n} distinct fused kernels ({ops}). Plain torch kernels left in a "
        "step: {lh} on the hand-fused path (the ops its three kernels do not cover), {li} "
        "under Inductor, which fuses whatever sits between two matmuls.",
        len(fused_by_inductor) > 0 and left[ind] < left[hand], n=len(fused_by_inductor),
        ops="; ".join(fused_by_inductor[:4]) + ("; ..." if len(fused_by_inductor) > 4 else ""),
        lh=left[hand], li=left[ind], recorded=recorded))
    rope = {v: rope_launches(names[v]) for v in (hand, ind)}
    made.append(claim(
        "The reverse: the hand-fused path launches {h} RoPE kernels a step (at batch 1 its "
        "q/k/v GEMV rotates each pair of q and k features before storing them; with more rows "
        "one launch a layer rotates q and k together), where Inductor's generated rotation "
        "takes {i}: it fuses the ops as the model writes them, rotate-half once for q and once "
        "for k.", rope[hand] < rope[ind], h=rope[hand], i=rope[ind], recorded=recorded))
    return made


def rope_launches(names: list[str]) -> int:
    """Kernels of a step that rotate by RoPE: labkit's own, or Inductor's fused rotate-half
    (a ``cat`` of a negated half, with a multiply: how the plain op is written)."""
    def rotates(name: str) -> bool:
        ops = kernel_family(name)
        return ops == "hand-fused: RoPE" or (ops.startswith("Inductor") and "neg" in ops
                                              and "cat" in ops and "mul" in ops)
    return sum(rotates(n) for n in names)


def step_claims(table: pd.DataFrame, recorded=None) -> list:
    """Which replayed step is faster at each batch, over every round, and what building the
    compiled engine cost against the hand-fused one."""
    t = table.set_index(["variant", "batch"])
    hand, ind = "hand-fused Triton", "Inductor (compile=True)"
    made = []
    for batch in sorted({b for _, b in t.index}):
        h, i = t.loc[(hand, batch)], t.loc[(ind, batch)]
        faster, slower = (hand, ind) if h.graph_ms <= i.graph_ms else (ind, hand)
        f, s = t.loc[(faster, batch)], t.loc[(slower, batch)]
        made.append(claim(
            "Replayed at batch {b}, the {fast} step takes {fm:.3f} ms ({fl:.3f}-{fh:.3f}) and "
            "the {slow} one {sm:.3f} ms ({sl:.3f}-{sh:.3f}): the {fast} path is faster in "
            "every round.", f.graph_high_ms < s.graph_low_ms, b=batch, fast=faster, slow=slower,
            fm=f.graph_ms, fl=f.graph_low_ms, fh=f.graph_high_ms, sm=s.graph_ms,
            sl=s.graph_low_ms, sh=s.graph_high_ms, recorded=recorded))
    first = t.xs(min(b for _, b in t.index), level="batch")
    made.append(claim(
        "Building the Inductor engine took {ib:.1f} s ({ic:.1f} s of it compiling) against "
        "{hb:.1f} s for the hand-fused one: compile time is paid at every cold start unless "
        "the compile cache is kept.", first.loc[ind, "build_s"] > first.loc[hand, "build_s"],
        ib=first.loc[ind, "build_s"], ic=first.loc[ind, "compile_s"],
        hb=first.loc[hand, "build_s"], recorded=recorded))
    return made


def record(batches=(1, 64), context_len: int = 512, rounds: int = 3) -> dict:
    """`make record torch_compile/engine_fusion`: the table on ``ModelConfig.bench_1b`` in bf16."""
    from labkit.engine import ModelConfig, random_model
    dev = select_device("auto")
    if dev.type != "cuda":
        raise RuntimeError("engine_fusion is recorded on a CUDA GPU: the hand-fused kernels run "
                           "in Triton's interpreter elsewhere")
    model = random_model(ModelConfig.bench_1b(), device=dev)
    table, names = fusion_table(model, batches, context_len, rounds)
    return {"table": table.to_dict(orient="list"), "kernels": names,
            "context_len": context_len, "rounds": rounds}


def table_view(table: pd.DataFrame) -> pd.DataFrame:
    """The step table as a reader takes it in: per variant and batch, kernels, the replayed
    step with its range over the rounds, the eager step, build and compile seconds, graphs."""
    replayed = [f"{m:.3f} ({lo:.3f}-{hi:.3f})" for m, lo, hi in
                zip(table.graph_ms, table.graph_low_ms, table.graph_high_ms)]
    view = table.assign(**{"replayed ms (range)": replayed})
    return view[["variant", "batch", "kernels", "replayed ms (range)", "eager_ms", "build_s",
                 "compile_s", "graphs"]].round(3)


def census_figure(names: dict, title: str):
    """Kernels of one batch-1 decode step, stacked by family, one bar per variant."""
    import plotly.express as px
    counts = census_table(names).rename_axis("family").reset_index().melt(
        id_vars="family", var_name="variant", value_name="kernels")
    fig = px.bar(counts[counts.kernels > 0], x="variant", y="kernels", color="family",
                 title=title, text="kernels")
    fig.update_traces(textposition="inside")
    # a label that does not fit its slice is hidden, not drawn over its neighbours; the legend
    # goes under the plot so long Inductor kernel names do not squeeze the bars
    fig.update_layout(barmode="stack", legend_title_text="what the kernel does",
                      uniformtext_minsize=9, uniformtext_mode="hide", height=620,
                      legend=dict(orientation="h", yanchor="top", y=-0.2, x=0))
    return fig


def step_figure(table: pd.DataFrame, title: str):
    """The replayed decode step per variant and batch, with each one's range over the rounds."""
    import plotly.express as px
    t = table.assign(plus=table.graph_high_ms - table.graph_ms,
                     minus=table.graph_ms - table.graph_low_ms, batch=table.batch.astype(str))
    return px.bar(t, x="batch", y="graph_ms", color="variant", barmode="group", error_y="plus",
                  error_y_minus="minus", title=title,
                  labels={"graph_ms": "decode step, replayed (ms)", "batch": "batch"})
