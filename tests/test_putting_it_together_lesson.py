"""Notebook 08's claims (labkit.lessons.putting_it_together.claims), notebook 08a's padding
claims (padding_claims) and the measurements under them: each claim holds on the committed recording, on a live CPU run or on a synthetic input
that stands for the GPU case, and fails when the input is perturbed (two timings swapped, a
bound exceeded, a row that did not pass). Also the warm-up and first-token computations the
experiment's table rests on."""
import dataclasses
import itertools

import pandas as pd
import pytest
import torch

import labkit  # noqa: F401  (interpreter on before triton is imported, where there is no GPU)
from labkit.engine import LLM, ModelConfig, random_model
from labkit.lessons.putting_it_together import claims as pc
from labkit.lessons.putting_it_together import engine_steps as steps
from labkit.lessons.putting_it_together import experiment as ex
from labkit.lessons.putting_it_together import padding
from labkit.lessons.putting_it_together import padding_claims as padc
from labkit.lessons.putting_it_together import first_token as ft
from labkit.lessons.putting_it_together import peers
from labkit.tools import recorded

CPU = torch.device("cpu")
SMALL = ex.Workload(num_requests=4, prompt_len=(3, 16), output_len=(2, 6), seed=3)


@pytest.fixture(scope="module")
def tiny_model():
    return random_model(ModelConfig.tiny(), seed=0, device=CPU)


@pytest.fixture(scope="module")
def cpu_experiment(tiny_model):
    return ex.run_experiment(tiny_model, SMALL, skip=ex.slow_here(CPU), rounds=3)


@pytest.fixture(scope="module")
def rec():
    return recorded.load("putting_it_together", "experiment")


def _copy(exp, changes: dict):
    """The experiment with ``{(backend, mode, column): value}`` changed in its table."""
    t = exp.table.copy()
    for (backend, mode, col), value in changes.items():
        t.loc[(t.backend == backend) & (t["mode"] == mode), col] = value
    return dataclasses.replace(exp, table=t)


# ------------------------------------------------------------------------------ warm-up
def test_warmup_is_the_first_runs_time_above_the_slowest_steady_run():
    assert ex.warmup_s(3.0, [1.0, 1.2, 1.1]) == pytest.approx(1.8)
    assert ex.warmup_s(1.0, [0.9, 1.2, 1.1]) == 0.0, "inside the steady range: nothing to tell"
    assert ex.warmup_s(0.5, [1.0, 1.0]) == 0.0, "never negative"


def test_a_first_run_faster_than_the_steady_runs_gives_no_negative_warmup(tiny_model,
                                                                          monkeypatch):
    # The first run of every row beats its steady run (a row warmed up by an earlier one, a
    # noisy machine): first - median(steady) made warm-up times negative.
    real, seconds = ex.timed_generate, itertools.cycle([0.5, 1.0])

    def timed(llm, prompts, params):
        return dataclasses.replace(real(llm, prompts, params), seconds=next(seconds))

    monkeypatch.setattr(ex, "timed_generate", timed)
    t = ex.run_experiment(tiny_model, SMALL, backends=["sdpa", "reference"], modes=("eager",),
                          rounds=3).table
    assert (t.warmup_s == 0.0).all(), t[["backend", "warmup_s"]]
    seconds = itertools.cycle([3.0, 1.0])  # a cold first run: its extra time is the warm-up
    t = ex.run_experiment(tiny_model, SMALL, backends=["sdpa"], modes=("eager",), rounds=3).table
    assert t.warmup_s.iloc[0] == pytest.approx(2.0)


# ------------------------------------------------------------------------------ rounds
def test_every_row_runs_in_every_round_in_a_fresh_shuffled_order(cpu_experiment):
    r = cpu_experiment.rounds
    ran = cpu_experiment.table[cpu_experiment.table.status == "ran"]
    assert (ran["rounds"] == 3).all() and len(r) == 3 * len(ran)
    orders = [tuple(g.sort_values("position").backend) for _, g in r.groupby("round")]
    assert len(set(orders)) > 1, f"every round ran the rows in the same order: {orders}"
    for _, row in ran.iterrows():
        assert row.decode_step_low_ms <= row.decode_step_ms <= row.decode_step_high_ms
        assert row.steady_low_s <= row.steady_run_s <= row.steady_high_s


