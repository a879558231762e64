"""Notebook 04's claims hold on what was measured (the committed recording, or synthetic inputs
shaped like an H200 run) and fail when the measurement is perturbed: timings swapped, a bound
exceeded, a copy's mix that does not explain its checksum."""
import warnings

import pandas as pd
import pytest
import torch

from labkit.lessons import pinned_memory_streams as transfer
from labkit.tools import recorded

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def rec():
    return recorded.load("pinned_memory_streams", "transfer")


def held(claims):
    return [c.held for c in claims]


# ----------------------------------------------------------------- the bandwidth sweep
# Medians per size shaped like the H200 recording (us), five rounds each at +-3%.
SIZES = [4096, 1 << 20, 1 << 28]
MEDIANS = {"pageable": [29.6, 104.6, 32500.0], "pinned": [29.7, 40.0, 4900.0],
           "pin_cached_then_copy": [38.0, 55.0, 12400.0],
           "pin_fresh_then_copy": [150.0, 94.0, 183000.0],
           "pageable_call": [13.1, 86.6, 33245.0], "pinned_call": [12.3, 12.1, 25.3]}


def sweep(medians=None):
    medians = medians or MEDIANS
    rows = []
    for i, nbytes in enumerate(SIZES):
        row = {"bytes": nbytes}
        for case, values in medians.items():
            row[f"{case}_rounds"] = [values[i] * f for f in (0.97, 0.99, 1.0, 1.01, 1.03)]
            row[f"{case}_us"] = values[i]
        row["pageable_gbps"] = nbytes / row["pageable_us"] / 1e3
        row["pinned_gbps"] = nbytes / row["pinned_us"] / 1e3
        rows.append(row)
    return pd.DataFrame(rows)


def test_pin_verdicts_say_per_size_where_pinning_then_one_copy_pays():
    v = transfer.pin_verdicts(sweep())
    assert list(v.once_fresh) == ["later", "sooner", "later"], "1 MiB: 94 against 104.6 us"
    assert list(v.once_cached) == ["later", "sooner", "sooner"]
    assert list(v.saving_measurable) == [False, True, True], "4 KiB: pinned saves nothing"
    assert v.copies_to_break_even.iloc[1] == pytest.approx((94.0 - 40.0) / (104.6 - 40.0))


def test_the_sweep_claims_hold_on_an_h200_shaped_sweep():
    assert all(held(transfer.sweep_claims(sweep())))


def test_the_pin_first_sentence_names_only_the_verdicts_some_size_got():
    text = transfer.sweep_claims(sweep())[2].text
    assert "no size" not in text and "within noise" not in text, text
    assert "sooner at 1 MiB, later at 4 KiB, 256 MiB" in text, text
    slow = dict(MEDIANS, pin_fresh_then_copy=[150.0, 200.0, 183000.0])
    assert "later at every size" in transfer.sweep_claims(sweep(slow))[2].text


def test_the_sweep_claims_fail_with_pageable_and_pinned_swapped():
    swapped = dict(MEDIANS, pageable=MEDIANS["pinned"], pinned=MEDIANS["pageable"],
                   pageable_call=MEDIANS["pinned_call"], pinned_call=MEDIANS["pageable_call"])
    faster, cpu_held, _, payoff = transfer.sweep_claims(sweep(swapped))
    assert not faster.held and not cpu_held.held and not payoff.held


def test_the_pin_first_claim_fails_where_fresh_pinning_wins_at_the_largest_size():
    cheap = dict(MEDIANS, pin_fresh_then_copy=[150.0, 94.0, 20000.0])
    assert not transfer.sweep_claims(sweep(cheap))[2].held


def recorded_frame(rec, part, drop=()):
    """A copy of a recorded table, less the columns ``drop`` names (``_rounds``: every per-round
    column), as an older recording would hold it."""
    df = pd.DataFrame(rec.data[part])
    gone = [c for c in df.columns if c in drop or ("_rounds" in drop and c.endswith("_rounds"))]
    return df.drop(columns=gone)


