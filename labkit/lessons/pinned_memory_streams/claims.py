"""What notebook 04 claims, computed from the run (or the recording) and checked.

Each function takes what an experiment returned and makes its claims; ``recorded``: the
recording the values came from, where they need a GPU this machine lacks. A claim that needs a
field the recording does not hold is not made: the function prints which field is missing.
"""
from __future__ import annotations

import math

import pandas as pd

from labkit.lessons.pinned_memory_streams.transfers import (
    per_round,
    pin_verdicts,
    spread_of,
)
from labkit.measure.rounds import Spread
from labkit.teaching import claim

OVERLAP_GAIN_TARGET = 1.10     # serial step / overlapped step, in every round
BOUND_WITHIN = 0.10            # the step against max(host work, GPU busy) + drain
NO_OVERLAP_BELOW = 0.10        # overlap efficiency that one stream never reaches
OVERLAP_ABOVE = 0.30           # overlap efficiency the copy stream reaches in every round


def _where(recorded) -> str:
    return f" on {recorded.fingerprint['gpu']}" if recorded is not None else ""


def _missing(what: str, have, needed) -> list[str]:
    missing = [k for k in needed if k not in have]
    if missing:
        print(f"({what}: the recording has no {missing}; re-record pinned_memory_streams with "
              "`make record` on a GPU host to make these claims)")
    return missing