# ------------------------------------------------------------------------------ first token
def _truth(top, second, tie):
    logits = torch.zeros(8)
    logits[top], logits[second] = 1.0, 1.0 - tie / 4  # second is a near-tie at band `tie`
    return {"token": top, "logits": logits, "tie": tie}


def test_a_near_tie_counts_as_the_right_first_token_and_a_far_token_does_not():
    truth = [_truth(3, 5, 0.2), _truth(1, 2, 0.2)]
    assert ft.first_token_check([[3], [1]], truth) == (1.0, 0)
    assert ft.first_token_check([[5], [1]], truth) == (1.0, 1), "within the band: a near-tie"
    assert ft.first_token_check([[0], [1]], truth) == (0.5, 0), "a logit 1.0 below: wrong"
    exact = [_truth(3, 5, 0.2) | {"tie": 0.0}]  # 5 is 0.05 below: a tie only in bf16
    assert ft.first_token_check([[5]], exact) == (0.0, 0), "float32: no band, exact match"


def test_the_float32_truth_has_no_band_and_a_bf16_model_has_one(tiny_model):
    prompts = SMALL.requests(tiny_model.config.vocab_size)[0][:2]
    assert all(t["tie"] == 0.0 for t in ft.first_token_truth(tiny_model, prompts))
    half = random_model(ModelConfig.tiny(), seed=0, device=CPU, dtype=torch.bfloat16)
    assert all(t["tie"] > 0 for t in ft.first_token_truth(half, prompts))


def test_a_row_with_wrong_first_tokens_does_not_pass_and_is_left_out(tiny_model, monkeypatch):
    real = ex.first_token_check

    def wrong_for_sdpa(tokens, truth):  # the sdpa row is checked first: make it fail
        wrong_for_sdpa.calls += 1
        return (0.5, 0) if wrong_for_sdpa.calls == 1 else real(tokens, truth)
    wrong_for_sdpa.calls = 0

    monkeypatch.setattr(ex, "first_token_check", wrong_for_sdpa)
    e = ex.run_experiment(tiny_model, SMALL, backends=["sdpa", "reference"], modes=("eager",))
    t = e.table.set_index("backend")
    assert not t.loc["sdpa", "passed"] and t.loc["reference", "passed"]
    assert list(e.conclusive.backend) == ["reference"]
    assert "sdpa/eager" in pc.first_token_claim(e, "cpu").text


# ------------------------------------------------------------------------------ claims
def test_rows_claim_holds_live_and_fails_with_too_few_rounds_or_no_reason(cpu_experiment):
    assert pc.rows_claim(cpu_experiment, "cpu").held
    assert not pc.rows_claim(_copy(cpu_experiment, {("sdpa", "eager", "rounds"): 1}),
                             "cpu").held
    assert not pc.rows_claim(_copy(cpu_experiment, {("triton", "eager", "reason"): ""}),
                             "cpu").held
    no_rounds = _copy(cpu_experiment, {})
    no_rounds.table.loc[no_rounds.table.backend == "sdpa", "rounds"] = pd.NA
    assert not pc.rows_claim(no_rounds, "cpu").held, "a row with no rounds recorded: not 3"


def test_first_token_claim_fails_when_auto_or_the_reference_did_not_pass(cpu_experiment):
    assert pc.first_token_claim(cpu_experiment, "cpu").held
    for backend in ("auto", "reference"):
        broken = _copy(cpu_experiment, {(backend, "eager", "passed"): False})
        c = pc.first_token_claim(broken, "cpu")
        assert not c.held and f"{backend}/eager" in c.text
    sdpa_failed = _copy(cpu_experiment, {("sdpa", "eager", "passed"): False})
    assert pc.first_token_claim(sdpa_failed, "cpu").held, "a peer that fails is named, excluded"


def _gpu_experiment(eager_ms=(14.0, 18.0, 13.0), graph_ms=(2.3, 2.4, 2.3)):
    """The triton rows of a GPU run, as the experiment builds them (three rounds)."""
    base = dict.fromkeys(ex.COLUMNS, float("nan")) | {"status": "ran", "passed": True,
                                                      "backend": "triton", "reason": ""}
    rows = [base | {"mode": mode, "rounds": 3, "decode_step_ms": sorted(v)[1],
                    "decode_step_low_ms": min(v), "decode_step_high_ms": max(v),
                    "graphs": g, "capture_ms": 120.0, "capture_low_ms": 110.0,
                    "capture_high_ms": 236.0, "steps": 45, "graph_steps": gs}
            for mode, v, g, gs in (("eager", eager_ms, 0, 0), ("graph", graph_ms, 5, 43))]
    rounds = pd.DataFrame([{"round": r, "backend": "triton", "mode": m, "decode_step_ms": v[r]}
                           for m, v in (("eager", eager_ms), ("graph", graph_ms))
                           for r in range(3)])
    return ex.Experiment(pd.DataFrame(rows, columns=ex.COLUMNS), {}, {}, {"num_requests": 16},
                         rounds)


