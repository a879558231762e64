"""What notebook 03 claims, each sentence computed from the data shown and checked against it.

Timings come as interleaved rounds (a median and its range over rounds, see
:mod:`labkit.measure.rounds`); an order between two cases is stated only where every round
agrees, and otherwise the sentence says the rounds cannot tell them apart. Where the GPU's
kernels take far less than a call's wall time, the sentence says the comparison measures host
work. ``recorded``: the recording a claim was checked against, where its data came from one.
"""
from __future__ import annotations

import itertools

import pandas as pd

from labkit.measure.rounds import Spread
from labkit.teaching import claim

HOST_BOUND = 0.5        # GPU kernel time under this share of every round's wall time: host-bound
MIN_CALLS_PER_COMPILE = 100   # a compile costs at least this many steady calls


def _where(recorded) -> str:
    return f" on the {recorded.fingerprint['gpu']}" if recorded is not None else ""


def _ratio(a: list[float], b: list[float]) -> Spread:
    """a / b per round (the rounds of one interleaved run, in order)."""
    return Spread.of([x / y for x, y in zip(a, b)])


def verdict(slow_name: str, ratio: Spread, fast_name: str) -> str:
    """What a per-round ratio (``slow_name`` time / ``fast_name`` time) supports, in words."""
    if ratio.above(1.0):
        return f"{fast_name} is faster than {slow_name} in every round ({slow_name}/{fast_name} {ratio:.2fx})"
    if ratio.below(1.0):
        return f"{fast_name} is slower than {slow_name} in every round ({slow_name}/{fast_name} {ratio:.2fx})"
    return (f"the rounds cannot order {fast_name} and {slow_name}: {slow_name}/{fast_name} "
            f"{ratio:.2fx} straddles 1")


def order(table: pd.DataFrame) -> str:
    """Fastest first; '<' where the two ranges are apart, '≈' where they overlap."""
    rows = list(table.sort_values("wall_us").itertuples())
    parts = [rows[0].mode]
    for a, b in itertools.pairwise(rows):
        parts += ["<" if a.wall_high_us < b.wall_low_us else "≈", b.mode]
    return " ".join(parts)


def _rounds(table: pd.DataFrame, mode: str) -> list[float]:
    return list(table.set_index("mode").loc[mode, "wall_rounds_us"])


def wall_spread(table: pd.DataFrame, mode: str) -> Spread:
    """A mode's wall time per call over the rounds, from its table row."""
    return Spread.of(_rounds(table, mode))


