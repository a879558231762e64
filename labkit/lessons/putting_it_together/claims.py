"""What notebook 08 claims: each sentence computed from the experiment, the timeline and the
padding count it sits beside, and checked against them (notebook 08a's padding claims are
:mod:`~labkit.lessons.putting_it_together.padding_claims`).

Conclusions are drawn only from rows that ran and passed the first-token check
(:attr:`~labkit.lessons.putting_it_together.experiment.Experiment.conclusive`); a comparison
between rows is taken round by round (the rows ran in a shuffled order each round) and holds
only when every round clears it. A claim that needs a figure a recording lacks is not made:
:func:`missing` says which field, so the cell can print it.
"""
from __future__ import annotations

import pandas as pd

from labkit.measure.rounds import Spread
from labkit.teaching import claim


def missing(data: dict, *fields: str) -> list[str]:
    """The dotted ``fields`` ("step_times.graph_rounds_ms") a recording's data lacks or leaves
    empty."""
    out = []
    for f in fields:
        node = data
        for key in f.split("."):
            node = node.get(key) if isinstance(node, dict) else None
        if node is None or (isinstance(node, list) and all(v is None for v in node)):
            out.append(f)
    return out


def _row(table: pd.DataFrame, backend: str, mode: str):
    hit = table[(table.backend == backend) & (table["mode"] == mode)]
    return hit.iloc[0] if len(hit) else None


def _spread(row, col: str, lo: str, hi: str, digits: int = 2) -> str:
    """'median (low-high, N rounds)', or the one value a recording without ranges holds."""
    if pd.isna(row.get(lo)):
        return f"{row[col]:.{digits}f} (one round recorded)"
    return (f"{row[col]:.{digits}f} ({row[lo]:.{digits}f}-{row[hi]:.{digits}f}, "
            f"{int(row['rounds'])} rounds)")


def rows_claim(exp, where: str, *, recorded=None):
    """Every row either ran in at least three shuffled rounds or says why it did not."""
    t = exp.table
    ran, other = t[t.status == "ran"], t[t.status != "ran"]
    rounds = pd.to_numeric(ran["rounds"], errors="coerce").astype(float)  # <NA>: not >= 3
    statuses = ", ".join(f"{n} {s}" for s, n in other.status.value_counts().items()) or "none"
    return claim("On {where}, {ran} of {n} rows (backend x mode) ran, each in {rounds} rounds "
                 "of a freshly shuffled order; the other {k} say why ({statuses}).",
                 len(ran) > 0 and bool((rounds >= 3).all())
                 and bool((other.reason.str.len() > 0).all()),
                 where=where, ran=len(ran), n=len(t), k=len(other), statuses=statuses,
                 rounds=(f"{int(rounds.min())}" if rounds.min() == rounds.max()
                         else f"{int(rounds.min())}-{int(rounds.max())}"), recorded=recorded)


def first_token_claim(exp, where: str, *, recorded=None):
    """Rows whose first tokens are the float32 forward's (or bf16 near-ties of it) pass; the
    backend ``auto`` chose and the reference must. Rows that do not pass are named and left
    out of every later conclusion."""
    t = exp.table
    ran = t[t.status == "ran"]
    failed = ran[~ran.passed.eq(True)]
    must = ran[ran.backend.isin(["auto", "reference"])]
    n = exp.workload.get("num_requests", 0)
    ties = int(pd.to_numeric(ran.first_token_ties, errors="coerce").fillna(0).max())
    excluded = ("; did not pass, left out of every conclusion below: "
                + ", ".join(failed.backend + "/" + failed["mode"])) if len(failed) else ""
    band = ("the model runs in float32: no rounding band, every one an exact match"
            if exp.first_token_tie_max == 0 else
            f"up to {ties} per row were near-ties: float32 logits within "
            f"{exp.first_token_tie_max:.3f} of the top one, the band the model's own dtype "
            f"rounds across")
    return claim("On {where}, {passed} of {ran} rows gave, for all {n} requests, the first token "
                 "of the model's float32 forward or a near-tie of it ({band}){excluded}.",
                 len(must) > 0 and bool(must.passed.eq(True).all()),
                 where=where, passed=len(ran) - len(failed), ran=len(ran), n=n, band=band,
                 excluded=excluded, recorded=recorded)


