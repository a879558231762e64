"""Notebook 08's exercises: reading the engine's timeline, and pricing its padding.

08.1: ``copy_overlap(events)``: for every host-to-device copy on a lane other than the compute
stream, how many microseconds a compute kernel ran beside it, from a profiler event table
(``labkit.measure.profile``'s columns). Checked against ``engine_steps.step_overlap`` (and a per-copy
reference beside it) on hand-made tables with the awkward cases and on traces recorded on an
H200: notebook 08's engine steps, notebook 04's copies with and without a copy stream.

08.2: ``padded_rows(decode_batches, buckets)``: the rows a set of graph buckets pads over a
trace of decode batch sizes, and the steps that run eagerly because no bucket holds them.
Checked against the scheduler's own count (``StepStats.padded_rows``) on simulated workloads
and against ``bucket_planner.padding_waste`` on awkward bucket sets.
"""
from __future__ import annotations

import numbers
import random
from functools import lru_cache

import pandas as pd
import torch

from labkit.tools import recorded
from labkit.graphs.bucket_planner import padding_waste
from labkit.engine import LLM
from labkit.lessons.putting_it_together.engine_steps import decode_batches, simulate_schedule, step_overlap
from labkit.teaching.exercises import Case, Exercise
from labkit.lessons.putting_it_together.experiment import timed_generate
from labkit.lessons.putting_it_together.workload import Workload, engine_options
from labkit.measure import intervals
from labkit.measure.events import EVENT_COLUMNS
from labkit.measure.profile import Trace

H2D, D2H, D2D = ("Memcpy HtoD (Pinned -> Device)", "Memcpy DtoH (Device -> Pinned)",
                 "Memcpy DtoD (Device -> Device)")


# --- predict, then measure: continuous batching -----------------------------------------------
def output_tok_s(model, workload: Workload, max_num_seqs: int, runs: int = 3) -> float:
    """Output tokens per second of ``workload`` through an engine that runs at most
    ``max_num_seqs`` requests at once: the fastest of ``runs`` (the first pays first-call costs).

    On a CPU with one intra-op thread: with two, every batched op waits for both cores, so a
    browser drawing figures on one of them stalls every batched step."""
    llm = LLM(model, **{**engine_options(workload), "max_num_seqs": max_num_seqs})
    prompts, params = workload.requests(model.config.vocab_size)
    threads = torch.get_num_threads()
    if llm.device.type == "cpu":
        torch.set_num_threads(1)
    try:
        best = min((timed_generate(llm, prompts, params) for _ in range(runs)),
                   key=lambda run: run.seconds)
    finally:
        torch.set_num_threads(threads)
    return sum(len(o.token_ids) for o in best.outputs) / best.seconds


# --- 08.1 which metadata copies ran under compute ---------------------------------------------
def compute_lane(events: pd.DataFrame) -> str | None:
    """The GPU lane with the most kernel time (None without kernels)."""
    kernels = events[events.kind == "kernel"]
    return None if kernels.empty else kernels.groupby("lane").dur_us.sum().idxmax()


def copy_overlap_ref(events: pd.DataFrame) -> dict[int, float]:
    """{index label of each HtoD copy off the compute lane: microseconds under its kernels}."""
    lane = compute_lane(events)
    if lane is None:
        return {}
    k = events[(events.kind == "kernel") & (events.lane == lane)]
    busy = intervals.union(k.start_us, k.start_us + k.dur_us)
    copies = events[(events.kind == "memcpy") & events.name.str.contains("HtoD")
                    & (events.lane != lane)]
    return {int(i): intervals.overlap([(s, s + d)], busy)
            for i, s, d in zip(copies.index, copies.start_us, copies.dur_us)}


def _table(rows, rng: random.Random) -> pd.DataFrame:
    """Hand-made events (lane, kind, name, start_us, dur_us), rows shuffled: labels are ids."""
    df = pd.DataFrame([(lane, kind, name, float(s), float(d), 0, -1)
                       for lane, kind, name, s, d in rows], columns=EVENT_COLUMNS)
    order = list(df.index)
    rng.shuffle(order)
    return df.loc[order]