# --------------------------------------------------------------------------- steady state
def steady_claims(table: pd.DataFrame, *, device: str, recorded=None) -> list:
    """The modes' steady state (a :meth:`modes.Steady.table`). With GPU kernel times: what the
    timings measure, whether CUDA Graph replay beat launching, and eager against default. On a
    CPU (no kernel time to set beside them): the order the rounds support."""
    where = _where(recorded) or f" on {device}"
    walls = "; ".join(f"{m} {wall_spread(table, m):.1f} us" for m in table["mode"])
    if table["gpu_kernel_us"].isna().all():
        ok = all(wall_spread(table, m).low > 0 for m in table["mode"]) and len(table) > 1
        return [claim("Steady state{where}, wall time per call: {walls}. Fastest first: {order}. "
                      "On a CPU the loops run on the host, so wall time is all of the work.",
                      ok, where=where, walls=walls, order=order(table), recorded=recorded)]
    t = table.set_index("mode")
    gpu = "; ".join(f"{m} {t.loc[m, 'gpu_kernel_us']:.1f} us" for m in t.index)
    host_bound = {m: t.loc[m, "gpu_kernel_us"] < HOST_BOUND * wall_spread(table, m).low
                  for m in t.index}
    host = [m for m in t.index if host_bound[m]]
    closer = [m for m in t.index if not host_bound[m]]
    if not closer:
        reading = (f"In every mode the kernels take under {HOST_BOUND:.0%} of the wall time: these "
                   "timings measure host work (Python, guard checks, Inductor's wrapper, "
                   "launches), not kernels.")
    else:
        reading = (f"Host work sets the time (kernels under {HOST_BOUND:.0%} of the wall) for "
                   f"{', '.join(host) or 'no mode'}; for {', '.join(closer)} the kernels take a "
                   "larger share, so there the timing is closer to the GPU's own work.")
    # eager and default launch every kernel from Python: at this size the host sets their pace.
    # And no call can take less wall time than its kernels (a larger GPU time is a bug).
    launched = [m for m in ("eager", "default") if m in t.index]
    sane = all(t.loc[m, "gpu_kernel_us"] <= 1.25 * wall_spread(table, m).high for m in t.index)
    made = [claim(
        "Steady state{where}, wall time per call: {walls}. The profiler's GPU kernel time per "
        "call: {gpu}. {reading} Fastest first: {order}.",
        all(host_bound[m] for m in launched) and sane, where=where, walls=walls, gpu=gpu,
        reading=reading, order=order(table), recorded=recorded)]
    if "default" in t.index:
        e, d = _rounds(table, "eager"), _rounds(table, "default")
        made.append(claim(
            "Without CUDA Graphs{where}, {verdict}. Both launch their kernels from Python (GPU "
            "time eager {ge:.1f} us, default {gd:.1f} us), so this compares eager's per-op "
            "dispatch with Inductor's wrapper and guard check, not their kernels.",
            bool(host_bound["eager"] and host_bound["default"]), where=where,
            verdict=verdict("eager", _ratio(e, d), "default"), ge=t.loc["eager", "gpu_kernel_us"],
            gd=t.loc["default", "gpu_kernel_us"], recorded=recorded))
        if pd.notna(t.loc["default", "kernels"]) and pd.notna(t.loc["eager", "kernels"]):
            made.append(claim(
                "One call{where} runs {kd} GPU kernels compiled (default) against {ke} eager: "
                "Inductor fused the pointwise and reduction ops.",
                int(t.loc["default", "kernels"]) < int(t.loc["eager", "kernels"]), where=where,
                kd=int(t.loc["default", "kernels"]), ke=int(t.loc["eager", "kernels"]),
                recorded=recorded))
    if "default" in t.index and "reduce-overhead" in t.index:
        ratio = _ratio(_rounds(table, "default"), _rounds(table, "reduce-overhead"))
        made.append(claim(
            "Replaying CUDA Graphs{where}, reduce-overhead takes {ro} us per call against "
            "default's {d} us, less in every round (default/reduce-overhead {ratio:.2fx}). One "
            "replay launches all the call's kernels, so the launch work per kernel is gone; the "
            "Python around the call remains.", ratio.above(1.0), where=where,
            ro=f"{wall_spread(table, 'reduce-overhead'):.1f}", d=f"{wall_spread(table, 'default'):.1f}",
            ratio=ratio, recorded=recorded))
    return made


# --------------------------------------------------------------------------- starts
def cold_start_claims(starts: dict[str, dict[str, Spread]], *, device: str,
                      recorded=None) -> list:
    """Fresh-process starts (:func:`cold_start.spreads`): the warm cache beats the cold start in
    every round; where both were timed, max-autotune's cold start is the longest."""
    where = _where(recorded) or f" on {device}"
    listed = "; ".join(f"{m} {s['cold']:.2f} s cold and {s['warm cache']:.2f} s with a warm "
                       "cache" for m, s in starts.items())
    made = [claim(
        "In a fresh process{where}, the block's first call (compile + run) took {listed}. The "
        "cache the cold start left makes every mode's start shorter, in every round.",
        all(s["warm cache"].high < s["cold"].low for s in starts.values()), where=where,
        listed=listed, recorded=recorded)]
    if "max-autotune" in starts and "default" in starts:
        ma, d = starts["max-autotune"]["cold"], starts["default"]["cold"]
        made.append(claim(
            "Cold{where}, max-autotune's first call took {ma:.2f} s against default's {d:.2f} s: "
            "it benchmarks matmul and kernel configurations before it picks one.",
            ma.low > d.high, where=where, ma=ma, d=d, recorded=recorded))
    return made


def repay_claims(table: pd.DataFrame, starts: dict[str, dict[str, Spread]], *, device: str,
                 recorded=None) -> tuple[list, list[str]]:
    """How many calls repay a mode's cold start, only where the mode saves time against eager in
    every round; the other modes get a note that says why no count is given."""
    where = _where(recorded) or f" on {device}"
    made, notes = [], []
    eager = _rounds(table, "eager")
    for mode, s in starts.items():
        if mode not in set(table["mode"]):
            continue
        saved = Spread.of([e - m for e, m in zip(eager, _rounds(table, mode))])
        if not saved.above(0.0):
            notes.append(f"{mode}: no repay count; it saves {saved:.1f} us per call against "
                         "eager, a range that reaches zero or below")
            continue
        cold = s["cold"]
        calls = (cold.median * 1e6 / saved.median, cold.low * 1e6 / saved.high,
                 cold.high * 1e6 / saved.low)
        made.append(claim(
            "{mode}{where} saves {saved} us per call against eager in every round, so its cold "
            "start of {cold:.2f} s is repaid after about {n:,.0f} calls ({lo:,.0f}-{hi:,.0f} "
            "over the ranges).", saved.above(0.0) and calls[1] <= calls[0] <= calls[2],
            mode=mode, where=where, saved=f"{saved:.1f}", cold=cold, n=calls[0], lo=calls[1],
            hi=calls[2], recorded=recorded))
    return made, notes