def test_the_sweep_claims_hold_on_the_recording_and_fail_with_its_rounds_swapped(rec):
    df = recorded_frame(rec, "h2d_sweep")
    assert all(held(transfer.sweep_claims(df, recorded=rec)))
    swapped = df.assign(pageable_rounds=df.pinned_rounds, pinned_rounds=df.pageable_rounds,
                        pageable_call_rounds=df.pinned_call_rounds,
                        pinned_call_rounds=df.pageable_call_rounds)
    assert held(transfer.sweep_claims(swapped, recorded=rec)) == [False, False, True, False]


def test_the_recorded_speedup_fails_when_one_round_of_pinned_is_not_faster(rec):
    df = recorded_frame(rec, "h2d_sweep")
    big = df.bytes.idxmax()
    slow = [list(r) for r in df.pinned_rounds]
    slow[big][0] = 1.05 * df.pageable_rounds[big][0]      # the median still 8x apart
    assert not transfer.sweep_claims(df.assign(pinned_rounds=slow), recorded=rec)[0].held


def test_the_recorded_pin_first_claim_fails_where_fresh_pinning_wins_at_the_largest_size(rec):
    df = recorded_frame(rec, "h2d_sweep")
    big = df.bytes.idxmax()
    cheap = [list(r) for r in df.pin_fresh_then_copy_rounds]
    cheap[big] = [1.5 * v for v in df.pinned_rounds[big]]
    made = transfer.sweep_claims(df.assign(pin_fresh_then_copy_rounds=cheap), recorded=rec)
    assert held(made) == [True, True, False, True]


def test_the_sweep_claims_are_not_made_from_a_sweep_without_rounds(rec, capsys):
    medians_only = recorded_frame(rec, "h2d_sweep", drop=("_rounds",))
    assert transfer.sweep_claims(medians_only, recorded=rec) == []
    assert "pageable_rounds" in capsys.readouterr().out


# ------------------------------------------------------------------ read too early, reuse
def test_the_read_too_early_claims_hold_on_the_recording(rec):
    assert all(held(transfer.d2h_claims(rec.data["d2h_too_early"], recorded=rec)))


def test_the_read_too_early_claims_fail_when_the_early_read_was_already_right(rec):
    d = dict(rec.data["d2h_too_early"], pinned_read_early=[42.0] * 4,
             pageable_call_us=rec.data["d2h_too_early"]["pinned_call_us"])
    assert held(transfer.d2h_claims(d, recorded=rec)) == [False, False]


def test_the_reuse_claims_hold_on_the_recording_and_fail_with_the_runs_swapped(rec):
    unsafe, safe = rec.data["reuse_unsafe"], rec.data["reuse_safe"]
    made = transfer.reuse_claims(unsafe, safe, recorded=rec)
    assert all(held(made)) and len(made) == 3
    assert held(transfer.reuse_claims(safe, unsafe, recorded=rec)) == [False, False, False]


def test_the_recorded_torn_copy_claim_fails_when_its_mix_does_not_explain_its_checksum(rec):
    unsafe, safe = rec.data["reuse_unsafe"], rec.data["reuse_safe"]
    (torn, *_) = transfer.torn_copies(unsafe)
    arrived = list(unsafe["arrived"])
    arrived[torn] = round(arrived[torn]) + 0.5
    made = transfer.reuse_claims(dict(unsafe, arrived=arrived), safe, recorded=rec)
    assert held(made) == [True, True, False]


def test_the_reuse_runs_without_a_mix_make_no_torn_copy_claim(rec, capsys):
    unsafe = {k: v for k, v in rec.data["reuse_unsafe"].items() if k != "mix"}
    safe = {k: v for k, v in rec.data["reuse_safe"].items() if k != "mix"}
    assert held(transfer.reuse_claims(unsafe, safe, recorded=rec)) == [True, True]
    assert "mix" in capsys.readouterr().out
    assert held(transfer.reuse_claims(safe, unsafe, recorded=rec)) == [False, False]