def test_graph_claims_hold_per_round_and_fail_when_one_round_is_swapped():
    made = pc.graph_claims(_gpu_experiment(), "H200")
    assert len(made) == 2 and all(c.held for c in made)
    assert "110.0-236.0" in made[0].text, "the capture time shows its range"
    one_swapped = pc.graph_claims(_gpu_experiment(eager_ms=(14.0, 2.0, 13.0),
                                                  graph_ms=(2.3, 18.0, 2.3)), "H200")
    assert not one_swapped[1].held, "a median that clears it while one round does not: noise"
    every_step = _gpu_experiment()
    every_step.table.loc[every_step.table["mode"] == "graph", "graph_steps"] = 45
    assert not pc.graph_claims(every_step, "H200")[0].held


def test_graph_claims_are_not_made_from_rows_that_did_not_pass():
    e = _gpu_experiment()
    e.table.loc[e.table["mode"] == "eager", "passed"] = False
    assert pc.graph_claims(e, "H200") == []


def test_timeline_claim_holds_on_the_recording_and_fails_without_replays_or_overlap(rec):
    numbers = rec.data["trace_numbers"]
    assert pc.timeline_claim(numbers, "H200", recorded=rec).held
    assert not pc.timeline_claim(numbers | {"graph_launches": 0}, "H200", recorded=rec).held
    assert not pc.timeline_claim(numbers | {"h2d_overlapping_compute": 0}, "H200",
                                 recorded=rec).held


def test_the_cpu_timeline_claim_fails_on_a_missing_step():
    numbers = {"steps": 4, "cpu_busy_fraction": 0.4}
    assert pc.timeline_claim(numbers, "cpu", expected_steps=4).held
    assert not pc.timeline_claim(numbers, "cpu", expected_steps=5).held
    assert not pc.timeline_claim(numbers | {"cpu_busy_fraction": 1.0}, "cpu",
                                 expected_steps=4).held


def test_padding_claim_agrees_with_the_scheduler_and_fails_on_another_count():
    w = ex.Workload(num_requests=24, prompt_len=(4, 40), output_len=(2, 30), seed=5)
    seen = padding.decode_batches(padding.simulate_schedule(w))
    costs = padding.bucket_costs(seen, padding.bucket_sets(seen))
    sched = padding.simulate_schedule(w, padding.bucket_sets(seen)["powers of two"]).padded_rows.sum()
    assert pc.padding_claim(costs, sched, 24).held
    assert not pc.padding_claim(costs, sched + 1, 24).held


def test_simulation_claim_holds_live_and_fails_on_another_step_count(cpu_experiment):
    n = len(padding.simulate_schedule(SMALL))
    assert pc.simulation_claim(cpu_experiment, n).held
    assert not pc.simulation_claim(cpu_experiment, n + 1).held


SERVER = ex.Workload(num_requests=48, prompt_len=(4, 40), output_len=(3, 60), seed=2)


@pytest.fixture(scope="module")
def server():
    """A server-sized workload's decode batches and bucket sets, and the padding they count."""
    seen, costs = padding.padding_study(SERVER)
    return seen, padding.bucket_sets(seen), costs


def test_shrink_claim_holds_on_the_schedule_and_fails_when_a_batch_grows(server):
    seen, _, _ = server
    assert padc.shrink_claim(seen).held
    grown = [*seen[:5], seen[4] + 1, *seen[5:]]
    assert not padc.shrink_claim(grown).held, "a batch that grows mid-run: not this workload"
    assert not padc.shrink_claim([seen[0]] * 4).held, "a batch that never shrinks"


def test_planner_claim_holds_and_fails_when_a_smaller_set_pads_fewer_rows(server):
    _, sets, costs = server
    assert padc.planner_claim(costs, sets).held
    beaten = costs.copy()
    beaten.loc[beaten.buckets == "max only", "padded_rows"] = 0
    assert not padc.planner_claim(beaten, sets).held