def compile_cost_claim(first_call_s: Spread, call: Spread, *, device: str, recorded=None):
    """The first call costs as much as many steady calls (both ranges, the worst case)."""
    where = _where(recorded) or f" on {device}"
    fewest = first_call_s.low * 1e6 / call.high
    return claim("The cold first call{where} ({first:.2f} s) costs as much as at least {n:,.0f} "
                 "steady-state calls ({call:.1f} us each); target: more than {target:,}.",
                 fewest > MIN_CALLS_PER_COMPILE, where=where, first=first_call_s, n=fewest,
                 call=call, target=MIN_CALLS_PER_COMPILE, recorded=recorded)


# --------------------------------------------------------------------------- guards, dynamic
def guard_claims(table: pd.DataFrame, entries: int, *, device: str) -> list:
    """Guard cost (a :func:`modes.guard_rounds` table turned into wall columns): entering a
    compiled function costs more than the eager call in every round; many cached graphs are
    stated against one only as far as the rounds resolve them, and never as cheaper."""
    one, many = "compiled, 1 graph cached", f"compiled, {entries} graphs cached"
    e, o, m = (_rounds(table, k) for k in ("eager", one, many))
    entry = _ratio(o, e)
    extra = Spread.of([b - a for a, b in zip(e, o)])
    many_vs_one = _ratio(m, o)
    return [
        claim("On {device}, a compiled tiny add costs {o} us per call against {e} us eager, "
              "{extra} us more in every round: what entering the compiled function costs as a "
              "whole (Dynamo's frame hook, the guard check, the FX graph's Python call), not the "
              "guard check alone.",
              entry.above(1.0), device=device, o=f"{wall_spread(table, one):.2f}",
              e=f"{wall_spread(table, 'eager'):.2f}", extra=f"{extra:.2f}"),
        claim("With {n} graphs cached, the first-compiled shape costs {r:.2fx} of the one-graph "
              "call: {reading}. Dynamo moves the entry that matched to the front of its list, so "
              "a repeated shape checks its own guards first.",
              not many_vs_one.below(0.9), n=entries, r=many_vs_one,
              reading=("more in every round" if many_vs_one.above(1.01) else
                       "within 1% of it, or below, in some round, so these rounds resolve no cost"
                       if not many_vs_one.below(1.0) else "less in every round, which no "
                       "mechanism explains")),
    ]


def dynamic_claims(table: pd.DataFrame, *, device: str, recorded=None) -> list:
    """``dynamic=True`` against static under Inductor, same input: what the rounds support, and
    never that symbolic sizes are faster by more than the noise floor."""
    where = _where(recorded) or f" on {device}"
    ratio = _ratio(_rounds(table, "dynamic=True"), _rounds(table, "static"))
    t = table.set_index("mode")
    gpu = ("" if t["gpu_kernel_us"].isna().all() else
           f" (GPU kernel time {t.loc['static', 'gpu_kernel_us']:.1f} and "
           f"{t.loc['dynamic=True', 'gpu_kernel_us']:.1f} us: the wall times are host work)")
    return [claim(
        "Compiled with symbolic sizes (dynamic=True){where}, the block takes {dyn} us per call "
        "against {st} us compiled for its shape{gpu}: {reading}.", not ratio.below(0.9),
        where=where, dyn=f"{wall_spread(table, 'dynamic=True'):.1f}",
        st=f"{wall_spread(table, 'static'):.1f}", gpu=gpu,
        reading=verdict("dynamic=True", ratio, "static"), recorded=recorded)]


# --------------------------------------------------------------------------- bookkeeping
def pipeline_claims(inductor, eager_ops: list[str], tol: float) -> list:
    """Fusion (fewer launches than eager's aten ops) and numerics (compiled == eager)."""
    launches = len(inductor.kernels) + len(inductor.extern_calls)
    return [
        claim("Compiled, one call runs {k} generated {lang} kernels and {x} library calls "
              "({launches} launches) where eager runs {n} aten ops, one kernel each.",
              launches < len(eager_ops), k=len(inductor.kernels), lang=inductor.language,
              x=len(inductor.extern_calls), launches=launches, n=len(eager_ops)),
        claim("The compiled block matches eager within {err:.1e} (tolerance {tol:.0e}).",
              inductor.max_abs_err < tol, err=inductor.max_abs_err, tol=tol),
    ]