def _hand_made(rng: random.Random) -> list[tuple[str, pd.DataFrame]]:
    a, b, c = rng.sample(range(7, 200), 3)
    gpu, side, third, cpu = (f"GPU 0 stream {a}", f"GPU 0 stream {b}", f"GPU 0 stream {c}",
                             f"CPU thread {rng.randrange(100, 900)}")

    def kernels(lane, start, n, dur, gap):
        return [(lane, "kernel", f"kernel_{lane[-3:].strip()}_{i}", start + i * (dur + gap), dur)
                for i in range(n)]

    d = rng.randrange(20, 60)      # a kernel's length
    steps = (kernels(gpu, 10, 6, d, 2) + kernels(gpu, 10 + 6 * (d + 2) + 40, 6, d, 2)
             + [(side, "memcpy", H2D, 0, 8),                       # step 0's: nothing to hide under
                (side, "memcpy", H2D, 10 + 3 * (d + 2) + 1, 9),   # step 1's, under step 0
                (cpu, "runtime", "cudaMemcpyAsync", 0, 4),
                (cpu, "runtime", "cudaLaunchKernel", 5, 3)])
    on_compute = (kernels(gpu, 0, 4, d, 0)
                  + [(gpu, "memcpy", H2D, 4 * d, 6), (side, "memcpy", H2D, d // 2, 7)])
    gap = rng.randrange(10, 30)
    spanning = (kernels(gpu, 0, 2, d, gap)
                + [(side, "memcpy", H2D, d - 5, gap + 10),             # kernel, gap, kernel
                   (side, "memcpy", "Memcpy HtoD (Pageable -> Device)", 2 * d + gap + 3, 4)])
    touching = (kernels(gpu, 20, 3, d, 10)
                + [(side, "memcpy", H2D, 12, 8),                      # ends where a kernel starts
                   (side, "memcpy", H2D, 20 + d, 10),                  # the gap between two kernels
                   (side, "memcpy", H2D, 20 + 3 * d + 20, 5)])         # starts where the last ends
    late = 30 * d + 20  # the many short kernels run after the compute lane's long ones
    busy_side = (kernels(gpu, 0, 3, 10 * d, 1) + kernels(side, late, 12, d // 4 + 1, 1)
                 + [(third, "memcpy", H2D, 2, 5),                    # under a compute kernel
                    (side, "memcpy", H2D, 5 * d, 6),                  # on the many-kernel lane
                    (third, "memcpy", H2D, late + 3, 5),              # under short kernels only
                    (third, "memcpy", H2D, late + 20 * d, 5)])        # after everything
    not_uploads = (kernels(gpu, 0, 4, d, 3)
                   + [(side, "memcpy", D2H, 5, 10), (side, "memcpy", D2D, d, 10),
                      (side, "memset", "Memset (Device)", 2 * d, 4),
                      (side, "memcpy", H2D, 3 * d, 8)])
    cpu_only = [(cpu, "cpu_op", "aten::linear", 0, 50), (cpu, "cpu_op", "aten::copy_", 60, 5)]
    return [
        ("hand-made: two engine steps, step 1's metadata copied under step 0's kernels", steps),
        ("hand-made: a copy on the compute stream itself (it runs between kernels, never under)",
         on_compute),
        ("hand-made: a copy spanning two kernels and the idle gap between them", spanning),
        ("hand-made: copies that touch a kernel's start or end, or sit in a gap", touching),
        ("hand-made: a lane with more kernels, the compute lane with more kernel time",
         busy_side),
        ("hand-made: device-to-host, device-to-device copies and a memset (not uploads)",
         not_uploads),
        ("a trace of a CPU run: no kernels, nothing to overlap", cpu_only),
        ("an empty event table", []),
    ]


@lru_cache(maxsize=1)
def _recorded_traces() -> tuple[tuple[str, pd.DataFrame], ...]:
    found = []
    for (stem, part), key, what in (
            (("putting_it_together", "experiment"), "trace", "notebook 08's engine steps"),
            (("pinned_memory_streams", None), "trace_overlap", "notebook 04's copies on a copy stream"),
            (("pinned_memory_streams", None), "trace_serial", "notebook 04's copies on the compute "
                                                            "stream")):
        try:
            rec = recorded.load(stem, part)
        except recorded.RecordingMissing:
            continue  # a lab without `make record` data still has the hand-made tables
        if key in rec.data:
            gpu = rec.fingerprint.get("gpu", "a GPU")
            found.append((f"recorded on {gpu}: {what}", Trace.from_dict(rec.data[key]).events))
    return tuple(found)


def _overlap_cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    cases = [Case(label, (_table(rows, rng),)) for label, rows in _hand_made(rng)]
    return cases + [Case(label, (events,)) for label, events in _recorded_traces()]


def _overlap_run(fn, case: Case) -> dict:
    got = fn(case.args[0].copy())
    if isinstance(got, pd.Series):
        got = got.to_dict()
    if not isinstance(got, dict):
        raise TypeError(f"copy_overlap should return a dict {{copy's index label: microseconds}}, "
                        f"got {type(got).__name__}")
    bad = [k for k in got if isinstance(k, bool) or not isinstance(k, numbers.Integral)]
    if bad:
        raise TypeError(f"key each copy by its index label in events (an int), got {bad[0]!r}")
    per_copy = sorted((int(k), float(v)) for k, v in got.items())
    return {"overlap per copy": per_copy,
            "side-stream uploads": len(per_copy),
            "uploads overlapping compute": sum(v > 0 for _, v in per_copy),
            "overlapped us": float(sum(v for _, v in per_copy))}


def _overlap_expected(case: Case) -> dict:
    events = case.args[0]
    agg = step_overlap(events)
    return {"overlap per copy": sorted(copy_overlap_ref(events).items()),
            "side-stream uploads": agg.get("h2d_on_copy_stream", 0),
            "uploads overlapping compute": agg.get("h2d_overlapping_compute", 0),
            "overlapped us": float(agg.get("h2d_overlapped_us", 0.0))}


def _describe(events: pd.DataFrame, i: int) -> str:
    e = events.loc[i]
    return (f"event {i} ({e['name']} on '{e.lane}', {e.start_us:g} to "
            f"{e.start_us + e.dur_us:g} us)")


def _overlap_diagnose(case: Case, got: dict, expected: dict) -> str | None:
    events = case.args[0]
    mine, want = dict(got["overlap per copy"]), dict(expected["overlap per copy"])
    lane = compute_lane(events)
    kernels = events[events.kind == "kernel"]
    by_count = kernels.lane.value_counts().idxmax() if len(kernels) else None
    extra = [i for i in mine if i not in want]
    missing = [i for i in want if i not in mine]
    if by_count != lane and any(events.loc[i].lane in (lane, by_count) for i in extra + missing
                                if i in events.index):
        return (f"The compute lane is '{lane}', the GPU lane with the most kernel *time*; "
                f"'{by_count}' has more kernels, but short ones. Count time, not kernels.")
    if extra:
        i = extra[0]
        if i not in events.index:
            return f"{i} is not an index label of events: key each copy by its label."
        e = events.loc[i]
        if e.kind != "memcpy":
            return (f"Your key {i} is {_describe(events, i)}, a {e.kind}: key each copy by its "
                    "own index label in events (`copies.index`), not by its position among "
                    "the copies.")
        if e.lane == lane and "HtoD" in e["name"]:
            return (f"{_describe(events, i)} runs on the compute lane itself: a copy there waits "
                    "for the kernels before it, so it never overlaps them. Leave it out.")
        return (f"{_describe(events, i)} is not a host-to-device copy: only uploads (the next "
                "step's metadata) are asked for.")
    if missing:
        return (f"{_describe(events, missing[0])} is missing: give every host-to-device copy off "
                f"the compute lane ('{lane}') an entry, 0.0 when it overlaps nothing.")
    wrong = next((i for i in want if abs(mine[i] - want[i]) > 1e-3), None)
    if wrong is None:
        return None
    e, g, w = events.loc[wrong], mine[wrong], want[wrong]
    under = kernels[(kernels.start_us < e.start_us + e.dur_us)
                    & (kernels.start_us + kernels.dur_us > e.start_us)]
    on_lane = under[under.lane == lane]
    where = (f" It runs beside {len(on_lane)} compute kernel(s), from "
             f"{on_lane.start_us.min():g} to {(on_lane.start_us + on_lane.dur_us).max():g} us."
             if len(on_lane) else " No compute kernel runs while it does.")
    msg = f"{_describe(events, wrong)}: you said {g:g} us under compute, it is {w:g} us.{where}"
    if g < 0:
        return msg + " An overlap is never negative: max(0, min(ends) - max(starts))."
    if len(under) > len(on_lane) and g > w:  # kernels of other lanes counted
        return msg + (f" Kernels on other lanes ran beside it too; only the compute lane "
                      f"('{lane}') is the step's compute.")
    if abs(g - e.dur_us) < 1e-6 and w < e.dur_us:
        return msg + (" You counted the whole copy: only the part during which a compute kernel "
                      "runs counts (idle gaps between kernels hide nothing).")
    return msg


# --- 08.2 padded rows of a bucket set -------------------------------------------------------
def _padding_cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    w = Workload(rng.randrange(24, 48), (4, 40), (3, rng.randrange(20, 60)), seed=seed)
    top = w.num_requests

    def simulated(label, buckets):
        history = simulate_schedule(w, buckets)
        batches = decode_batches(history)
        return Case(label + f" ({len(batches)} decode steps, buckets {list(buckets)})",
                    (batches, buckets), {"padded": int(history.padded_rows.sum())})

    def made(label, batches, buckets):
        return Case(label + f" (buckets {list(buckets)})", (batches, buckets),
                    {"padded": padding_waste(batches, buckets).padded_rows})

    trace = [rng.randrange(1, 17) for _ in range(rng.randrange(20, 40))]
    p2 = (1, 2, 4, 8, 16, 32, 64)
    return [
        simulated(f"the scheduler's decode batches for {top} requests, powers of two",
                  tuple(b for b in p2 if b < 2 * top)),
        simulated("the same workload, buckets 1, 8 and the largest batch", (1, 8, top)),
        simulated("the same workload, buckets that stop short of its largest batches",
                  (1, 2, 4, 8, top // 2)),
        made("a random trace, buckets given unsorted and with a repeat", trace,
             (16, 4, 1, 8, 4, 2)),
        made("batches larger than every bucket run eagerly", [1, 3, 5, 9, 12, 2, 4, 17], (2, 4)),
        made("every batch exactly on a bucket", [1, 4, 8, 4, 1, 8], (1, 4, 8)),
        made("one bucket only", trace, (16,)),
        made("an empty trace", [], (1, 2, 4)),
    ]


def _padding_run(fn, case: Case) -> dict:
    batches, buckets = case.args
    out = fn(list(batches), tuple(buckets))
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError(f"padded_rows should return (padded_rows, eager_steps), got {out!r}")
    return {"padded rows": out[0], "eager steps": out[1]}


def _padding_expected(case: Case) -> dict:
    batches, buckets = case.args
    return {"padded rows": case.kwargs["padded"],
            "eager steps": padding_waste(batches, buckets).eager_calls}


def _padding_diagnose(case: Case, got: dict, expected: dict) -> str | None:
    batches, buckets = case.args
    mine = (got.get("padded rows"), got.get("eager steps"))
    want = (expected["padded rows"], expected["eager steps"])
    ordered = sorted(set(buckets))
    top = ordered[-1]

    def count(order, fits=lambda b, x: b >= x, beyond=lambda x: 0):  # what a slip gives
        picks = [next((b for b in order if fits(b, x)), None) for x in batches]
        return (sum(beyond(x) if b is None else b - x for b, x in zip(picks, batches)),
                picks.count(None))

    slips = [
        (count(buckets), f"The buckets came as {list(buckets)}: the first one that holds a batch "
                         "in that order is not the smallest. Sort them (and drop repeats) first."),
        (count(ordered, lambda b, x: b > x), "A batch exactly the size of a bucket fits it with "
                                             "no padding: pick the smallest bucket >= the batch."),
        (count([top]), "Every batch padded to the largest bucket: each batch uses the smallest "
                       "bucket that holds it, which is why more buckets waste fewer rows."),
        (count(ordered, beyond=lambda x: top - x), f"Batches above the largest bucket ({top}) run "
                                                   "eagerly: they pad nothing (you subtracted "
                                                   "rows for them)."),
    ]
    for answer, message in slips:
        if mine == answer != want:
            return message
    too_big = [x for x in batches if x > top]
    if too_big and mine[1] != want[1]:
        return (f"{len(too_big)} batch(es) ({too_big[:5]}...) are larger than the largest bucket "
                f"({top}): no graph holds them, they run eagerly. Count them as eager steps.")
    return None


EXERCISES = [
    Exercise(
        id="08.1", title="which metadata copies ran under compute", entry="copy_overlap",
        task="return {index label: microseconds under compute kernels} for every host-to-device "
             "copy off the compute lane",
        cases=_overlap_cases, run=_overlap_run, expected=_overlap_expected,
        diagnose=_overlap_diagnose, atol=1e-3, rtol=1e-6,
        note=lambda device: (f"Checked on hand-made event tables and {len(_recorded_traces())} "
                             "traces recorded on a GPU, per copy and in total against "
                             "engine_steps.step_overlap."),
        hints=(
            "The compute lane is the GPU lane with the most kernel time: "
            "`kernels.groupby('lane').dur_us.sum().idxmax()`. No kernels at all: nothing "
            "overlaps, return `{}`.",
            "The copies asked for: `kind == 'memcpy'`, `'HtoD'` in the name, and a lane other than "
            "the compute lane. A copy on the compute lane waits for the kernels before it.",
            "A copy [s, s+d) and a kernel [ks, ke) overlap for `max(0, min(s+d, ke) - max(s, ks))` "
            "microseconds; sum that over the compute lane's kernels (they do not overlap each "
            "other on one stream).",
        ),
        seen="In the engine's recorded H200 trace some metadata uploads ran under kernels of the "
             "compute lane (your function counts them in the recording: compare its totals with "
             "`timeline_numbers`): with async scheduling they cost the step nothing. The others "
             "found the GPU idle, with nothing to hide under. "
             "Notebook 04's copies on a copy stream overlap compute for nearly their whole length "
             "(all but the first, which has no kernel before it); the same copies on the compute "
             "stream are not side-stream copies at all: they wait their turn. This is "
             "`step_overlap` in `labkit/lessons/putting_it_together/engine_steps.py`, the count notebook 08 reports.",
    ),
    Exercise(
        id="08.2", title="padded rows of a bucket set", entry="padded_rows",
        task="return (padded_rows, eager_steps) for the decode batches served by these graph "
             "buckets",
        cases=_padding_cases, run=_padding_run, expected=_padding_expected,
        diagnose=_padding_diagnose,
        hints=(
            "Each decode batch replays the smallest bucket >= its size; the rows between the "
            "batch and the bucket are padding, computed and thrown away.",
            "The buckets may come unsorted or repeated: sort them (`sorted(set(buckets))`).",
            "A batch larger than every bucket has no graph: it runs eagerly, with no padding. "
            "Count those steps separately. An empty trace gives (0, 0).",
        ),
        seen="On the scheduler's own batches your count equals `StepStats.padded_rows` summed "
             "over the run: the scheduler knows the padding before the model runs. Powers of two "
             "waste up to half the rows of a batch just above a power; a few buckets planned "
             "from the trace (`plan_buckets`) waste fewer; one bucket per size wastes none but "
             "costs a graph each. Whether padded rows cost time depends on the step: appendix 08a's "
             "tables price them with measured step times.",
    ),
]
