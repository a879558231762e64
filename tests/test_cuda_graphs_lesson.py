"""Notebook 02's lesson: each claim holds on the recording (or on inputs shaped like the H200's
measurements) and fails when the numbers behind it are perturbed: eager and replay swapped, a
padded graph no dearer than an exact one, a capture over its target, a graph that ignored its
context."""
import copy

import pytest
import torch

from labkit.graphs.bucket_planner import padding_waste, plan_buckets, powers_of_two
from labkit.lessons.cuda_graphs import claims as gc
from labkit.lessons.cuda_graphs import measurements as gx
from labkit.lessons.cuda_graphs import pitfalls as gp
from labkit.measure.profile import Trace
from labkit.tools import recorded


@pytest.fixture(scope="module")
def rec():
    return recorded.load("cuda_graphs", "pool")


def steps():
    """Shaped like the H200's: eager host-bound near 4.4 ms, replay close to its GPU time."""
    return {"batch": [1, 8, 64, 256], "bucket": [1, 8, 64, 256], "rounds": 3,
            "eager_us": [[3100, 4400, 4300], [4400, 4300, 4500], [4450, 4400, 4300],
                         [2600, 2620, 2650]],
            "graph_us": [[600, 605, 598], [690, 692, 688], [968, 970, 965], [1806, 1810, 1800]],
            "eager_gpu_us": [600.0, 628.0, 965.0, 1790.0],
            "graph_gpu_us": [590.0, 630.0, 960.0, 1795.0]}


def swapped(d, a, b):
    out = copy.deepcopy(d)
    out[a], out[b] = d[b], d[a]
    return out


# ------------------------------------------------------------------------------ step times
def test_the_step_claims_hold_on_h200_shaped_timings():
    made = gc.step_claims(steps())
    assert len(made) == 4 and all(c.held for c in made), [c.text for c in made if not c.held]


def test_the_step_claims_fail_with_eager_and_replay_swapped():
    faster, target, host_bound, _replay_bound = gc.step_claims(swapped(steps(), "eager_us",
                                                                      "graph_us"))
    assert not faster.held and not target.held and not host_bound.held


def test_the_batch_8_target_fails_when_one_round_misses_it():
    s = steps()
    s["eager_us"][1] = [4400, 4300, 1300]      # one round: 1300 / 688 < 2x
    assert not gc.step_claims(s)[1].held


def test_eager_is_not_called_host_bound_when_its_kernels_fill_the_wall_time():
    s = steps()
    s["eager_gpu_us"] = [3000.0, 4200.0, 4200.0, 2500.0]
    assert not gc.step_claims(s)[2].held


def test_replay_is_not_called_gpu_bound_when_its_wall_time_is_far_above_its_kernels():
    s = steps()
    s["graph_gpu_us"][1] = 100.0
    assert not gc.step_claims(s)[3].held


def test_without_profiled_gpu_times_only_the_two_timing_claims_are_made():
    s = steps()
    s["eager_gpu_us"] = s["graph_gpu_us"] = [None] * 4
    assert len(gc.step_claims(s)) == 2


def test_the_step_table_gives_each_batch_its_median_range_and_per_round_speedup():
    t = gx.step_table(steps())
    row = t[t.batch == 8].iloc[0]
    assert (row.eager_us, row.eager_low, row.eager_high) == (4400, 4300, 4500)
    assert row.speedup == pytest.approx(4400 / 690)  # the median of the per-round ratios
    assert row.speedup_low == pytest.approx(min(4400 / 690, 4300 / 692, 4500 / 688))


# ---------------------------------------------------------------------------------- timelines
def traces(rec):
    return (Trace.from_dict(rec.data["trace_eager"]).summary,
            Trace.from_dict(rec.data["trace_graph"]).events)


def test_the_timeline_claims_hold_on_the_recording(rec):
    eager, graph_events = traces(rec)
    made = gc.timeline_claims(eager, graph_events, recorded=rec)
    assert len(made) == 2 and all(c.held for c in made)