def break_claims(breaks: pd.DataFrame) -> list:
    """Every broken example breaks, every fix compiles to one graph (``break_table``)."""
    broken, fixed = breaks[breaks.version == "broken"], breaks[breaks.version == "fixed"]
    return [claim("All {n} broken examples break ({b} breaks in all, one reason each in the "
                  "table); all {n} fixes compile to a single graph with {f} breaks.",
                  bool((broken.breaks >= 1).all() and (fixed.breaks == 0).all()
                       and (fixed.graphs == 1).all()),
                  n=len(broken), b=int(broken.breaks.sum()), f=int(fixed.breaks.sum()))]


def recompile_claims(reports: dict, distinct: int, limit: int) -> list:
    """What the shape strategies compiled over the batch trace (``compare_strategies``)."""
    static, dynamic, buckets = reports["static"], reports["dynamic"], reports["buckets"]
    used = len(set(buckets.calls.ran_as))
    return [
        claim("dynamic=False compiled {c} graphs for {d} distinct batch sizes (recompile limit "
              "{lim}) and ran {f} calls eagerly after the limit.",
              static.compiles == min(distinct, limit)
              and static.eager_fallbacks == max(0, distinct - limit),
              c=static.compiles, d=distinct, lim=limit, f=static.eager_fallbacks),
        claim("dynamic=True compiled {dc} graphs (batch 1 is specialised), buckets {bc} for the "
              "{u} buckets the trace used; every strategy matched eager within {err:.1e}.",
              dynamic.compiles <= 2 < static.compiles and buckets.compiles == used,
              dc=dynamic.compiles, bc=buckets.compiles, u=used,
              err=max(r.max_abs_err for r in reports.values())),
    ]


def reduce_overhead_claims(overwritten: dict, mutated: dict, *, recorded=None) -> list:
    """reduce-overhead's two surprises (``output_overwritten``, ``mutated_input_skips_graphs``)."""
    where = _where(recorded)
    kept = (f"was refused ({overwritten['kept_reference_error'][:80]})"
            if overwritten.get("kept_reference_error") else f"read {overwritten['kept_value']}")
    return [
        claim("Under reduce-overhead{where}, an output kept across calls {kept} after the next "
              "call instead of {expected}; its clone kept {clone}.",
              bool(overwritten["overwritten"] and overwritten["clone_is_right"]), where=where,
              kept=kept, expected=overwritten["expected"], clone=overwritten["clone_value"],
              recorded=recorded),
        claim("The function that mutates its input{where} logged {n} CUDA Graph skip(s) "
              "({why}); the functional rewrite logged {m}.",
              bool(mutated["mutating_skipped"] and not mutated["functional_skipped"]),
              where=where, n=mutated["mutating"]["cudagraph_skips"],
              why="; ".join(mutated["mutating"]["skip_reasons"]) or "no reason logged",
              m=mutated["functional"]["cudagraph_skips"], recorded=recorded),
    ]


# --------------------------------------------------------------------------- the recording
RECORDED_FIELDS = ("steady", "dynamic", "cold_starts")


def recorded_claims(rec) -> list:
    """Every timing claim of sections 4-5 the recording ``rec`` has the data for, checked against it; the fields it
    lacks are named (they appear once ``make record`` has run the current recorder)."""
    from labkit.lessons.torch_compile import cold_start

    data, gpu = rec.data, rec.fingerprint["gpu"]
    missing = [k for k in RECORDED_FIELDS if k not in data]
    if missing:
        print(f"The recording lacks {missing}: the claims that need them are not made here; "
              "`make record` on a GPU host (torch_compile/recompiles) records them.")
    made = []
    if "steady" in data:
        made += steady_claims(pd.DataFrame(data["steady"]), device=gpu, recorded=rec)
    if "dynamic" in data:
        made += dynamic_claims(pd.DataFrame(data["dynamic"]), device=gpu, recorded=rec)
    if "cold_starts" in data:
        starts = cold_start.spreads(pd.DataFrame(data["cold_starts"]))
        made += cold_start_claims(starts, device=gpu, recorded=rec)
        if "steady" in data:
            repaid, notes = repay_claims(pd.DataFrame(data["steady"]), starts, device=gpu,
                                         recorded=rec)
            made += repaid
            print("\n".join(notes))
    return made