def test_bound_claims_hold_for_their_sets_and_fail_for_coarser_buckets(server):
    seen, sets, _ = server
    assert all(c.held for c in padc.bound_claims(seen, sets))
    coarse = sets | {"powers of two": sets["max only"], "vLLM default sizes": sets["1, 8, max"]}
    pow2, vllm = padc.bound_claims(seen, coarse)
    assert not pow2.held and not vllm.held


def test_schedule_claim_holds_for_the_engines_batches_and_fails_on_another_plan(tiny_model):
    llm = LLM(tiny_model, **ex.engine_options(SMALL))
    llm.generate(*SMALL.requests(tiny_model.config.vocab_size))
    engine = padding.decode_batches(llm.history_table())
    planned = padding.decode_batches(padding.simulate_schedule(SMALL))
    assert padc.schedule_claim(engine, planned, SMALL.num_requests, "cpu").held
    assert not padc.schedule_claim(engine, planned[:-1] + [planned[-1] + 1], 4, "cpu").held
    assert not padc.schedule_claim(engine, planned, 4, "H200", 73, 72).held, \
        "the graph pool padded other rows than the plan"


def _times(g128=(2.9, 3.0, 3.1), g256=(3.7, 3.7, 3.8), eager_gpu=3.6):
    rows = []
    for b, g in ((64, (2.5, 2.5, 2.6)), (128, g128), (256, g256)):
        rows.append({"batch": b, "eager_ms": 15.0, "eager_low_ms": 14.5, "eager_high_ms": 16.0,
                     "graph_ms": sorted(g)[1], "graph_rounds_ms": list(g),
                     "eager_gpu_ms": eager_gpu})
    return pd.DataFrame(rows)


def test_step_time_claims_hold_and_each_fails_on_its_perturbation():
    times = _times()
    seen = [200, 150, 129, 100, 70, 3]
    sets = {"one per size": tuple(range(1, 257)), "powers of two": (64, 128, 256),
            "max only": (256,)}
    priced = padding.bucket_costs(seen, sets, times)
    made = padc.step_time_claims(times, priced, "H200", 512)
    assert len(made) == 3 and all(c.held for c in made), [c.text for c in made]
    doubled = padc.step_time_claims(_times(g256=(5.9, 6.0, 6.2)), None, "H200", 512)
    assert not doubled[0].held, "256 rows at twice the time of 128: padding costs its rows"
    gpu_bound = padc.step_time_claims(_times(eager_gpu=14.0), None, "H200", 512)
    assert not gpu_bound[1].held, "an eager step whose kernels fill its wall time is not host-bound"
    swapped = priced.set_index("buckets")
    swapped.loc[["powers of two", "max only"], "padding_share"] = \
        swapped.loc[["max only", "powers of two"], "padding_share"].values
    swapped = swapped.reset_index()
    assert not padc.step_time_claims(times, swapped, "H200", 512)[2].held


def test_the_eager_claim_says_how_many_kernels_and_the_host_time_of_each():
    times = _times().assign(eager_kernels=214, host_us_per_kernel=15.0e3 / 214)
    made = padc.step_time_claims(times, None, "H200", 512)[1]
    assert made.held and "214 kernels" in made.text and "70.1 us of host time" in made.text
    assert "kernels" not in padc.step_time_claims(_times(), None, "H200", 512)[1].text, \
        "a recording without the count says nothing of it"


def test_the_committed_recording_names_the_fields_its_claims_need(rec):
    lacking = pc.missing(rec.data, "rounds", "table.passed", "step_times.graph_rounds_ms",
                         "step_times.eager_gpu_ms", "trace_numbers")
    assert "trace_numbers" not in lacking
    if lacking:  # recorded before the experiment ran in rounds: the claims say what is missing
        assert set(lacking) <= {"rounds", "table.passed", "step_times.graph_rounds_ms",
                                "step_times.eager_gpu_ms"}


def test_peer_labels_follow_the_backends_declarations():
    from labkit.attention import BACKENDS
    notes = peers.peer_notes().set_index("backend")
    for name, b in BACKENDS.items():
        assert notes.loc[name, "notes"] == b.notes and notes.loc[name, "cuda_graphs"] == b.cuda_graphs
        limit = getattr(b, "limits", {}).get("CUDA Graph capture")
        if limit is not None:
            assert notes.loc[name, "graph capture limit"].startswith(limit.by)
    assert peers.slow_here(torch.device("cuda")) == {}, "on a GPU every backend is timed"
