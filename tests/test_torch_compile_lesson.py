"""Notebook 03's claims: each holds on data like the real case and fails when the data says
otherwise (timings swapped, a bound exceeded, a range that straddles its target).

The steady-state tables are synthetic: the committed recording predates the rounds; they carry
figures like the H200's (a host-bound block: wall ~190-270 us per call, GPU kernels ~30 us).
"""
import logging
import sys
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from labkit.lessons.torch_compile import claims as cl
from labkit.lessons.torch_compile import cold_start as cs
from labkit.lessons.torch_compile import modes as md
from labkit.measure.rounds import Rounds, Spread


def steady(rounds: dict[str, list[float]], gpu: dict[str, float] | None = None,
           kernels: dict[str, int] | None = None) -> pd.DataFrame:
    rows = [{"mode": m, "wall_us": Spread.of(v).median, "wall_low_us": min(v),
             "wall_high_us": max(v), "wall_rounds_us": v,
             "gpu_kernel_us": (gpu or {}).get(m), "kernels": (kernels or {}).get(m)}
            for m, v in rounds.items()]
    return pd.DataFrame(rows)


H200_ROUNDS = {"eager": [209.5, 212.0, 207.1, 214.3, 210.2],
               "default": [272.6, 270.1, 275.3, 268.8, 273.0],
               "reduce-overhead": [190.4, 192.2, 188.9, 191.0, 193.5],
               "max-autotune": [186.6, 191.9, 185.2, 189.3, 190.1]}
H200_GPU = {"eager": 31.0, "default": 29.5, "reduce-overhead": 29.4, "max-autotune": 28.9}
H200_KERNELS = {"eager": 10, "default": 5, "reduce-overhead": 5, "max-autotune": 5}


def h200(**changes):
    rounds = {**H200_ROUNDS, **changes.get("rounds", {})}
    return steady(rounds, {**H200_GPU, **changes.get("gpu", {})},
                  {**H200_KERNELS, **changes.get("kernels", {})})


# --- steady state ----------------------------------------------------------------------------
def test_steady_claims_hold_on_a_host_bound_gpu_table_and_say_default_is_slower():
    made = cl.steady_claims(h200(), device="NVIDIA H200")
    assert len(made) == 4 and all(c.held for c in made), [str(c) for c in made]
    host, default_vs_eager, _, _ = made
    assert "measure host work" in host.text
    assert "default is slower than eager in every round" in default_vs_eager.text
    assert "max-autotune ≈ reduce-overhead < eager < default" in host.text


def test_steady_claims_fail_when_the_gpu_kernels_fill_the_call():
    gpu_bound = {m: 0.9 * min(v) for m, v in H200_ROUNDS.items()}
    host, default_vs_eager, _, _ = cl.steady_claims(h200(gpu=gpu_bound), device="NVIDIA H200")
    assert not host.held and not default_vs_eager.held


def test_graph_modes_near_their_kernel_time_are_named_and_a_kernel_longer_than_the_call_fails():
    fast_replay = {"reduce-overhead": [40.0, 41.0, 39.5, 40.2, 40.8]}
    host = cl.steady_claims(h200(rounds=fast_replay), device="NVIDIA H200")[0]
    assert host.held and "for reduce-overhead the kernels take a larger share" in host.text
    too_long = cl.steady_claims(h200(gpu={"max-autotune": 400.0}), device="NVIDIA H200")[0]
    assert not too_long.held


def test_graph_replay_claim_fails_with_default_and_reduce_overhead_swapped():
    swapped = {"default": H200_ROUNDS["reduce-overhead"],
               "reduce-overhead": H200_ROUNDS["default"]}
    assert not cl.steady_claims(h200(rounds=swapped), device="NVIDIA H200")[-1].held


def test_graph_replay_claim_fails_when_one_round_disagrees():
    ro = list(H200_ROUNDS["reduce-overhead"])
    ro[2] = 280.0  # one round slower than default's 275.3
    assert not cl.steady_claims(h200(rounds={"reduce-overhead": ro}), device="x")[-1].held


def test_kernel_count_claim_fails_when_compiling_adds_kernels():
    claims = cl.steady_claims(h200(kernels={"default": 12}), device="NVIDIA H200")
    assert not claims[2].held


