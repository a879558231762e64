"""Notebook 07's claims: each holds on the committed H200 recording (or a synthetic run that
stands for it) and fails when the numbers behind it are perturbed."""
import dataclasses

import pandas as pd
import pytest

from labkit.lessons.prefill_vs_decode import bounds
from labkit.lessons.prefill_vs_decode import chunked_prefill as cp
from labkit.lessons.prefill_vs_decode import claims as pc
from labkit.tools import recorded

DECODE = "decode B=1 ctx 1024"


@pytest.fixture(scope="module")
def rec():
    return recorded.load("prefill_vs_decode", "steps")


@pytest.fixture
def points(rec):
    return pd.DataFrame(rec.data["points"])


def held(made):
    return [c.held for c in (made if isinstance(made, list) else [made])]


def swap(df, shape_a, shape_b, col="ms", mode=None):
    """``df`` with ``col`` and its rounds' range (``col_low``/``col_high``) of two shapes
    exchanged (in ``mode`` only, if given)."""
    out = df.copy()
    rows = out["mode"] == mode if mode else pd.Series(True, index=out.index)
    a, b = rows & (out["shape"] == shape_a), rows & (out["shape"] == shape_b)
    for c in (col, f"{col}_low", f"{col}_high"):
        va, vb = out.loc[a, c].values.copy(), out.loc[b, c].values.copy()
        out.loc[a, c], out.loc[b, c] = vb, va
    return out


def at(df, shape, mode):
    return (df["shape"] == shape) & (df["mode"] == mode)


def scaled(df, rows, factor, col="ms"):
    """``df`` with ``col`` and its rounds' range multiplied by ``factor`` in ``rows``."""
    out = df.copy()
    for c in (col, f"{col}_low", f"{col}_high"):
        out.loc[rows, c] *= factor
    return out


def test_roofline_claims_hold_on_the_recording_and_fail_when_prefill_stops_rising(rec, points):
    assert held(pc.roofline_claims(points, rec.data["peaks"], recorded=rec)) == [True] * 3
    flat = swap(points, "prefill S=256", "prefill S=1024", "tflops", "graph")
    assert held(pc.roofline_claims(flat, rec.data["peaks"], recorded=rec))[0] is False
    overlap = points.copy()  # medians still rising, one round of the longest below S=1024's best
    s1024, s4096 = at(points, "prefill S=1024", "graph"), at(points, "prefill S=4096", "graph")
    overlap.loc[s4096, "tflops_low"] = 0.99 * float(points.loc[s1024, "tflops_high"].iloc[0])
    assert held(pc.roofline_claims(overlap, rec.data["peaks"], recorded=rec))[0] is False
    short = points.copy()  # one round of S=16 above S=64's worst
    s16, s64 = at(points, "prefill S=16", "graph"), at(points, "prefill S=64", "graph")
    short.loc[s16, "tflops_high"] = 1.01 * float(points.loc[s64, "tflops_low"].iloc[0])
    assert held(pc.roofline_claims(short, rec.data["peaks"], recorded=rec))[0] is False
    low_ridge = dict(rec.data["peaks"], matmul_TFLOPs=rec.data["peaks"]["copy_GBps"] * 0.02)
    assert held(pc.roofline_claims(points, low_ridge, recorded=rec))[2] is False, (
        "a ridge of 20 FLOP/B puts the large decode batches right of it")


def test_the_rise_may_level_off_near_the_ceiling_but_not_fall_away(rec, points):
    """A CPU's one thread nears its matmul ceiling by a few hundred tokens; past the best length
    the claim holds while the longer prompts keep PLATEAU of the best, and says where."""
    def past_peak(factor):  # S=4096 (the longest) at ``factor`` of S=1024's throughput
        s1024, s4096 = at(points, "prefill S=1024", "graph"), at(points, "prefill S=4096", "graph")
        out = points.copy()
        for c in ("tflops", "tflops_low", "tflops_high"):
            out.loc[s4096, c] = factor * float(points.loc[s1024, c].iloc[0])
        return out
    level = pc.roofline_claims(past_peak(0.9), rec.data["peaks"], recorded=rec)[0]
    assert level.held and "from S = 1024 on every prompt at least 75% of the best (41% at S = " \
        "1024)" in level.text
    falling = pc.roofline_claims(past_peak(0.7), rec.data["peaks"], recorded=rec)[0]
    assert not falling.held
    rising = pc.roofline_claims(points, rec.data["peaks"], recorded=rec)[0]
    assert "the longest gets closest" in rising.text and "past it" not in rising.text