def test_the_busy_claim_fails_when_eager_kept_the_gpu_as_busy_as_the_graph(rec):
    _, graph_events = traces(rec)
    graph_summary = Trace.from_dict(rec.data["trace_graph"]).summary
    assert not gc.timeline_claims(graph_summary, graph_events, recorded=rec)[0].held


def test_the_wait_claim_fails_when_the_graph_started_early_in_its_launch_call(rec):
    eager, events = traces(rec)
    launch = events[events.name == "cudaGraphLaunch"].iloc[0]
    nodes = events.lane.str.startswith("GPU") & (events.correlation == launch.correlation)
    early = events.copy()
    early.loc[nodes, "start_us"] -= early.loc[nodes, "start_us"].min() - launch.start_us - 5
    assert not gc.timeline_claims(eager, early, recorded=rec)[1].held


def test_the_graph_launch_reading_finds_every_node_of_the_recorded_replay(rec):
    eager, events = traces(rec)
    g = gc.graph_launch(events)
    replayed = int((events.kind == "kernel").sum())
    # The graph was captured from the same step the eager trace ran: one node per eager kernel,
    # and every kernel of the replay's trace is one of the launch's nodes.
    assert g["nodes"] == eager["kernel_count"] == replayed > 0
    assert 0 < g["busy_us"] <= g["span_us"]


def test_the_unprofiled_replay_claim_fails_when_the_step_is_as_long_as_kernels_plus_wait(rec):
    _, events = traces(rec)
    assert gc.unprofiled_replay_claim(events, steps(), recorded=rec).held
    slow = steps()
    slow["graph_us"][1] = [1200, 1150, 1250]
    assert not gc.unprofiled_replay_claim(events, slow, recorded=rec).held


# ------------------------------------------------------------------------------------ padding
def padding():
    """A launch-bound batch padded a little and a GPU-bound one padded nearly 2x."""
    return {"launch_bound": {"batch": 12, "bucket": 16, "gpu_us": {"eager": 700.0,
                                                                  "exact": 730.0,
                                                                  "padded": 740.0},
                             "rounds": {"eager": [4400, 4300, 4500], "exact": [740, 738, 742],
                                        "padded": [745, 744, 748]}},
            "gpu_bound": {"batch": 2049, "bucket": 4096, "gpu_us": {"eager": 9600.0,
                                                                   "exact": 9600.0,
                                                                   "padded": 18600.0},
                          "rounds": {"eager": [10100, 10200, 10050],
                                     "exact": [9800, 9850, 9790],
                                     "padded": [18700, 18800, 18650]}}}


def test_the_padding_claims_hold_where_padding_is_cheap_and_where_it_eats_the_saving():
    p = padding()
    made = gc.padding_claims(p["launch_bound"], p["gpu_bound"])
    assert len(made) == 3 and all(c.held for c in made), [c.text for c in made if not c.held]


def test_cheap_padding_fails_when_the_padded_rows_cost_more_than_the_launches_saved():
    p = padding()
    p["launch_bound"]["rounds"]["padded"] = [4600, 4700, 4650]
    assert not gc.padding_claims(p["launch_bound"], p["gpu_bound"])[0].held


def test_the_gpu_bound_claim_fails_when_the_kernels_fill_little_of_the_wall_time():
    p = padding()
    p["gpu_bound"]["gpu_us"]["eager"] = 2000.0
    assert not gc.padding_claims(p["launch_bound"], p["gpu_bound"])[1].held


def test_eaten_fails_with_padded_and_exact_swapped_or_eager_slower_than_the_padded_graph():
    p = padding()
    flat = copy.deepcopy(p)
    flat["gpu_bound"]["rounds"] = swapped(p["gpu_bound"]["rounds"], "padded", "exact")
    assert not gc.padding_claims(flat["launch_bound"], flat["gpu_bound"])[2].held
    slow_eager = copy.deepcopy(p)
    slow_eager["gpu_bound"]["rounds"]["eager"] = [18000, 19000, 18500]   # one round above
    assert not gc.padding_claims(slow_eager["launch_bound"], slow_eager["gpu_bound"])[2].held


