"""What notebook 08a claims about padding to graph buckets, each sentence computed from the
scheduler's decode batches, the bucket sets' counts and, where measured, the decode step times:
how the batch moves under continuous batching, what each set pads at worst and in all, that the
plan is the engine's, and what padded rows cost in time (:func:`step_time_claims`).
"""
from __future__ import annotations

from itertools import pairwise

import pandas as pd

from labkit.lessons.putting_it_together.padding import step_padding
from labkit.measure.rounds import Spread
from labkit.teaching import claim

PLANNED = "planned, 4 graphs"


def shrink_claim(batches: list[int]):
    """Every request arrives at once: after the prefills the decode batch only shrinks, through
    many sizes below the largest, which is why one graph for the largest batch is not enough."""
    top, low = max(batches, default=0), min(batches, default=0)
    below = sum(b < top / 2 for b in batches)
    return claim("The {n} decode steps start at {top} rows and shrink, never growing, to {low} as "
                 "requests finish, through {sizes} distinct sizes: {below} of them ran below "
                 "half the largest batch, where one graph for the largest batch pads more rows "
                 "than the step computes.",
                 len(batches) > 1 and low < top and all(a >= b for a, b in pairwise(batches)),
                 n=len(batches), top=top, low=low, sizes=len(set(batches)), below=below)


def planner_claim(costs: pd.DataFrame, sets: dict[str, tuple[int, ...]]):
    """``plan_buckets`` knows the batches: its set pads no more than any other set with at most
    as many graphs."""
    c = costs.set_index("buckets")
    plan, pow2 = c.loc[PLANNED], c.loc["powers of two"]
    rivals = c[(c.graphs <= plan.graphs) & (c.index != PLANNED)]
    return claim("From these batches `plan_buckets` picks {buckets} ({g} graphs): {p:,} padded "
                 "rows, no more than any other set of at most {g} graphs here ({rivals}); powers "
                 "of two, with {g2} graphs, pad {p2:,}.",
                 len(rivals) > 0 and plan.padded_rows <= rivals.padded_rows.min(),
                 buckets=list(sets[PLANNED]), g=int(plan.graphs), p=int(plan.padded_rows),
                 rivals="; ".join(f"'{n}' {int(r.padded_rows):,}" for n, r in rivals.iterrows()),
                 g2=int(pow2.graphs), p2=int(pow2.padded_rows))


def bound_claims(batches: list[int], sets: dict[str, tuple[int, ...]]) -> list:
    """The most a set pads onto one step: powers of two fewer rows than the batch has (its
    bucket is under twice the batch); vLLM's default sizes at most 7 rows up to 256 (a bucket
    every 8) and 15 beyond (every 16)."""
    pow2, vllm = (step_padding(batches, sets[n]) for n in ("powers of two", "vLLM default sizes"))
    worst = pow2.loc[(pow2.padded / pow2.bucket).idxmax()]
    limit = 7 if max(batches) <= 256 else 15
    return [
        claim("With powers of two no decode step padded as many rows as it had: the worst, a "
              "batch of {b} replayed as {k}, padded {p} ({share:.0%} of its bucket, under half); "
              "over the run {waste:.1%} of the rows computed were padding.",
              bool((pow2.padded < pow2.batch).all()), b=int(worst.batch), k=int(worst.bucket),
              p=int(worst.padded), share=worst.padded / worst.bucket,
              waste=pow2.padded.sum() / pow2.bucket.sum()),
        claim("vLLM's default sizes ({g} graphs up to {top}) padded no step by more than {m} "
              "rows (at most {limit}: a bucket every 8 rows up to 256, every 16 beyond): {p:,} "
              "padded rows in all, against {p2:,} for powers of two's {g2} graphs.",
              int(vllm.padded.max()) <= limit, g=len(sets["vLLM default sizes"]),
              top=max(sets["vLLM default sizes"]), m=int(vllm.padded.max()), limit=limit,
              p=int(vllm.padded.sum()), p2=int(pow2.padded.sum()),
              g2=len(sets["powers of two"]))]