def test_a_ratio_of_counts_is_kept_as_an_int(rec, points):
    made = pc.batching_claim(points, recorded=rec)
    assert made.values["per"] == 256 and type(made.values["per"]) is int, made.values
    eng = rec.data["engine"]
    latency = pc.latency_claims(pd.DataFrame(eng["by_batch"]), pd.DataFrame(eng["by_prompt"]),
                                recorded=rec)
    assert type(latency[1].values["px"]) is int and type(latency[2].values["per"]) is int


def test_batching_claim_fails_when_the_big_batch_costs_its_rows(rec, points):
    assert held(pc.batching_claim(points, recorded=rec)) == [True]
    slow = scaled(points, points["shape"] == "decode B=256 ctx 1024", 200)
    assert held(pc.batching_claim(slow, recorded=rec)) == [False]
    one_round = points.copy()  # the median as recorded, its slowest round as dear as 256 rows
    big, small = at(points, "decode B=256 ctx 1024", "graph"), at(points, DECODE, "graph")
    one_round.loc[big, "ms_high"] = 256 * float(points.loc[small, "ms_low"].iloc[0])
    assert held(pc.batching_claim(one_round, recorded=rec)) == [False]


def test_graph_claims_fail_when_eager_and_replay_are_swapped(rec, points):
    assert held(pc.graph_claims(points, recorded=rec)) == [True, True]
    swapped = points.copy()
    swapped["mode"] = swapped["mode"].map({"eager": "graph", "graph": "eager"})
    assert held(pc.graph_claims(swapped, recorded=rec))[0] is False
    slow_eager = scaled(points, at(points, "prefill S=4096", "eager"), 2)
    assert held(pc.graph_claims(slow_eager, recorded=rec))[1] is False
    one_slow = points.copy()  # median eager as recorded, its slowest round past the bound
    graph_low = float(points.loc[at(points, "prefill S=4096", "graph"), "ms_low"].iloc[0])
    one_slow.loc[at(points, "prefill S=4096", "eager"), "ms_high"] = 1.2 * graph_low
    assert held(pc.graph_claims(one_slow, recorded=rec))[1] is False
    one_fast = points.copy()  # one eager round of the small decode within 1.3x of the replay
    graph_high = float(points.loc[at(points, DECODE, "graph"), "ms_high"].iloc[0])
    one_fast.loc[at(points, DECODE, "eager"), "ms_low"] = 1.2 * graph_high
    assert held(pc.graph_claims(one_fast, recorded=rec))[0] is False


def _timed(points, floor):
    return points.assign(floor_ms=floor, ms_low=points.ms, ms_high=points.ms)


def test_bound_claim_holds_for_max_of_host_and_gpu_and_fails_below_it(points):
    eager = points[points["mode"] == "eager"]
    floor = float(eager.ms.min())  # the host floor: about the smallest eager step
    table = bounds.overhead_table(_timed(points, floor))
    assert held(pc.bound_claims(table)) == [True]
    assert held(pc.bound_claims(bounds.overhead_table(_timed(points, 3 * floor)))) == [False], (
        "eager steps well below the floor: the floor measured something else")


def test_cpu_bound_claim_fails_when_a_floor_exceeds_its_step():
    points = pd.DataFrame({"shape": ["decode B=1", "prefill S=256"], "kind": ["decode", "prefill"],
                           "flops_per_byte": [0.5, 70.0], "mode": ["eager", "eager"],
                           "ms": [2.2, 23.4], "floor_ms": [0.37, 0.46]})
    assert held(pc.bound_claims(bounds.overhead_table(points))) == [True]
    over = points.assign(floor_ms=[2.5, 0.46])
    assert held(pc.bound_claims(bounds.overhead_table(over))) == [False]