def size_name(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


def _sizes(df: pd.DataFrame, mask) -> str:
    chosen = [size_name(int(b)) for b in df.bytes[mask]]
    return ", ".join(chosen) if chosen else "no size"


def _by_verdict(verdicts: pd.DataFrame, column: str) -> str:
    """'sooner at 1 MiB, 4 MiB, later at 4 KiB': only the verdicts some size got."""
    parts = []
    for word in ("sooner", "later", "within noise"):
        mask = verdicts[column] == word
        if mask.all():
            return f"{word} at every size"
        if mask.any():
            parts.append(f"{word} at {_sizes(verdicts, mask)}")
    return ", ".join(parts)


# --------------------------------------------------------------------- pageable against pinned
def sweep_claims(sweep: pd.DataFrame, *, recorded=None) -> list:
    """Pinned against pageable at the largest size (time, and how long the CPU is held), where
    pinning then copying once pays, and after how many copies a pinned buffer pays for itself."""
    if _missing("bandwidth claims", sweep, ["pageable_rounds", "pin_fresh_then_copy_rounds",
                                             "pinned_call_rounds"]):
        return []
    where = _where(recorded)
    df = sweep.sort_values("bytes", ignore_index=True)
    big = df.iloc[-1]
    pageable, pinned = spread_of(big, "pageable"), spread_of(big, "pinned")
    faster = per_round(lambda a, b: a / b, pageable, pinned)
    held_pageable, held_pinned = spread_of(big, "pageable_call"), spread_of(big, "pinned_call")
    verdicts = pin_verdicts(df)
    last = verdicts.iloc[-1]
    paying = verdicts.saving_measurable
    payoff = "; ".join(f"{size_name(int(v.bytes))}: {v.copies_to_break_even:.1f} "
                       f"({v.copies_low:.1f}-{v.copies_high:.1f})"
                       for v in verdicts[paying].itertuples())
    return [
        claim("At {size} a copy from pinned memory took {pinned:.0f} us against {pageable:.0f} "
              "us from pageable memory{where}, {faster:.2fx} faster ({pinned_gbps:.1f} against "
              "{pageable_gbps:.1f} GB/s).", faster.above(1.0), size=size_name(int(big.bytes)),
              pinned=pinned, pageable=pageable, where=where, faster=faster,
              pinned_gbps=float(big.pinned_gbps), pageable_gbps=float(big.pageable_gbps),
              recorded=recorded),
        claim("Inside copy_(non_blocking=True) a pageable copy of {size} held the CPU "
              "{held_pageable:.0f} us and a pinned one {held_pinned:.1f} us{where}: the pageable "
              "copy is synchronous, the pinned one returns once it is enqueued.",
              held_pinned.high < 0.2 * held_pageable.low, size=size_name(int(big.bytes)),
              held_pageable=held_pageable, held_pinned=held_pinned, where=where,
              recorded=recorded),
        claim("Against a pageable copy, pin_memory() on fresh pages then one copy got the data "
              "there {fresh}{where}; with the pinned block cached by PyTorch's allocator (a loop "
              "pinning each new batch of one size) {cached}. Page-locking fresh memory costs "
              "more than the driver's staged copy at {largest}: for large data copied once, do "
              "not pin it first.",
              last.once_fresh == "later",
              fresh=_by_verdict(verdicts, "once_fresh"), cached=_by_verdict(verdicts, "once_cached"),
              largest=size_name(int(last.bytes)), where=where, recorded=recorded),
        claim("A buffer pinned once and reused pays for its pinning after this many copies "
              "(median, range over rounds){where}: {payoff}. At {no_saving} a pinned copy saves "
              "nothing measurable, so pinning pays only by letting the copy overlap.",
              bool(last.saving_measurable) and math.isfinite(last.copies_high),
              payoff=payoff or "none", no_saving=_sizes(verdicts, ~paying), where=where,
              recorded=recorded),
    ]


# ------------------------------------------------------------------- non_blocking, read early
def d2h_claims(too_early: dict, *, recorded=None) -> list:
    """A device-to-host copy into pinned memory read at once holds old values; into pageable
    memory the call waits for the GPU's queued work."""
    where = _where(recorded)
    expected, pageable_expected = too_early["expected"], too_early["pageable_expected"]
    queued_us = too_early["sleep_ms"] * 1e3
    return [
        claim("Read right after copy_(non_blocking=True){where}, pinned host memory held "
              "{early} where the GPU had written {expected:g}: the copy had not run yet. After "
              "the copy's event it held {after}.",
              any(v != expected for v in too_early["pinned_read_early"])
              and all(v == expected for v in too_early["pinned_read_after_event"]),
              early=too_early["pinned_read_early"], expected=expected,
              after=too_early["pinned_read_after_event"], where=where, recorded=recorded),
        claim("Into pinned memory the call returned after {pinned_us:.0f} us; into pageable "
              "memory it took {pageable_us:,.0f} us, the {queued_ms:g} ms of GPU work queued "
              "before it, and read {pageable} (correct){where}: it blocked until the data was "
              "there.", too_early["pinned_call_us"] < 0.1 * queued_us
              and too_early["pageable_call_us"] > 0.5 * queued_us
              and all(v == pageable_expected for v in too_early["pageable_read_at_once"]),
              pinned_us=too_early["pinned_call_us"], pageable_us=too_early["pageable_call_us"],
              queued_ms=too_early["sleep_ms"], pageable=too_early["pageable_read_at_once"],
              where=where, recorded=recorded),
    ]


# ---------------------------------------------------------------------------- early reuse
def torn_copies(run: dict) -> list[int]:
    """The copies whose elements came from more than one batch."""
    return [i for i, mix in enumerate(run["mix"]) if len(mix) > 1]


def reuse_claims(unsafe: dict, safe: dict, *, recorded=None) -> list:
    """One pinned buffer refilled at once corrupts copies, the staging pool does not; and what a
    fractional checksum value says (a torn copy), from which batches each copy's elements came."""
    where = _where(recorded)
    made = [
        claim("One pinned buffer, refilled as soon as each copy was enqueued{where}: {corrupt} "
              "of {n} copies delivered the wrong data, and nothing raised an error.",
              unsafe["corrupt"] > 0, corrupt=unsafe["corrupt"], n=unsafe["n_batches"],
              where=where, recorded=recorded),
        claim("Through PinnedStagingPool(num_buffers=2){where}: {corrupt} of {n} copies wrong; "
              "the pool waited {waits} times for a buffer's last copy before refilling it.",
              safe["corrupt"] == 0 and safe["pool_waits"] > 0, corrupt=safe["corrupt"],
              n=safe["n_batches"], waits=safe["pool_waits"], where=where, recorded=recorded)]
    if _missing("torn-copy claim", unsafe, ["mix"]):
        return made
    mean = [sum(b * s for b, s in mix) if all(b >= 0 for b, _ in mix) else None
            for mix in unsafe["mix"]]
    explained = all(m is not None and abs(m - a) < 1e-6 for m, a in zip(mean, unsafe["arrived"]))
    torn = torn_copies(unsafe)
    if torn:
        i = torn[0]
        parts = ", ".join(f"{s:.1%} from batch {int(b)}" for b, s in unsafe["mix"][i])
        made.append(claim(
            "{k} of {n} copies arrived torn{where}: copy {i} holds {parts}, so its checksum "
            "reads batch {arrived:.3f}, the element-weighted mean of the batches it holds. The "
            "DMA read the buffer while the CPU was rewriting it.", explained, k=len(torn),
            n=unsafe["n_batches"], i=i, parts=parts, arrived=unsafe["arrived"][i], where=where,
            recorded=recorded))
    else:
        made.append(claim(
            "No copy arrived torn{where}: each of the {corrupt} wrong copies holds one whole "
            "later batch (its checksum a whole number, every element from that batch); the CPU "
            "had finished rewriting the buffer before the DMA read it. A torn copy would read a "
            "fractional batch, the element-weighted mean of the batches it mixed.",
            explained and unsafe["corrupt"] > 0, corrupt=unsafe["corrupt"], where=where,
            recorded=recorded))
    return made


def pool_claim(arrived: list, stats) -> list:
    """The staging pool on this machine delivered every checksummed batch in order."""
    expected = list(range(len(arrived)))
    return [claim("PinnedStagingPool on this {device} delivered batches {arrived} ({copies} "
                  "copies, {waits} waits): each intact and in order.",
                  list(arrived) == expected and stats.copies == len(arrived),
                  device="GPU" if stats.pinned else "CPU (synchronous copies)",
                  arrived=[int(a) if float(a).is_integer() else a for a in arrived],
                  copies=stats.copies, waits=stats.waits)]


def readback_claim(got: list, expected: list) -> list:
    return [claim("copy_to_host returned {got}, the values the device computed ({expected}): "
                  "it waited for that copy's event.", got == expected, got=got,
                  expected=expected)]


def handshake_claim(waited: list, skipped: list, expected: list, expected_skipped: list):
    """The raw copy-stream handshake: with the event wait the compute reads the copied batch;
    without it, what the device block held before the copy landed."""
    return claim("With the wait on the copy's event the compute stream read {w}, the copied batch "
                 "doubled; without the wait it read {s} where {e} was due: it ran before the copy "
                 "had landed, and nothing raised.",
                 waited == expected and skipped != expected_skipped, w=waited, s=skipped,
                 e=expected_skipped)


# ---------------------------------------------------------------------- copies beside kernels
def timeline_claims(serial: dict, overlap: dict, *, recorded=None) -> list:
    """From two profiler timelines: GPU time with a copy and a kernel running at once."""
    share = overlap["overlapped_us"] / overlap["copy_us"] if overlap["copy_us"] else 0.0
    return [claim("With the copy stream{where}, copies ran under kernels for {ov:.0f} of their "
                  "{copy:.0f} us of GPU time ({share:.0%}); on one stream for {ov1:.0f} of "
                  "{copy1:.0f} us: the copy engine and the SMs took turns.",
                  share > 0.3 and serial["overlapped_us"] < 0.02 * serial["copy_us"],
                  where=_where(recorded), ov=overlap["overlapped_us"], copy=overlap["copy_us"],
                  share=share, ov1=serial["overlapped_us"], copy1=serial["copy_us"],
                  recorded=recorded)]


def _sign_words(s: Spread) -> str:
    if s.high < 0:
        return "below zero in every round"
    if s.low > 0:
        return "above zero in every round"
    return "on both sides of zero"


def prefetch_claims(df: pd.DataFrame, *, on_gpu: bool, recorded=None) -> list:
    """The Prefetcher's overlap efficiency over rounds, one stream and copy stream, and what a
    negative value means."""
    if _missing("Prefetcher claims", df, ["overlap_efficiency_rounds", "wall_ms_rounds"]):
        return []
    rows = df.set_index("mode")
    one, two = rows.loc["one stream"], rows.loc["copy stream"]
    e1, e2 = Spread.of(one.overlap_efficiency_rounds), Spread.of(two.overlap_efficiency_rounds)
    w1, w2 = Spread.of(one.wall_ms_rounds), Spread.of(two.wall_ms_rounds)
    excess = per_round(lambda w, a, b: w - a - b, w1, Spread.of(one.copy_ms_rounds),
                       Spread.of(one.compute_ms_rounds))
    where = _where(recorded)
    if not on_gpu:
        return [claim(
            "On the CPU the Prefetcher copies synchronously: its overlap efficiency is "
            "{e1:+.2f} with one stream and {e2:+.2f} with the copy stream, {words}: nothing hid, "
            "and the wall time is copy + compute plus {excess:.3f} ms of Python around them.",
            e1.below(NO_OVERLAP_BELOW) and e2.below(NO_OVERLAP_BELOW), e1=e1, e2=e2,
            words=_sign_words(Spread.of(e1.values + e2.values)), excess=excess)]
    return [
        claim("On one stream{where} the Prefetcher's overlap efficiency, (copy + compute - wall) "
              "/ min(copy, compute), is {e1:+.2f}, {words}: no overlap (under {limit} in every "
              "round). Below zero means the wall time ({w1:.2f} ms) exceeded copy + compute on "
              "the GPU by {excess:.3f} ms: host time in which the GPU ran neither (the first "
              "fetch, launch gaps).", e1.below(NO_OVERLAP_BELOW), e1=e1,
              words=_sign_words(e1), limit=NO_OVERLAP_BELOW, w1=w1, excess=excess, where=where,
              recorded=recorded),
        claim("With the copy stream{where} the efficiency is {e2:+.2f} (above {limit} in every "
              "round): that share of the shorter of copy and compute hid behind the other; the "
              "wall time is {w2:.2f} ms against {w1:.2f} ms on one stream.",
              e2.above(OVERLAP_ABOVE) and w1.low > w2.high, e2=e2, limit=OVERLAP_ABOVE, w2=w2,
              w1=w1, where=where, recorded=recorded),
    ]


# ----------------------------------------------------------------- the overlapped serving loop
STEP_FIELDS = ["step_ms_rounds", "prepare_ms_rounds", "enqueue_ms_rounds", "wait_ms_rounds",
               "other_ms_rounds", "drain_ms_rounds", "gpu_busy_ms"]


def _overlapped_bound(row) -> dict:
    """Per round: the host's work per step (all but waiting), the model max(host work, GPU
    busy) + drain, and the step against it."""
    phases = {p: Spread.of(row[f"{p}_ms_rounds"]) for p in
              ("step", "prepare", "copy", "enqueue", "other", "wait", "drain")}
    host = per_round(lambda *v: sum(v), *(phases[p] for p in ("prepare", "copy", "enqueue",
                                                               "other")))
    gpu = float(row.gpu_busy_ms)
    fit = per_round(lambda s, h, d: s / (max(h, gpu) + d), phases["step"], host, phases["drain"])
    return {"phases": phases, "host": host, "gpu": gpu, "fit": fit}


def step_claims(df: pd.DataFrame, *, recorded=None) -> list:
    """The serving loop: both modes pick the same tokens; on a GPU the overlap's gain (target in
    every round) and what bounds the overlapped step, measured: the host's work per step and
    the GPU's busy time per stream against max(prepare, compute); on a CPU, that one set of cores
    runs prepare and compute one after the other."""
    rows = df.set_index("mode")
    where = _where(recorded)
    made = [claim("The serial and the overlapped loop picked the same {n} tokens{where}: reading "
                  "a step's tokens one step later changes when, not what.",
                  bool(df.same_tokens.all()), n=int(rows.loc["serial", "steps"]), where=where,
                  recorded=recorded)]
    needed = [f for f in STEP_FIELDS if f != "gpu_busy_ms"]
    if _missing("step-time claims", df, needed):
        return made
    serial, over = rows.loc["serial"], rows.loc["overlapped"]
    s_serial, s_over = Spread.of(serial.step_ms_rounds), Spread.of(over.step_ms_rounds)
    ideal_ms = max(float(over.prep_ms), float(over.compute_ms))
    if "gpu_busy_ms" not in df or pd.isna(over.get("gpu_busy_ms")):
        phases = {p: Spread.of(over[f"{p}_ms_rounds"]) for p in ("prepare", "enqueue")}
        # against the two phases measured in the same rounds, not the loop's nominal times
        summed = per_round(lambda s, p, e: s / (p + e), s_over, phases["prepare"],
                           phases["enqueue"])
        return made + [claim(
            "On the CPU both loops run on the same cores: the overlapped step takes {over:.2f} "
            "ms ({serial:.2f} serially), of which preparing is {prep:.2f} and the compute, run "
            "at once inside its launch, {enq:.2f}: {summed:.2fx} their sum, no shorter in any "
            "round (within 10%). Nothing overlaps without a second device.",
            summed.low >= 0.9, over=s_over, serial=s_serial, prep=phases["prepare"],
            enq=phases["enqueue"], summed=summed)]
    gain = per_round(lambda a, b: a / b, s_serial, s_over)
    bound = _overlapped_bound(over)
    ph, host, gpu, fit = bound["phases"], bound["host"], bound["gpu"], bound["fit"]
    ideal = per_round(lambda s: s / ideal_ms, s_over)
    return made + [
        claim("Preparing the next step while the GPU computes this one{where}: {over:.2f} ms "
              "per step against {serial:.2f} ms serially, {gain:.2fx} faster (target: more than "
              "{target:.2f}x in every round).", gain.above(OVERLAP_GAIN_TARGET), over=s_over,
              serial=s_serial, gain=gain, target=OVERLAP_GAIN_TARGET, where=where,
              recorded=recorded),
        claim("The overlapped step{where} is {ideal:.2fx} max(prepare, compute) = {ideal_ms:.2f} "
              "ms, because the host does more than prepare: per step it spent {prep:.2f} ms "
              "preparing, {enq:.2f} ms launching the step's kernels and readback and {other:.2f} "
              "ms in the Prefetcher (staging, events), {host:.2f} ms of work, and waited "
              "{wait:.2f} ms. The GPU was busy {gpu:.2f} ms per step (compute stream "
              "{compute_stream:.2f}, copy stream {copy_stream:.3f}; profiler), the compute alone "
              "{compute:.2f}. So the step is bound by {bound}: it is {fit:.2fx} max(host work, "
              "GPU busy) + {drain:.2f} ms per step draining the last step (within "
              "{within:.0%} in every round).",
              fit.above(1 - BOUND_WITHIN) and fit.below(1 + BOUND_WITHIN), ideal=ideal,
              ideal_ms=ideal_ms, prep=ph["prepare"], enq=ph["enqueue"], other=ph["other"],
              host=host, wait=ph["wait"], gpu=gpu, compute_stream=float(over.compute_stream_ms),
              copy_stream=float(over.copy_stream_ms), compute=float(over.compute_ms),
              bound="the host" if host.median >= gpu else "the GPU", fit=fit,
              drain=ph["drain"], within=BOUND_WITHIN, where=where, recorded=recorded),
    ]