def test_the_padding_table_counts_the_rows_each_run_computed():
    t = gx.padding_table(padding())
    padded = t[(t.configuration == "gpu_bound") & (t.run == "padded")].iloc[0]
    assert padded["rows computed"] == 4096 and padded.wall_us == 18700


# ------------------------------------------------------------------------- capture and memory
def capture():
    return {"buckets": [256, 8, 1], "context_buckets": [], "keys": 3, "predicted_MiB": 27.0,
            "static_input_MiB": 1.0, "capture_s": [0.26, 0.31, 0.28],
            "captured_MiB": [27.0, 27.0, 27.0],
            "per_key": [{"key": ["(256,)", "(8,)", "(1,)"], "capture_ms": [18.5, 17.0, 16.0],
                         "pool_MiB": [26.0, 0.0, 0.0]}] * 3}


def test_the_capture_claims_hold_on_a_capture_shaped_like_the_h200s():
    made = gc.capture_claims(capture())
    assert len(made) == 3 and all(c.held for c in made)


def test_the_capture_target_fails_when_one_round_is_over_it():
    c = capture()
    c["capture_s"] = [0.3, 2.4, 0.3]
    assert not gc.capture_claims(c)[0].held


def test_shared_memory_fails_when_every_graph_takes_memory_of_its_own():
    c = capture()
    c["per_key"] = [{**c["per_key"][0], "pool_MiB": [26.0, 26.0, 26.0]}] * 3
    assert not gc.capture_claims(c)[1].held


def test_the_prediction_claim_fails_when_the_graphs_hold_far_more_than_predicted():
    c = capture()
    c["captured_MiB"] = [27.0, 45.0, 27.0]
    assert not gc.capture_claims(c)[2].held


def test_the_per_key_table_gives_each_keys_capture_range_over_rounds():
    c = capture()
    c["per_key"] = [{**c["per_key"][0], "capture_ms": [ms, 17.0, 16.0]} for ms in (18, 96, 20)]
    row = gx.per_key_table(c).iloc[0]
    assert (row.capture_ms, row.capture_ms_low, row.capture_ms_high) == (20, 18, 96)


def context():
    keyed = {**capture(), "buckets": [1, 8, 64, 256], "context_buckets": [256, 1024], "keys": 8,
             "honoured": {"batch": 8, "short": 256, "long": 1024, "diff_vs_eager": 0.0,
                          "diff_vs_short_graph": 0.4}}
    return {"keyed": keyed, "batch_only": {**capture(), "buckets": [1, 8, 64, 256], "keys": 4}}


def test_the_context_claims_hold_when_each_key_is_its_own_graph():
    made = gc.context_claims(context())
    assert len(made) == 2 and all(c.held for c in made)


def test_the_context_claims_fail_when_the_keys_do_not_multiply_or_the_context_is_ignored():
    c = context()
    c["keyed"]["keys"] = 4
    assert not gc.context_claims(c)[0].held
    ignored = context()
    ignored["keyed"]["honoured"].update(diff_vs_eager=0.4, diff_vs_short_graph=0.0)
    assert not gc.context_claims(ignored)[1].held


# ------------------------------------------------------------------------ pitfalls and planner
def test_the_pitfall_claims_hold_live_and_fail_when_the_pitfall_did_not_show():
    rebind, overwrite = gp.rebinding_vs_copy("cpu"), gp.output_overwritten("cpu")
    frozen = gp.frozen_choice("cpu")
    assert all(c.held for c in gc.pitfall_claims(rebind, overwrite, frozen, "cpu"))
    fixed = gc.pitfall_claims({**rebind, "rebinding_is_stale": False},
                              {**overwrite, "kept_reference_changed": False},
                              {**frozen, "graph_is_wrong": False}, "cpu")
    assert not any(c.held for c in fixed)


def test_the_host_sync_claim_holds_on_the_recording_and_fails_when_warm_up_did_not_help():
    pitfalls = recorded.load("cuda_graphs", "pitfalls")
    sync = pitfalls.data["host_sync"]
    assert gc.host_sync_claim(sync, recorded=pitfalls).held
    broken = {**sync, "lazy_init_with_warmup": sync["lazy_init_without_warmup"]}
    assert not gc.host_sync_claim(broken, recorded=pitfalls).held