def test_the_recorded_order_is_told_as_it_was_measured_not_as_the_live_run_found_it():
    # the committed recording's figures: eager slowest, reduce-overhead fastest
    recorded = {"eager": [341, 335, 350], "default": [274, 270, 280],
                "reduce-overhead": [117, 115, 120], "max-autotune": [159, 155, 162]}
    made = cl.steady_claims(steady(recorded, H200_GPU, H200_KERNELS), device="NVIDIA H200")
    assert "default is faster than eager in every round" in made[1].text
    assert made[0].text.count("<") == 3 and all(c.held for c in made)


def test_cpu_steady_claim_orders_only_what_the_rounds_separate_and_fails_on_a_negative_time():
    same = steady({"eager": [50, 52, 49], "default": [51, 48, 53]})
    (c,) = cl.steady_claims(same, device="this CPU")
    assert c.held and ("eager ≈ default" in c.text or "default ≈ eager" in c.text)
    (bad,) = cl.steady_claims(steady({"eager": [50, -3, 49], "default": [51, 48, 53]}),
                              device="this CPU")
    assert not bad.held


def test_verdict_and_order_follow_the_ranges():
    assert "faster" in cl.verdict("a", Spread.of([1.2, 1.3, 1.1]), "b")
    assert "slower" in cl.verdict("a", Spread.of([0.8, 0.9, 0.7]), "b")
    assert "cannot order" in cl.verdict("a", Spread.of([0.9, 1.1, 1.0]), "b")
    assert cl.order(steady({"a": [1, 2], "b": [3, 4]})) == "a < b"
    assert cl.order(steady({"a": [1, 3.5], "b": [3, 4]})) == "a ≈ b"


# --- starts and repaying the compile ---------------------------------------------------------
def starts(**cold_warm):
    return {m: {"cold": Spread.of(c), "warm cache": Spread.of(w)} for m, (c, w) in cold_warm.items()}


GPU_STARTS = starts(default=([6.1, 6.4, 6.0], [1.9, 2.1, 2.0]),
                    **{"reduce-overhead": ([6.5, 6.3, 6.8], [2.2, 2.0, 2.1]),
                       "max-autotune": ([24.0, 26.5, 25.1], [3.1, 3.3, 3.0])})


def test_cold_start_claims_hold_when_the_warm_cache_is_faster_and_autotune_slowest():
    made = cl.cold_start_claims(GPU_STARTS, device="NVIDIA H200")
    assert len(made) == 2 and all(c.held for c in made)


def test_cold_start_claims_fail_with_cold_and_warm_swapped():
    swapped = {m: {"cold": s["warm cache"], "warm cache": s["cold"]} for m, s in GPU_STARTS.items()}
    assert not cl.cold_start_claims(swapped, device="x")[0].held


def test_autotune_claim_fails_when_its_cold_start_overlaps_defaults():
    overlap = {**GPU_STARTS, "max-autotune": GPU_STARTS["default"]}
    assert not cl.cold_start_claims(overlap, device="x")[1].held


def test_a_repay_count_is_claimed_only_where_the_saving_clears_zero_in_every_round():
    made, notes = cl.repay_claims(h200(), GPU_STARTS, device="NVIDIA H200")
    # default is slower than eager: no count; both graph modes save in every round
    named = {c.values["mode"] for c in made}
    assert named == {"reduce-overhead", "max-autotune"} and all(c.held for c in made)
    assert any(n.startswith("default: no repay count") for n in notes)
    ro = next(c for c in made if c.values["mode"] == "reduce-overhead")
    assert ro.values["lo"] <= ro.values["n"] <= ro.values["hi"]


def test_no_repay_count_when_the_saving_straddles_zero():
    close = {"reduce-overhead": [208.0, 215.0, 206.0, 213.0, 211.0]}
    made, notes = cl.repay_claims(h200(rounds=close), GPU_STARTS, device="x")
    assert "reduce-overhead" not in {c.values["mode"] for c in made}
    assert any(n.startswith("reduce-overhead: no repay count") for n in notes)


def test_compile_cost_claim_fails_when_the_first_call_is_as_cheap_as_a_few_calls():
    assert cl.compile_cost_claim(Spread.of([6.0]), Spread.of([270, 280]), device="x").held
    assert not cl.compile_cost_claim(Spread.of([0.001]), Spread.of([270, 280]), device="x").held