def torn_run():
    numel, n = 8, 3
    sent = [transfer.make_batch(i, numel) for i in range(n)]
    torn = torch.cat([sent[1][:1], sent[0][1:]])        # 1/8 of batch 1, 7/8 of batch 0
    outs = [torn, sent[2], sent[2]]
    got = [int(o.sum(dtype=torch.int64)) for o in outs]
    return {"n_batches": n, "numel": numel, "got": got,
            "arrived": [transfer.arrived_batch(g, numel) for g in got],
            "mix": [transfer.batch_mix(o, n) for o in outs],
            "corrupt": sum(g != int(b.sum(dtype=torch.int64)) for g, b in zip(got, sent))}


def test_a_torn_copy_reads_the_element_weighted_mean_of_its_batches():
    run = torn_run()
    assert run["arrived"][0] == pytest.approx(0.125)
    assert run["mix"][0] == [[0.0, 0.875], [1.0, 0.125]]
    assert transfer.torn_copies(run) == [0]


def test_the_torn_copy_claim_holds_when_the_mix_explains_the_checksum_and_fails_otherwise():
    run = torn_run()
    safe = {"n_batches": 3, "corrupt": 0, "pool_waits": 2}
    assert all(held(transfer.reuse_claims(run, safe)))
    wrong = dict(run, arrived=[0.5] + run["arrived"][1:])
    assert not transfer.reuse_claims(wrong, safe)[2].held


def test_an_untorn_run_says_so_and_fails_when_nothing_was_corrupt():
    numel, n = 4, 2
    outs = [transfer.make_batch(1, numel)] * 2
    got = [int(o.sum(dtype=torch.int64)) for o in outs]
    run = {"n_batches": n, "numel": numel, "got": got, "corrupt": 1,
           "arrived": [transfer.arrived_batch(g, numel) for g in got],
           "mix": [transfer.batch_mix(o, n) for o in outs]}
    assert transfer.reuse_claims(run, {"n_batches": n, "corrupt": 0, "pool_waits": 1})[2].held
    assert not transfer.reuse_claims(dict(run, corrupt=0),
                                     {"n_batches": n, "corrupt": 0, "pool_waits": 1})[2].held


def test_the_pool_and_readback_claims_fail_on_out_of_order_or_stale_values():
    from labkit.overlap import PinnedStagingPool
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pool = PinnedStagingPool(2, CPU)
        for i in range(3):
            pool.to_device(transfer.make_batch(i, 4))
    stats = pool.stats
    assert held(transfer.pool_claim([0.0, 1.0, 2.0], stats)) == [True]
    assert held(transfer.pool_claim([0.0, 2.0, 1.0], stats)) == [False]
    assert held(transfer.readback_claim([1.0], [1.0])) == [True]
    assert held(transfer.readback_claim([0.0], [1.0])) == [False]


# ---------------------------------------------------------------- timelines and Prefetcher
def test_the_timeline_claim_holds_on_the_recording_and_fails_with_the_timelines_swapped(rec):
    serial, overlap = rec.data["timeline_serial"], rec.data["timeline_overlap"]
    assert held(transfer.timeline_claims(serial, overlap, recorded=rec)) == [True]
    assert held(transfer.timeline_claims(overlap, serial, recorded=rec)) == [False]


def prefetch(one_eff, two_eff, one_wall=4.39, two_wall=3.48):
    rows = []
    for mode, eff, wall in (("one stream", one_eff, one_wall), ("copy stream", two_eff, two_wall)):
        rows.append({"mode": mode, "overlap_efficiency_rounds": eff,
                     "wall_ms_rounds": [wall * f for f in (0.99, 1.0, 1.01)],
                     "copy_ms_rounds": [1.39] * 3, "compute_ms_rounds": [2.82] * 3})
    return pd.DataFrame(rows)