def test_the_planner_claim_fails_with_the_plans_swapped():
    trace = [1, 3, 3, 5, 9, 12, 12, 30, 33, 60] * 10
    naive = padding_waste(trace, powers_of_two(max(trace)))
    planned = plan_buckets(trace, len(naive.buckets))
    assert gc.planner_claim(naive, planned, len(trace)).held
    assert not gc.planner_claim(planned, naive, len(trace)).held


# ------------------------------------------------------------------------ the measurements
def test_a_recording_without_a_field_or_for_other_buckets_is_not_read(rec, capsys):
    assert gx.recorded_field(rec, "no_such_measurement") is None
    assert "re-record" in capsys.readouterr().out

    older = recorded.Recorded(name="cuda_graphs", data={"capture_rounds": {
        "buckets": [1, 2, 4, 8, 16, 32, 64, 96, 128, 256]}}, fingerprint={}, date="", command="")
    assert gx.recorded_field(older, "capture_rounds", buckets=gx.BUCKETS) is None
    assert "96" in capsys.readouterr().out
    assert gx.recorded_field(older, "capture_rounds") is not None


def test_cpu_step_rounds_time_eager_in_every_round():
    stack = gx.make_stack("cpu", quick=True, max_batch=4)
    s = gx.step_rounds(stack, [1, 4], rounds=3, repeats=1, warmup=0)
    assert s["batch"] == [1, 4] and all(len(r) == 3 and min(r) > 0 for r in s["eager_us"])
    assert s["graph_us"] == [None, None]
    assert "graph_us" not in gx.step_table(s)


def test_the_decode_stack_attends_over_the_context_it_is_given():
    stack = gx.make_stack("cpu", quick=True, max_batch=2)
    x = gx.hidden(stack, 2)
    full = gx.SMALL["context"]
    torch.testing.assert_close(stack(x, context=full), stack(x))
    assert not torch.allclose(stack(x, context=4), stack(x))
    with pytest.raises(ValueError, match="context"):
        stack(x, context=full + 1)


@pytest.mark.gpu
def test_a_context_keyed_pool_captures_one_graph_per_key_and_each_attends_over_its_context():
    stack = gx.make_stack("cuda", quick=True, max_batch=8)
    ctx = gx.context_pool(stack, batches=(1, 8), context_buckets=(8, gx.SMALL["context"]),
                          rounds=1, batch=8)
    assert ctx["keyed"]["keys"] == 4 and ctx["batch_only"]["keys"] == 2
    assert all(c.held for c in gc.context_claims(ctx, device="cuda"))


@pytest.mark.gpu
def test_padding_price_times_three_runs_in_every_round():
    stack = gx.make_stack("cuda", quick=True, max_batch=16)
    p = gx.padding_price(stack, 12, 16, rounds=3, repeats=3)
    assert set(p["rounds"]) == {"eager", "exact", "padded"}
    assert all(len(v) == 3 for v in p["rounds"].values()) and p["gpu_us"]["padded"] > 0


def _lognormal_trace():
    torch.manual_seed(0)
    return (torch.distributions.LogNormal(3.0, 0.9).sample((5000,)).clamp(1, 256).round().int()
            .tolist())


def test_the_time_planner_claims_hold_on_the_recording_and_fail_when_a_round_favours_others(rec):
    times = gc.bucket_step_times(rec.data["step_rounds"])
    assert set(times) == {1, 2, 4, 8, 16, 32, 64, 128, 256}     # the unpadded batches only
    trace = _lognormal_trace()
    assert all(c.held for c in gc.planner_time_claims(trace, times, recorded=rec))
    # one round in which the powers of two's own sizes ran fast: the median plan loses there
    cheap = {b: [500.0, *v[1:]] if b in (16, 32, 64, 128) else v for b, v in times.items()}
    assert not gc.planner_time_claims(trace, cheap, recorded=rec)[0].held
    # one round in which T grew with every row (T = bucket): the fewest-rows plan wins there
    by_rows = {b: [float(b), *v[1:]] for b, v in times.items()}
    assert not gc.planner_time_claims(trace, by_rows, recorded=rec)[1].held