def test_kernel_claims_hold_on_the_recording_and_fail_when_kernels_outlast_the_host(rec, points):
    prof = rec.data["profiles"][DECODE]
    eager_ms = float(points[(points["shape"] == DECODE) & (points["mode"] == "eager")].ms.iloc[0])
    fused = rec.data["fused"]["profiles"][DECODE]
    made = pc.kernel_claims(prof, 16, eager_ms, recorded=rec, fused_summary=fused)
    assert held(made) == [True, True]
    assert "688 kernels, 43 a layer" in made[0].text
    long_kernels = dict(prof, mean_kernel_us=100.0)
    assert held(pc.kernel_claims(long_kernels, 16, eager_ms, recorded=rec)) == [False]
    assert held(pc.kernel_claims(prof, 16, eager_ms, recorded=rec,
                                 fused_summary=dict(fused, kernel_count=900)))[1] is False
    cpu = {"top_level_ops": 138}
    assert held(pc.kernel_claims(cpu, 2)) == [True], "a CPU's op count needs no eager time"
    assert held(pc.kernel_claims({"top_level_ops": 6}, 2)) == [False]
    with pytest.raises(ValueError, match="eager_ms"):
        pc.kernel_claims(prof, 16, recorded=rec)


def test_fused_claim_fails_when_fused_and_plain_are_swapped(rec, points):
    fused = pd.DataFrame(rec.data["fused"]["points"])
    assert held(pc.fused_claim(points, fused, recorded=rec)) == [True]
    assert held(pc.fused_claim(fused, points, recorded=rec)) == [False]


def test_context_claim_fails_when_time_outgrows_the_bytes_or_does_not_grow():
    growth = {"batch": 16, "context": 256, "long_context": 1024, "mode": "graph",
              "ratio": [1.80, 1.86, 1.80], "bytes_ratio": 1.86, "flops_ratio": 1.29}
    assert held(pc.context_claim(growth)) == [True]
    assert held(pc.context_claim(dict(growth, ratio=[2.5, 2.6, 2.7]))) == [False], (
        "replayed, a memory-bound step cannot outgrow its bytes")
    assert held(pc.context_claim(dict(growth, ratio=[0.95, 1.2, 1.3]))) == [False], (
        "one round faster with more context: the whole range does not clear 1")


def test_eager_on_a_cpu_the_context_claim_asks_only_that_the_step_grows():
    growth = {"batch": 16, "context": 256, "long_context": 1024, "mode": "eager",
              "ratio": [2.02, 2.06, 2.54], "bytes_ratio": 1.86, "flops_ratio": 1.29}
    made = pc.context_claim(growth, device="cpu")
    assert made.held and "more than its bytes" in made.text, made.text
    assert not pc.context_claim(dict(growth, ratio=[0.95, 1.2, 1.3])).held


def test_knee_claim_fails_when_the_long_context_reaches_the_ridge():
    assert held(pc.knee_claim({0: 250, 4096: None}, 190.0)) == [True]
    assert held(pc.knee_claim({0: 250, 4096: 900}, 190.0)) == [False]