def test_the_prefetcher_claims_hold_with_no_overlap_on_one_stream_and_fail_past_the_bound():
    assert all(held(transfer.prefetch_claims(prefetch([-0.13, -0.05, 0.02], [0.55, 0.6, 0.5]),
                                             on_gpu=True)))
    one, two = transfer.prefetch_claims(prefetch([-0.05, 0.2, 0.0], [0.55, 0.6, 0.1]),
                                        on_gpu=True)
    assert not one.held and not two.held
    assert not transfer.prefetch_claims(prefetch([-0.1] * 3, [0.5] * 3, one_wall=3.0,
                                                 two_wall=3.48), on_gpu=True)[1].held


def test_a_negative_efficiency_is_named_below_zero_from_its_range():
    (one, _) = transfer.prefetch_claims(prefetch([-0.13, -0.05, -0.02], [0.55] * 3), on_gpu=True)
    assert "below zero in every round" in one.text
    (one, _) = transfer.prefetch_claims(prefetch([-0.05, 0.01, 0.02], [0.55] * 3), on_gpu=True)
    assert "on both sides of zero" in one.text


def test_the_prefetcher_claims_hold_on_the_recording_and_fail_with_the_modes_swapped(rec):
    df = recorded_frame(rec, "prefetch_rounds")
    assert held(transfer.prefetch_claims(df, on_gpu=True, recorded=rec)) == [True, True]
    swapped = df.assign(mode=list(reversed(df["mode"])))
    assert held(transfer.prefetch_claims(swapped, on_gpu=True, recorded=rec)) == [False, False]


def test_the_prefetcher_claims_are_not_made_from_rounds_the_recording_lacks(rec, capsys):
    medians_only = recorded_frame(rec, "prefetch_rounds", drop=("_rounds",))
    assert transfer.prefetch_claims(medians_only, on_gpu=True, recorded=rec) == []
    assert "overlap_efficiency_rounds" in capsys.readouterr().out


def test_the_prefetcher_claim_holds_on_this_cpu_and_fails_if_copies_hid(quiet_overlap):
    df = transfer.prefetch_rounds(n_batches=3, rows=32, cols=32, device=CPU, rounds=3,
                                  repeats=2)
    assert held(transfer.prefetch_claims(df, on_gpu=False)) == [True]
    hid = df.assign(overlap_efficiency_rounds=[[0.5] * 3, [0.5] * 3])
    assert held(transfer.prefetch_claims(hid, on_gpu=False)) == [False]


@pytest.fixture
def quiet_overlap():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------------------ the serving loop
def steps(serial_ms, over_ms, wait_ms=0.01, gpu_ms=2.9, enqueue_ms=0.9, drain_ms=0.23):
    """Phases per step of an H200-shaped run: the host prepares 3.0 ms and launches
    ``enqueue_ms``; the overlapped step is host work + waits + drain by construction."""
    def row(mode, step, wait, drain):
        other = step - 3.0 - enqueue_ms - wait - drain
        phases = {"step": step, "prepare": 3.0, "copy": 0.0, "enqueue": enqueue_ms,
                  "wait": wait, "other": other, "drain": drain}
        out = {"mode": mode, "prep_ms": 3.0, "compute_ms": 2.8, "steps": 12,
               "gpu_busy_ms": gpu_ms, "compute_stream_ms": gpu_ms, "copy_stream_ms": 0.005,
               "same_tokens": True}
        for name, v in phases.items():
            out[f"{name}_ms"] = v
            out[f"{name}_ms_rounds"] = [v * f for f in (0.98, 1.0, 1.02)]
        return out

    return pd.DataFrame([row("serial", serial_ms, 2.8, 0.0), row("overlapped", over_ms, wait_ms,
                                                                  drain_ms)])


def test_the_step_claims_hold_when_the_host_bounds_the_overlapped_step():
    made = transfer.step_claims(steps(6.0, 4.2))
    assert all(held(made)) and len(made) == 3
    assert "bound by the host" in made[2].text