def test_cold_start_spreads_and_summary_from_a_starts_table():
    df = pd.DataFrame([{"round": r, "mode": "default", "start": k, "first_call_s": v,
                        "process_s": v + 4, "rest_of_process_s": 4.0}
                       for r, (c, w) in enumerate([(15.0, 2.0), (16.0, 2.5), (14.0, 2.2)])
                       for k, v in (("cold", c), ("warm cache", w))])
    s = cs.spreads(df)["default"]
    assert s["cold"].median == 15.0 and s["warm cache"].high == 2.5
    assert list(cs.summary(df).rounds) == [3, 3]


def test_chains_run_side_by_side_yet_each_warm_start_follows_its_own_cold_one(monkeypatch):
    """Two chains at once (the fresh processes stubbed): every warm start is handed its own
    chain's cache folder after the cold start in it returned, rows come out in round order, and
    the two chains overlapped in time."""
    import threading
    import time as clock

    events, lock = [], threading.Lock()

    def fake_start(mode, cache, **kw):
        with lock:
            events.append(("begin", cache))
        clock.sleep(0.2)
        with lock:
            events.append(("end", cache))
        return {"first_call_s": 1.0, "process_s": 2.0, "rest_of_process_s": 1.0}
    monkeypatch.setattr(cs, "start", fake_start)
    t0 = clock.perf_counter()
    df = cs.cold_and_warm(["default"], dim=8, hidden=8, tokens=2, device="cpu",
                          dtype="float32", rounds=2, parallel=2)
    assert clock.perf_counter() - t0 < 0.7, "two chains of 2 x 0.2 s ran one after another"
    assert list(zip(df["round"], df.start)) == [(0, "cold"), (0, "warm cache"),
                                               (1, "cold"), (1, "warm cache")]
    assert set(df.parallel) == {2}
    for folder in {c for _, c in events}:  # per chain: begin, end (cold), begin, end (warm)
        assert [e for e, c in events if c == folder] == ["begin", "end", "begin", "end"]
    with pytest.raises(ValueError, match="parallel"):
        cs.cold_and_warm(["default"], dim=8, hidden=8, tokens=2, device="cpu",
                         dtype="float32", parallel=0)
    assert cs.default_parallel(6) >= 1 and cs.default_parallel(1) == 1


def test_a_fresh_process_that_fails_says_which_mode_and_why():
    with pytest.raises(RuntimeError, match="mode 'turbo' failed"):
        cs.start("turbo", "/tmp/labkit_unused_cache", dim=8, hidden=8, tokens=2, device="cpu",
                 dtype="float32")


# --- guards and dynamic=True -----------------------------------------------------------------
def guard_table(eager, one, many):
    return steady({"eager": eager, "compiled, 1 graph cached": one,
                   "compiled, 8 graphs cached": many})


def test_guard_claims_hold_on_an_entry_cost_and_no_resolvable_cost_of_more_entries():
    made = cl.guard_claims(guard_table([2.3, 2.4, 2.2], [17.0, 18.1, 16.5], [17.5, 17.9, 16.2]),
                           8, device="this CPU")
    assert all(c.held for c in made) and "resolve no cost" in made[1].text
    # the eager backend leaves the whole compiled entry to time, not the guard check alone
    assert "not the guard check alone" in made[0].text


def test_more_with_many_graphs_is_said_only_when_every_round_is_a_percent_above():
    # the H200 reading: 1.01x (1.00-1.03): "more in every round" beside a 1.00 read as noise
    made = cl.guard_claims(guard_table([2.3, 2.4, 2.2], [17.0, 17.0, 17.0], [17.05, 17.2, 17.5]),
                           8, device="x")
    assert made[1].held and "more in every round" not in made[1].text
    made = cl.guard_claims(guard_table([2.3, 2.4, 2.2], [17.0, 17.0, 17.0], [17.4, 17.6, 17.9]),
                           8, device="x")
    assert "more in every round" in made[1].text


def test_guard_claims_fail_with_eager_and_compiled_swapped():
    made = cl.guard_claims(guard_table([17.0, 18.1, 16.5], [2.3, 2.4, 2.2], [2.3, 2.4, 2.2]),
                           8, device="x")
    assert not made[0].held


def test_many_cached_graphs_are_never_claimed_cheaper_than_one():
    # the H200 reading: 8 graphs 19.7 against 1 graph 26.0, in every round
    made = cl.guard_claims(guard_table([2.3, 2.4, 2.2], [26.0, 25.5, 26.4], [19.7, 20.1, 19.5]),
                           8, device="x")
    assert not made[1].held