def test_latency_claims_hold_on_the_recording_and_fail_when_cases_are_swapped(rec):
    eng = rec.data["engine"]
    by_batch, by_prompt = pd.DataFrame(eng["by_batch"]), pd.DataFrame(eng["by_prompt"])
    assert held(pc.latency_claims(by_batch, by_prompt, recorded=rec)) == [True] * 4
    flipped = by_batch.assign(batch=by_batch.batch.values[::-1])
    assert held(pc.latency_claims(flipped, by_prompt, recorded=rec))[0] is False
    short = by_prompt.assign(prompt_len=by_prompt.prompt_len.values[::-1])
    assert held(pc.latency_claims(by_batch, short, recorded=rec))[1] is False
    first, last = by_batch.batch == by_batch.batch.min(), by_batch.batch == by_batch.batch.max()
    worst = by_batch.copy()  # one round of a lone request as slow as the big batch's best
    worst.loc[first, "ttft_max_high_ms"] = 1.01 * float(by_batch.loc[last, "ttft_max_low_ms"].iloc[0])
    assert held(pc.latency_claims(worst, by_prompt, recorded=rec))[0] is False
    s0, s1 = (by_prompt.prompt_len == f(by_prompt.prompt_len) for f in (min, max))
    mean = by_prompt.copy()  # one round of the longest prompts as fast as the shortest's worst
    mean.loc[s1, "ttft_low_ms"] = 0.99 * float(by_prompt.loc[s0, "ttft_high_ms"].iloc[0])
    assert held(pc.latency_claims(by_batch, mean, recorded=rec))[1] is False
    tpot = by_batch.copy()  # median TPOT as recorded, one round at 64 costing all 64 rows
    tpot.loc[last, "tpot_high_ms"] = 64 * float(by_batch.loc[first, "tpot_low_ms"].iloc[0])
    assert held(pc.latency_claims(tpot, by_prompt, recorded=rec))[2] is False
    fewer = by_prompt.assign(prefill_steps=[1, 3, 1, 5, 7])
    assert held(pc.latency_claims(by_batch, fewer, recorded=rec))[3] is False
    same = by_prompt.assign(prefill_steps=[1] * len(by_prompt))
    assert held(pc.latency_claims(by_batch, same, recorded=rec))[3] is False


def test_interference_claims_hold_on_the_recording_and_fail_when_the_runs_are_swapped(rec):
    on, off = (cp.Interference.from_dict(d) for d in rec.data["engine"]["interference"][:2])
    assert held(pc.interference_claims(on, off, recorded=rec)) == [True] * 3
    short_stall = cp.Interference(off.chunked, off.budget, off.gaps.assign(
        gap_ms=off.gaps.gap_ms / 10), off.steps, off.long_ttft_ms)
    assert held(pc.interference_claims(on, short_stall, recorded=rec))[0] is False, (
        "a whole-prompt step shorter than the chunked gaps is no stall")
    assert held(pc.interference_claims(off, on, recorded=rec))[1] is False, (
        "swapped, the chunked run's long prompt would come first")
    no_mix = cp.Interference(on.chunked, on.budget, on.gaps, on.steps.assign(
        duration_ms=on.steps.duration_ms.where(~on.mixed, 0.5)), on.long_ttft_ms, 0, False)
    assert held(pc.interference_claims(no_mix, off, recorded=rec))[2] is False, (
        "mixed steps faster than decode-only ones")


def _mode_runs(rec, eager, piecewise):
    """Four runs (eager-mixed pair, piecewise pair) built on the recording's two, each with
    three rounds of (long_ttft_ms, worst_gap_ms, mixed_step_ms) as given per run."""
    on, off = (cp.Interference.from_dict(d) for d in rec.data["engine"]["interference"][:2])
    runs = []
    for mode, figures in (("full_decode_only", eager), ("full_and_piecewise", piecewise)):
        for base, (ttft, gap, step) in zip((on, off), figures):
            runs.append(dataclasses.replace(base, cudagraph_mode=mode, round_figures=[
                {"long_ttft_ms": ttft * k, "worst_gap_ms": gap * k, "prefill_gap_ms": gap,
                 "mixed_step_ms": step * k} for k in (0.98, 1.0, 1.03)]))
    return runs