def graph_claims(exp, where: str, backend: str = "triton", *, recorded=None) -> list:
    """The graph row against the eager row of ``backend``, round by round: replay shortens the
    decode step in every round; and only the decode-only steps replay a graph."""
    good = exp.conclusive
    graph, eager = _row(good, backend, "graph"), _row(good, backend, "eager")
    if graph is None or eager is None:
        return []
    made = [claim(
        "On {where}, building {backend}'s graph engine captured {graphs} graphs in {capture} ms; "
        "{graph_steps} of its {steps} steps replayed one (the decode-only steps), the others "
        "ran eagerly.", 0 < graph.graph_steps < graph.steps, where=where, backend=backend,
        graphs=int(graph.graphs), capture=_spread(graph, "capture_ms", "capture_low_ms",
                                                  "capture_high_ms", 1),
        graph_steps=int(graph.graph_steps), steps=int(graph.steps), recorded=recorded)]
    r = exp.rounds
    if r.empty:
        return made
    per = r[r.backend == backend].pivot_table(index="round", columns="mode",
                                              values="decode_step_ms")
    if {"eager", "graph"} <= set(per.columns):
        per = per.dropna()
        gain = Spread.of(per.eager / per.graph)
        made.append(claim(
            "On {where}, {backend}'s decode step took {graph} ms replayed from graphs against "
            "{eager} ms eager: {gain:.2fx} per round. Both are wall time between the ends of "
            "consecutive steps; the eager one is host-bound (its kernels' GPU time is shown "
            "with the step times below).", gain.above(1.0), where=where, backend=backend,
            graph=_spread(graph, "decode_step_ms", "decode_step_low_ms", "decode_step_high_ms"),
            eager=_spread(eager, "decode_step_ms", "decode_step_low_ms", "decode_step_high_ms"),
            gain=gain, recorded=recorded))
    return made


def timeline_claim(numbers: dict, where: str, *, expected_steps: int | None = None,
                   recorded=None):
    """What the engine's traced steps show: on a GPU the metadata copies on their own stream
    and the graph replays; on a CPU one annotation per ``step()`` and the host's share inside
    the model's ops."""
    if "kernels" in numbers:
        overlap = numbers.get("h2d_overlapping_compute", 0)
        return claim(
            "On {where}, {copies} metadata copies ran on a stream of their own, {overlap} of them "
            "while a kernel of the compute lane ran, and {launches} decode steps were one "
            "cudaGraphLaunch each; the GPU was busy {busy:.0%} of the traced span.",
            numbers["graph_launches"] > 0 and numbers["h2d_on_copy_stream"] > 0
            and (recorded is None or overlap > 0),
            where=where, copies=numbers["h2d_on_copy_stream"], overlap=overlap,
            launches=numbers["graph_launches"], busy=numbers["gpu_busy_fraction"],
            recorded=recorded)
    busy = numbers.get("cpu_busy_fraction") or 0.0
    return claim(
        "On {where}, the traced run made {steps} step() calls, one annotation each ({expected} "
        "expected from the engine's history); {busy:.0%} of the host's time was inside the "
        "model's ops, the rest Python: scheduling, metadata, sampling.",
        numbers.get("steps") == expected_steps and 0 < busy < 1, where=where,
        steps=numbers.get("steps"), expected=expected_steps, busy=busy, recorded=recorded)


def simulation_claim(exp, simulated_steps: int):
    """The scheduler alone plans exactly the steps every row of the engine ran."""
    ran = exp.table[exp.table.status == "ran"]
    steps = sorted({int(s) for s in ran.steps})
    return claim("Every row that ran took {steps} engine steps; the scheduler alone, with no "
                 "model, plans {simulated} for this workload: batches depend only on lengths.",
                 len(ran) > 0 and steps == [simulated_steps],
                 steps=" or ".join(map(str, steps)),
                 simulated=simulated_steps)


def padding_claim(costs: pd.DataFrame, scheduler_padded: int, num_requests: int):
    """Padded rows per bucket set, counted from the decode batches and by the scheduler."""
    c = costs.set_index("buckets")
    exact, pow2, top = c.loc["one per size"], c.loc["powers of two"], c.loc["max only"]
    return claim("For {n} simulated requests ({steps} decode steps), powers of two ({g} graphs) "
                 "pad {p:,} rows, as the scheduler counts them ({sched:,}); one graph for the "
                 "largest batch pads {m:,}; one graph per size ({ge}) pads {e}.",
                 exact.padded_rows == 0 < pow2.padded_rows <= top.padded_rows
                 and pow2.padded_rows == scheduler_padded,
                 n=num_requests, steps=int(pow2.decode_steps), g=int(pow2.graphs),
                 p=int(pow2.padded_rows), sched=int(scheduler_padded), m=int(top.padded_rows),
                 ge=int(exact.graphs), e=int(exact.padded_rows))