def test_dynamic_claim_holds_when_static_is_as_fast_and_fails_when_dynamic_wins_clearly():
    ok = steady({"static": [112.0, 108.0, 115.0], "dynamic=True": [118.0, 121.0, 117.0]})
    (c,) = cl.dynamic_claims(ok, device="this CPU")
    assert c.held and "static is faster than dynamic=True in every round" in c.text
    wins = steady({"static": [112.0, 108.0, 115.0], "dynamic=True": [80.0, 82.0, 79.0]})
    assert not cl.dynamic_claims(wins, device="x")[0].held


# --- bookkeeping claims ----------------------------------------------------------------------
def test_pipeline_claims_fail_on_more_launches_than_eager_or_a_wrong_result():
    stage = SimpleNamespace(kernels=["k0", "k1", "k2"], extern_calls=["addmm", "addmm"],
                            language="C++", max_abs_err=2e-7)
    assert all(c.held for c in cl.pipeline_claims(stage, ["op"] * 10, 1e-4))
    fusion, numerics = cl.pipeline_claims(
        SimpleNamespace(**{**vars(stage), "max_abs_err": 0.5}), ["op"] * 4, 1e-4)
    assert not fusion.held and not numerics.held


def test_break_claims_fail_when_a_fix_still_breaks():
    rows = [{"example": e, "version": v, "graphs": 2 if v == "broken" else 1,
             "breaks": 1 if v == "broken" else 0} for e in "ab" for v in ("broken", "fixed")]
    assert cl.break_claims(pd.DataFrame(rows))[0].held
    rows[-1].update(graphs=2, breaks=1)
    assert not cl.break_claims(pd.DataFrame(rows))[0].held


def report(compiles, fallbacks=0, ran_as=(4,)):
    return SimpleNamespace(compiles=compiles, eager_fallbacks=fallbacks, max_abs_err=0.0,
                           calls=pd.DataFrame({"ran_as": list(ran_as)}))


def test_recompile_claims_fail_when_static_stops_at_the_wrong_count():
    good = {"static": report(8, 8), "dynamic": report(2), "buckets": report(3, 0, (4, 8, 16, 4))}
    assert all(c.held for c in cl.recompile_claims(good, 16, 8))
    bad = {**good, "static": report(16, 0)}
    assert not cl.recompile_claims(bad, 16, 8)[0].held


def test_reduce_overhead_claims_hold_on_the_recording_and_fail_when_the_clone_is_wrong():
    from labkit.tools import recorded
    rec = recorded.load("torch_compile", "recompiles")
    over, mut = rec.data["output_overwritten"], rec.data["mutated_input"]
    assert all(c.held for c in cl.reduce_overhead_claims(over, mut, recorded=rec))
    broken = cl.reduce_overhead_claims({**over, "clone_is_right": False},
                                       {**mut, "functional_skipped": True}, recorded=rec)
    assert not any(c.held for c in broken)


def test_recorded_claims_name_the_fields_the_recording_lacks(capsys):
    from labkit.tools import recorded
    rec = recorded.load("torch_compile", "recompiles")
    made = cl.recorded_claims(rec)
    missing = [k for k in cl.RECORDED_FIELDS if k not in rec.data]
    if missing:
        assert str(missing) in capsys.readouterr().out
    assert all(c.held for c in made)


# --- measurement helpers ---------------------------------------------------------------------
def test_the_autotune_log_is_kept_and_everything_else_on_stderr_still_shows(capsys, caplog):
    with md.autotune_log_kept() as log:
        sys.stderr.write("AUTOTUNE addmm(8x2048, 2048x8192)\nstrides: [2048, 1]\n")
        sys.stderr.write("  triton_mm_1 0.0123 ms 100.0% BLOCK_M=16\n")
        sys.stderr.write("a warning the learner must see\n")
        logging.getLogger("torch._dynamo").warning("torch._dynamo hit config.recompile_limit (8)")
    assert len(log) == 3 and log[0].startswith("AUTOTUNE")
    assert "a warning the learner must see" in capsys.readouterr().err
    assert "recompile_limit" in caplog.text


def test_max_autotune_keeps_its_table_and_writes_no_choices_stats(capsys):
    """Inductor autotunes on a CPU too, given frozen weights and its C++ GEMM template: the
    same code path that writes "Autotune Choices Stats" to stderr on a GPU."""
    from torch._inductor import config as inductor_config
    torch._dynamo.reset()
    fn = torch.compile(torch.nn.Linear(16, 16), mode="max-autotune")
    cpu_autotune = inductor_config.patch(freezing=True, force_disable_caches=True,
                                         max_autotune_gemm_backends="CPP,ATEN")
    with torch.no_grad(), cpu_autotune, md.autotune_log_kept() as log:
        fn(torch.randn(4, 16))
    torch._dynamo.reset()
    assert any(line.startswith("AUTOTUNE ") for line in log), f"nothing was autotuned: {log}"
    err = capsys.readouterr().err
    assert "Choices Stats" not in err and "num_choices" not in err, err[-2000:]