def test_the_step_claims_fail_with_serial_and_overlapped_swapped():
    assert not transfer.step_claims(steps(4.2, 6.0))[1].held


def test_the_bound_claim_fails_when_the_host_waits_while_the_gpu_is_idle():
    idle = steps(6.0, 5.5, wait_ms=1.3, gpu_ms=2.9)   # waits 1.3 ms a step, GPU busy only 2.9
    assert not transfer.step_claims(idle)[2].held


def test_the_bound_claim_names_the_gpu_when_its_busy_time_is_longer():
    gpu_bound = steps(8.0, 6.2, wait_ms=1.6, gpu_ms=6.0)
    made = transfer.step_claims(gpu_bound)
    assert made[2].held and "bound by the GPU" in made[2].text


def test_the_step_claims_hold_on_this_cpu_and_fail_if_the_step_beat_prepare_plus_compute(
        quiet_overlap):
    df = transfer.step_times(steps=3, tokens=8, d_model=16, vocab=32, prep_ms=0.5,
                             compute_ms=0.2, device=CPU, rounds=3, repeats=2)
    assert {f"{p}_ms_rounds" for p in transfer.PHASES} <= set(df.columns)
    assert all(held(transfer.step_claims(df)))
    fast = df.assign(step_ms_rounds=[[0.1] * 3, [0.1] * 3])
    assert held(transfer.step_claims(fast)) == [True, False]
    assert not transfer.step_claims(df.assign(same_tokens=False))[0].held


def test_the_step_claims_hold_on_the_recording_and_fail_with_the_modes_swapped(rec):
    df = recorded_frame(rec, "steps")
    made = transfer.step_claims(df, recorded=rec)
    assert all(held(made)) and len(made) == 3
    assert "bound by the host" in made[2].text
    swapped = df.assign(mode=list(reversed(df["mode"])))
    assert held(transfer.step_claims(swapped, recorded=rec)) == [True, False, False]


def test_the_recorded_bound_claim_fails_when_each_step_took_longer_than_the_bound(rec):
    df = recorded_frame(rec, "steps")
    over = df.index[df["mode"] == "overlapped"][0]
    rounds = [list(r) for r in df.step_ms_rounds]
    rounds[over] = [v + 0.6 for v in rounds[over]]    # the gain still clears its target
    made = transfer.step_claims(df.assign(step_ms_rounds=rounds), recorded=rec)
    assert held(made) == [True, True, False]


def test_the_recorded_gain_fails_when_one_round_misses_its_target(rec):
    df = recorded_frame(rec, "steps")
    serial = df.index[df["mode"] == "serial"][0]
    over = df.index[df["mode"] == "overlapped"][0]
    rounds = [list(r) for r in df.step_ms_rounds]
    rounds[over][0] = rounds[serial][0] / 1.05          # the median gain still above 1.3x
    assert not transfer.step_claims(df.assign(step_ms_rounds=rounds), recorded=rec)[1].held


def test_the_recorded_steps_without_phases_make_only_the_tokens_claim(rec, capsys):
    no_phases = recorded_frame(rec, "steps", drop=("_rounds", "gpu_busy_ms", "compute_stream_ms",
                                                  "copy_stream_ms"))
    made = transfer.step_claims(no_phases, recorded=rec)
    assert held(made) == [True] and "step_ms_rounds" in capsys.readouterr().out
    assert held(transfer.step_claims(no_phases.assign(same_tokens=[True, False]),
                                     recorded=rec)) == [False]


def test_the_handshake_claim_holds_only_when_the_wait_mattered():
    batch, later = [0.0, 2.0, 4.0, 6.0], [200.0, 202.0, 204.0, 206.0]
    nan = [float("nan")] * 4
    assert transfer.handshake_claim(batch, nan, batch, later).held
    assert not transfer.handshake_claim(batch, later, batch, later).held, \
        "the copy landed in time without the wait: nothing shown"
    assert not transfer.handshake_claim(nan, nan, batch, later).held