def schedule_claim(engine_batches: list[int], planned_batches: list[int], num_requests: int,
                   where: str, engine_padded: int | None = None,
                   planned_padded: int | None = None):
    """The engine, running the model, served exactly the decode batches the scheduler planned
    without it (and, with graphs, its graph pool padded the rows the plan says): so padding
    counted from the plan is the engine's."""
    padded = ("" if engine_padded is None else
              f"; its graph pool padded {engine_padded:,} rows, the plan {planned_padded:,}")
    return claim("Running the model on {where}, the engine took {n} decode steps for {r} "
                 "requests with exactly the batch sizes the scheduler planned without it{padded}: "
                 "padding counted from the plan is the engine's.",
                 len(engine_batches) > 0 and engine_batches == planned_batches
                 and engine_padded == planned_padded,
                 where=where, n=len(engine_batches), r=num_requests, padded=padded)


def step_time_claims(times: pd.DataFrame, priced: pd.DataFrame | None, where: str,
                     context_len: int, *, recorded=None) -> list:
    """From the decode step times per batch (interleaved rounds): what twice the rows cost
    replayed, how host-bound the eager step is, and what padding costs against the graph."""
    t = times.sort_values("batch").set_index("batch")
    made = []
    big = int(t.index.max())
    half = big // 2
    if half in t.index and "graph_rounds_ms" in t and t.graph_ms.notna().all():
        rows = Spread.of([a / b for a, b in zip(t.graph_rounds_ms[big], t.graph_rounds_ms[half])])
        more = (big - half - 1) / (half + 1)  # rows added padding half + 1 up to big
        made.append(claim(
            "Replayed on {where}, a decode step of {big} rows (context {ctx}) takes {rows:.2fx} "
            "the time of {half} rows ({g2:.2f} against {g1:.2f} ms, medians): so padding a "
            "batch of {over} up to {big} costs at most {extra:.0%} over a {half}-row step in "
            "any round, where its rows grow by {more:.0%}: rows are not time.",
            rows.below(1 + more), where=where, big=big, half=half, ctx=context_len, rows=rows,
            g2=t.graph_ms[big], g1=t.graph_ms[half], over=half + 1, extra=rows.high - 1,
            more=more, recorded=recorded))
    if "eager_gpu_ms" in t and pd.notna(t.eager_gpu_ms[big]):
        low = t.eager_low_ms[big] if "eager_low_ms" in t else t.eager_ms[big]
        launches = ""
        if "eager_kernels" in t and t.eager_kernels[big] > 0:
            launches = (f" It launches {int(t.eager_kernels[big])} kernels: "
                        f"{t.host_us_per_kernel[big]:.1f} us of host time per kernel.")
        made.append(claim(
            "Eager on {where}, the {big}-row decode step takes {wall:.2f} ms of wall time "
            "(median; {low:.2f} in its fastest round) but {gpu:.2f} ms of GPU kernel time "
            "(profiler): it is host-bound, so a gain over eager measures the host work a graph "
            "removes, not GPU work.{launches}", t.eager_gpu_ms[big] < 0.5 * low, where=where,
            big=big, wall=t.eager_ms[big], low=low, gpu=t.eager_gpu_ms[big], launches=launches,
            recorded=recorded))
    if priced is not None and "padding_share" in priced:
        c = priced.set_index("buckets")
        pow2, top = c.loc["powers of two"], c.loc["max only"]
        made.append(claim(
            "Priced with the median step times on {where}, padding to powers of two adds "
            "{share:.1%} to the replayed decode steps' time (its baseline: the same steps "
            "replayed at their exact sizes), one graph for the largest batch adds {top:.1%}; "
            "against eager's host-bound wall time, powers of two eat {eaten:.1%} of the graphs' "
            "gain.", pow2.padding_share < top.padding_share, where=where,
            share=pow2.padding_share, top=top.padding_share, eaten=pow2.gain_eaten,
            recorded=recorded))
    return made