def test_piecewise_chunk_claims_compare_the_modes_round_by_round(rec):
    # (ttft, worst gap, mixed step) for chunked then whole, eager mixed steps then piecewise
    eager = [(400.0, 12.0, 12.0), (100.0, 100.0, 100.0)]
    piecewise = [(140.0, 5.0, 4.5), (100.0, 100.0, 100.0)]
    runs = _mode_runs(rec, eager, piecewise)
    made = pc.piecewise_chunk_claims(runs, recorded=rec)
    assert held(made) == [True] * 3
    assert "target of 3x is met in every round" in made[1].text
    assert "target of at most 1.5x is met in every round" in made[2].text
    slower = _mode_runs(rec, eager, [(140.0, 5.0, 13.0), piecewise[1]])
    assert held(pc.piecewise_chunk_claims(slower, recorded=rec))[0] is False, (
        "a replayed mixed step slower than eager")
    for steps, ok in (((11.0, 11.0, 12.2), True), ((11.0, 11.0, 12.9), False),
                      ((12.05, 12.2, 11.0), False)):  # eager's rounds: 11.76, 12.0, 12.36 ms
        mixed = _mode_runs(rec, eager, piecewise)
        chunked = next(i for i, r in enumerate(mixed)
                       if r.cudagraph_mode == "full_and_piecewise" and r.chunked)
        mixed[chunked] = dataclasses.replace(mixed[chunked], round_figures=[
            {**f, "mixed_step_ms": m} for f, m in zip(mixed[chunked].round_figures, steps)])
        assert held(pc.piecewise_chunk_claims(mixed, recorded=rec))[0] is ok, (
            f"piecewise mixed steps {steps}: one round up to 3% slower is noise, more is not, "
            "nor a slower median")
    no_cut = _mode_runs(rec, eager, [(140.0, 150.0, 4.5), piecewise[1]])
    assert held(pc.piecewise_chunk_claims(no_cut, recorded=rec))[1] is False
    dearer = _mode_runs(rec, eager, [(500.0, 5.0, 4.5), piecewise[1]])
    made = pc.piecewise_chunk_claims(dearer, recorded=rec)
    assert held(made)[2] is False and "target of at most 1.5x is not met" in made[2].text
    one_mode = [r for r in runs if r.cudagraph_mode == "full_decode_only"]
    assert pc.piecewise_chunk_claims(one_mode, recorded=rec) == [], "nothing to compare"


def test_chunk_host_claim_holds_on_the_recording_and_fails_when_a_mixed_step_fits_the_gpu(rec,
                                                                                        points):
    on = cp.Interference.from_dict(rec.data["engine"]["interference"][0])
    gpu = bounds.replayed_prefill(points, on.budget)
    assert gpu[0] == "prefill S=1024", "the shortest replayed prefill at least a chunk long"
    assert held(pc.chunk_host_claim(on, gpu, recorded=rec)) == [True]
    assert held(pc.chunk_host_claim(on, ("prefill S=4096", 20.0), recorded=rec)) == [False]
    one_short = on.steps.duration_ms.copy()  # one mixed step within the GPU time: not host-bound
    one_short[on.mixed.idxmax()] = 0.99 * gpu[1]
    gpu_bound = dataclasses.replace(on, steps=on.steps.assign(duration_ms=one_short))
    assert held(pc.chunk_host_claim(gpu_bound, gpu, recorded=rec)) == [False]
    assert bounds.replayed_prefill(points, 10**6) is None, "no prefill that long was replayed"


def test_an_async_run_times_steps_between_token_reads_and_a_sync_one_by_duration(rec):
    recorded_run = cp.Interference.from_dict(rec.data["engine"]["interference"][0])
    assert not recorded_run.async_scheduling, "the recorder turns async scheduling off"
    assert (recorded_run.step_ms == recorded_run.steps.duration_ms).all()
    # async: the next step is launched before this one's tokens are read, so the steps overlap
    steps = pd.DataFrame({"start_ms": [0.0, 1.0, 2.5, 3.0], "duration_ms": [2.0, 2.0, 1.0, 4.0],
                          "num_prefill_tokens": [0, 0, 0, 0], "num_decode_tokens": [4] * 4})
    on = cp.Interference(True, 512, recorded_run.gaps, steps, 1.0, 0, async_scheduling=True)
    assert on.step_ms.tolist() == pytest.approx([2.0, 1.0, 0.5, 3.5])
    assert cp.Interference.from_dict({k: v for k, v in on.to_dict().items()
                                      if k != "async_scheduling"}).async_scheduling, (
        "a recording without the flag ran with the engine's default, async")
    sync = dataclasses.replace(on, async_scheduling=False)
    assert sync.step_ms.tolist() == steps.duration_ms.tolist()