def test_steady_state_times_eager_and_default_in_rounds_without_recompiling():
    torch._dynamo.reset()
    from labkit.lessons.torch_compile.pipeline import BlockConfig, make_block
    block, x = make_block(BlockConfig(16, 32)), torch.randn(4, 16)
    s = md.steady_state(block, x, ("default",), rounds=3, repeats=3)
    t = s.table()
    assert list(t["mode"]) == ["eager", "default"] and (t.wall_low_us > 0).all()
    assert all(len(r) == 3 for r in t.wall_rounds_us) and t.gpu_kernel_us.isna().all()
    assert s.max_abs_err["default"] < 1e-5


def test_guard_rounds_time_each_case_per_call():
    t = md.wall_table(md.guard_rounds(entries=3, rounds=3, repeats=3))
    assert list(t["mode"]) == ["eager", "compiled, 1 graph cached", "compiled, 3 graphs cached"]
    assert (t.wall_low_us > 0).all()


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        md.compiled(lambda x: x, "turbo")


def test_recorded_claims_read_what_the_recorder_writes():
    """The recorder's JSON (a Steady table, a starts table, as json_columns) read back by the
    claims: every claim of a host-bound GPU recording holds, each labelled with the recording."""
    import inspect
    import json

    from labkit.lessons.torch_compile import recompiles as rc
    from labkit.tools.recorded import Recorded, json_columns

    source = inspect.getsource(rc.record)
    assert all(f'"{k}"' in source for k in cl.RECORDED_FIELDS), "record() writes every field"
    rounds = {m: tuple(SimpleNamespace(median_us=v) for v in vs) for m, vs in H200_ROUNDS.items()}
    gpu = {m: {"gpu_busy_us": H200_GPU[m], "kernel_count": H200_KERNELS[m]} for m in H200_ROUNDS}
    steady_run = md.Steady(Rounds(rounds, ()), gpu, {m: 1.0 for m in rounds}, {})
    dyn_rounds = {"static": tuple(SimpleNamespace(median_us=v) for v in (272.0, 270.0, 275.0)),
                  "dynamic=True": tuple(SimpleNamespace(median_us=v) for v in (280.0, 279.0, 284.0))}
    dyn_run = md.Steady(Rounds(dyn_rounds, ()), {"static": gpu["default"],
                                                     "dynamic=True": gpu["default"]}, {}, {})
    starts_df = pd.DataFrame([{"round": r, "mode": m, "start": k, "first_call_s": v,
                               "process_s": v + 5, "rest_of_process_s": 5.0}
                              for m, sp in GPU_STARTS.items() for k in ("cold", "warm cache")
                              for r, v in enumerate(sp[k].values)])
    data = json.loads(json.dumps({"steady": md.steady_record(steady_run),
                                  "dynamic": md.steady_record(dyn_run),
                                  "cold_starts": json_columns(starts_df)}))
    from labkit.tools import recorded
    fp = recorded.load("torch_compile", "recompiles").fingerprint  # an H200 fingerprint, as committed
    rec = Recorded("torch_compile", data, fp, "2026-12-01", "make record")
    made = cl.recorded_claims(rec)
    assert len(made) >= 8 and all(c.held for c in made), [str(c) for c in made if not c.held]
    assert all(c.source == rec.label for c in made)


def test_the_recompile_limit_warning_is_printed_as_text_not_dropped(capsys):
    from labkit.lessons.torch_compile import recompiles as rcm

    limit = rcm.recompile_limit()
    sizes = list(range(2, limit + 5))  # more distinct sizes than the limit: Dynamo warns
    report = rcm.run_shapes(lambda x: x * 2 + 1, sizes, "static",
                            lambda n: torch.ones(n, 3))
    out = capsys.readouterr()
    assert report.eager_fallbacks > 0
    assert "Dynamo warned" in out.out and "recompile_limit" in out.out, out.out
    assert "recompile_limit" not in out.err
    import logging
    assert not any(type(h).__name__ == "_Print" for h in logging.getLogger("torch._dynamo").handlers)