def test_the_raw_capture_claim_holds_on_the_new_batch_and_fails_on_a_stale_replay():
    eager, at_capture = torch.randn(8, 16), torch.randn(8, 16)
    assert gc.raw_capture_claim(eager.clone(), eager, at_capture, "cpu").held
    assert not gc.raw_capture_claim(at_capture.clone(), eager, at_capture, "cpu").held, \
        "a graph that still computed on the captured batch"
    assert not gc.raw_capture_claim(eager + 0.5, eager, at_capture, "cpu").held



# ----------------------------------------------------------------- the engine's context keys
def _context_run(batch, plain_us, keyed_us, contexts=(512, 32768)):
    """A context_key_rounds result: per context, three rounds of step us for each runner."""
    return {"batch": batch, "contexts": list(contexts), "context_buckets": [512, 2048, 8192],
            "rounds": 3,
            "by_batch": {"keys": 1, "capture_ms": 24.0, "graph_MiB": 2.1,
                         "us": {str(c): list(u) for c, u in zip(contexts, plain_us)}},
            "by_batch_and_context": {"keys": 4, "capture_ms": 87.0, "graph_MiB": 4.2,
                                     "us": {str(c): list(u) for c, u in zip(contexts, keyed_us)}}}


def test_engine_context_claims_hold_when_the_keys_lose_nothing_at_long_context():
    from labkit.lessons.cuda_graphs.engine_context import engine_context_claims, keyed_gain
    wins = _context_run(8, [[1250, 1251, 1253], [3380, 3381, 3383]],
                        [[1153, 1157, 1155], [3379, 3377, 3380]])
    flat = _context_run(64, [[1424, 1422, 1426], [3439, 3454, 3435]],
                        [[1423, 1427, 1420], [3435, 3436, 3441]], contexts=(512, 4096))
    assert f"{keyed_gain(wins, 512):.3fx}".startswith("1.08")
    made = engine_context_claims([wins, flat], device="cpu")
    assert [c.held for c in made] == [True, True]
    assert "win at short context without losing at long" in made[0].text
    assert "win nothing measurable" in made[1].text
    assert "each of the 3 extra keys costs 21 ms of capture and 0.7 MiB" in made[0].text
    slower = _context_run(8, [[1250] * 3, [3380, 3381, 3383]], [[1153] * 3, [3380, 3600, 3380]])
    assert not engine_context_claims([slower], device="cpu")[0].held, "a long-context loss"


def test_the_default_of_one_key_per_batch_holds_until_a_batch_gains_enough_from_context_keys():
    from labkit.lessons.cuda_graphs.engine_context import WORTH_A_KEY, default_claim
    # as measured on the H200 once each sequence's keys were dealt on the device
    b1 = _context_run(1, [[836, 833, 837], [1081, 1081, 1083]], [[820, 819, 822], [1084, 1079, 1085]])
    b8 = _context_run(8, [[1064, 1061, 1066], [3015, 3009, 3031]],
                      [[1078, 1074, 1090], [3055, 3051, 3056]])
    made = default_claim([b1, b8], device="cpu")
    assert made.held and "at best 1.018x" in made.text and "(batch 1 on this CPU)" in made.text
    # before the device-side dealing: batch 8 won 1.08x at short context, losing nothing at long
    wins = _context_run(8, [[1250, 1251, 1253], [3380, 3381, 3383]],
                        [[1153, 1157, 1155], [3379, 3377, 3380]])
    assert not default_claim([b1, wins], device="cpu").held
    # a gain over the mark in one round only, or paid for at long context, is not a reason
    once = _context_run(8, [[1250, 1100, 1100], [3380] * 3], [[1153, 1100, 1100], [3380] * 3])
    costly = _context_run(8, [[1250] * 3, [3000] * 3], [[1153] * 3, [3300] * 3])
    assert default_claim([once], device="cpu").held and default_claim([costly], device="cpu").held
    assert WORTH_A_KEY > 1