def test_missing_names_the_fields_a_recording_lacks(rec):
    assert pc.missing(rec.data, ["points.ms", "points.nothing", "engine.by_batch"]) == [
        "points.nothing"]


def test_where_the_arithmetic_sets_the_pace_chunking_keeps_the_long_prompts_ttft(rec):
    on, off = (dataclasses.replace(cp.Interference.from_dict(d), round_figures=None)
               for d in rec.data["engine"]["interference"][:2])  # one round each
    same = dataclasses.replace(on, long_ttft_ms=off.long_ttft_ms * 0.95)
    assert held(pc.interference_claims(same, off, host_bound=False))[1] is True
    assert held(pc.interference_claims(same, off, host_bound=True))[1] is False, (
        "host-bound chunks must make the long prompt wait longer")
    assert held(pc.interference_claims(on, off, host_bound=False))[1] is False, (
        "a recorded GPU chunking cost is not 'the same work'")


def test_over_rounds_the_ttft_claim_needs_every_round_within_the_factor(rec):
    on, off = (cp.Interference.from_dict(d) for d in rec.data["engine"]["interference"][:2])
    ttft = off.long_ttft_ms

    def rounds(run, ttfts):
        return dataclasses.replace(run, round_figures=[
            {**run.figures(), "long_ttft_ms": t} for t in ttfts])

    base = rounds(off, [ttft, 2 * ttft, ttft])  # the machine slowed in round 2: both alike
    steady = rounds(on, [1.1 * ttft, 2.2 * ttft, 1.05 * ttft])
    assert held(pc.interference_claims(steady, base, host_bound=False))[1] is True
    one_slow = rounds(on, [1.1 * ttft, 3.4 * ttft, 1.05 * ttft])  # 1.7x in round 2
    assert held(pc.interference_claims(one_slow, base, host_bound=False))[1] is False
    # the one long step slowed alone in round 2 (chunked 0.55x there): noise, not added work
    whole_slow = rounds(off, [ttft, 2 * ttft, ttft])
    assert held(pc.interference_claims(rounds(on, [1.1 * ttft, 1.1 * ttft, 1.05 * ttft]),
                                       whole_slow, host_bound=False))[1] is True
    # the same two medians with no rounds would have passed: the ranges are what fail it
    assert held(pc.interference_claims(dataclasses.replace(one_slow, round_figures=None,
                                                           long_ttft_ms=1.1 * ttft),
                                       dataclasses.replace(base, round_figures=None),
                                       host_bound=False))[1] is True


def test_the_recorded_steps_show_their_graph_batch_as_an_integer(rec):
    on = cp.Interference.from_dict(rec.data["engine"]["interference"][0])
    steps = cp.step_table(on)
    assert pd.api.types.is_integer_dtype(steps.graph_batch), steps.dtypes
    assert steps.graph_batch[on.decode_only].notna().all(), "decode-only steps replay a graph"
    assert steps.graph_batch[on.mixed].isna().all(), "mixed steps run eagerly: <NA>"


def test_the_recorded_kernel_census_reads_whole_kernels_not_point_0(rec):
    profiles = {**rec.data["profiles"],
                f"{DECODE} fused": rec.data["fused"]["profiles"][DECODE]}
    table = bounds.kernel_table(profiles)
    assert pd.api.types.is_integer_dtype(table.kernels)
    counts = table.kernels.tolist()
    assert len(counts) == 3 and counts[-1] < counts[0], f"the fused step launches fewer: {counts}"
    html = table.round(3).to_html()
    assert all(f"{n}.0" not in html for n in counts), "kernel counts shown as floats"
