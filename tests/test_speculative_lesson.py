"""Notebook 11's lesson code (labkit/lessons/speculative_decoding/) on the tiny model: what it times is
what it says (decode spans, full-length verifies), its tables agree with the engine's own
statistics, and its claims fall on the right side of made-up figures."""
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from labkit.engine import ModelConfig, random_model
from labkit.engine.speculative import expected_tokens_per_step
from labkit.lessons import speculative_decoding as sp
from labkit.lessons.speculative_decoding import measure
from labkit.teaching import reset_claims


@pytest.fixture(autouse=True)
def fresh_claims():
    reset_claims()
    yield
    reset_claims()


@pytest.fixture(scope="module")
def model():
    return random_model(ModelConfig.tiny(), seed=0)


def test_expected_table_is_the_geometric_sum():
    t = sp.expected_table(accepts=(0.5, 1.0), ks=(1, 4))
    assert t.loc[0.5, "k=1"] == 1.5 and t.loc[0.5, "k=4"] == pytest.approx(1.9375)
    assert t.loc[1.0, "k=4"] == 5


def test_tokens_per_step_groups_tokens_by_their_steps_time_stamp():
    out = SimpleNamespace(token_times_s=[0.1, 0.2, 0.2, 0.2, 0.3, 0.4, 0.4])
    assert sp.tokens_per_step(out) == [1, 3, 1, 2]
    # max_tokens 7, k 2: after 1 token room for 3 (counted), after 4 for 3 (counted), after 5
    # only 2: that verify could not propose all k, so it is left out
    assert sp.full_verifies(out, 2, 7) == [3, 1]


def test_decode_span_counts_the_tokens_after_prefill(model):
    llm = measure._engine(model, 2, acceptance=1.0, max_num_seqs=4, device="cpu")
    run = sp.decode_span(llm, sp.prompts_for(2, 8, 256), max_tokens=13)
    assert run["emitted"] == 2 * 12, "13 tokens each, the first from the prefill step"
    assert run["steps"] == 4, "12 tokens at 3 a verify step (every draft accepted)"
    assert run["proposed"] == 2 * 4 * 2
    assert run["tokens_per_s"] == pytest.approx(run["emitted"] / run["span_s"])


def test_the_controlled_draft_matches_the_formula_on_full_verifies(model):
    check = sp.acceptance_check(model, accepts=(0.5, 0.9), ks=(2,), device="cpu")
    assert (check.verifies > 200).all()
    assert ((check.tokens_per_verify / check.expected - 1).abs() < 0.1).all()
    assert sp.formula_claim(check).held


def test_step_costs_and_speedups_run_every_cell_and_keep_greedy_tokens(model):
    costs = sp.step_costs(model, batches=(1, 4), ks=(1, 4), max_tokens=12, rounds=2,
                          device="cpu")
    assert list(zip(costs.batch, costs.k)) == [(1, 1), (1, 4), (4, 1), (4, 4)]
    assert (costs.low <= costs.relative_cost).all() and (costs.relative_cost <= costs.high).all()
    speed = sp.speedups(model, accepts=(1.0,), ks=(4,), max_tokens=24, rounds=2, device="cpu",
                        versus_async=True)
    assert speed.same_tokens.all() and speed.tokens_per_forward.iloc[0] > 4
    assert (speed.versus_async_low <= speed.versus_async).all() and \
        (speed.versus_async <= speed.versus_async_high).all()
    row = speed.iloc[0]  # the ratios and the per-token times come from the same runs
    assert row.spec_ms_per_token < row.plain_ms_per_token and row.async_ms_per_token > 0
    # the largest k also runs speculating with async scheduling: its tokens are plain decoding's
    assert row.async_speedup_low <= row.async_speedup <= row.async_speedup_high
    assert row.async_same_tokens and row.async_spec_ms_per_token > 0
    # a = 1 keeps all four drafts wherever max_tokens leaves room, on either loop
    assert 4 < row.async_tokens_per_forward <= 5 and 4 < row.tokens_per_forward <= 5
    assert row.async_ms_per_token / row.async_spec_ms_per_token == \
        pytest.approx(row.async_speedup, rel=0.5)
    assert row.async_predicted == pytest.approx(row.expected_tokens / row.async_relative_cost)
    assert row.async_predicted == pytest.approx(row.async_speedup, rel=0.25), \
        "the periods' ratio predicts the async speed-up"
    assert row.plain_ms_per_token / row.spec_ms_per_token == pytest.approx(row.speedup, rel=0.5)
    assert "versus_async" not in sp.speedups(model, accepts=(1.0,), ks=(2,), max_tokens=8,
                                            rounds=1, device="cpu"), "off by default on a CPU"
    assert (costs.full_decode_share == 0).all() and (costs.full_verify_share == 0).all(), \
        "a CPU engine replays no full graph"
    assert "gpu_relative_cost" not in costs, "a CPU has no device clock"
    assert sp.graph_claim(costs, gpu=False, where="here").held
    assert speed.predicted.iloc[0] == pytest.approx(
        expected_tokens_per_step(1.0, 4) / speed.relative_cost.iloc[0])


def test_ngram_lookup_proposes_and_leaves_outputs_unchanged(model):
    table = sp.ngram_acceptance(model, k=3, batch=2, max_tokens=16, device="cpu")
    assert list(table.index) == [("model", "repeating passage"), ("model", "plain random")]
    assert table.same_tokens.all() and (table.accepted <= table.proposed).all()
    assert ((0 <= table.repeats) & (table.repeats <= 1)).all()
    assert sp.ngram_claim(table).held
    assert not sp.ngram_claim(table.assign(same_tokens=[True, False])).held


def test_lookup_hits_counts_the_tokens_an_earlier_ngram_predicts():
    # after [5, 6] lookup proposes 7, what followed them before (a hit); after [5, 6, 7] it
    # proposes 1 where 9 came (a miss); 9 never came before, so nothing for the last token
    assert sp.lookup_hits([5, 6, 7, 1, 5, 6], [7, 9, 2]) == 1
    assert sp.lookup_hits([1, 2, 3], [4, 5]) == 0
    assert sp.lookup_hits([3, 3], [3, 3, 3]) == 3
    assert sp.lookup_hits([], []) == 0


def test_lookup_models_adds_the_tiny_model_only_beside_another():
    tiny = random_model(ModelConfig.tiny(), seed=0)
    assert list(sp.lookup_models(tiny).values()) == [tiny]
    wider = random_model(ModelConfig.tiny(num_hidden_layers=1), seed=0)
    models = sp.lookup_models(wider)
    assert len(models) == 2 and list(models.values())[0] is wider
    assert list(models)[1].endswith(f"vocab {ModelConfig.tiny().vocab_size}")


def test_ngram_claim_needs_acceptance_to_follow_repetition():
    index = pd.MultiIndex.from_tuples([("a", "loops"), ("a", "plain")])
    table = pd.DataFrame({"verifies": [10, 2], "proposed": [30, 4], "accepted": [18, 0],
                          "acceptance": [0.6, 0.0], "tokens": [100, 100],
                          "repeats": [0.5, 0.01], "same_tokens": [True, True]}, index=index)
    assert sp.ngram_claim(table).held
    assert "loops on a: 50%" in sp.ngram_claim(table).text
    inverted = table.assign(acceptance=[0.2, 0.5], accepted=[6, 2])
    assert not sp.ngram_claim(inverted).held, "less accepted where the output repeats more"
    silent = table.assign(acceptance=[float("nan"), float("nan")], proposed=[0, 0],
                          accepted=[0, 0])
    assert not sp.ngram_claim(silent).held, "nothing proposed"
    idle = table.assign(acceptance=[0.0, 0.0], accepted=[0, 0])
    assert not sp.ngram_claim(idle).held, "half the tokens repeat and nothing was accepted"


def test_claims_fail_on_figures_that_contradict_them():
    check = pd.DataFrame({"acceptance": [0.8], "k": [2], "verifies": [100],
                          "tokens_per_verify": [2.0], "expected": [2.44]})
    assert not sp.formula_claim(check).held  # 18% short of the formula
    costs = pd.DataFrame({"batch": [1, 8], "k": [4, 4], "relative_cost": [1.1, 3.4],
                          "low": [1.0, 3.3], "high": [1.2, 3.6]})
    assert not sp.cost_claim(costs, "here").held  # a range reaching 3.6x at batch 8
    speed = pd.DataFrame({"acceptance": [0.8], "k": [4], "speedup": [2.0], "low": [1.9],
                          "high": [2.1], "predicted": [2.6], "same_tokens": [True]})
    held = [c.held for c in sp.speedup_claims(speed, 0.15, "here")]
    assert held == [True, False, True], "2.0 against a predicted 2.6 is 23% off"
    # against an async plain loop the speed-up can only shrink: a larger one contradicts it
    fast = speed.assign(versus_async=[1.5], versus_async_low=[1.4], versus_async_high=[1.6],
                        spec_ms_per_token=[0.5], async_ms_per_token=[0.75],
                        plain_ms_per_token=[1.0])
    made = sp.speedup_claims(fast, 0.15, "here")
    assert [c.held for c in made] == [True, False, True, True]
    assert "0.50 ms speculating, 0.75 ms plain with async scheduling, 1.00 ms plain" in \
        made[2].text, "the ratio's parts, each named"
    faster = fast.assign(versus_async=[2.05])
    assert [c.held for c in sp.speedup_claims(faster, 0.15, "here")][2] is False
    # async speculation against async plain: it must win back what the synchronous loop paid
    both = fast.assign(async_speedup=[1.8], async_speedup_low=[1.7], async_speedup_high=[1.9],
                       async_spec_ms_per_token=[0.42], async_same_tokens=[True])
    made = sp.speedup_claims(both, 0.15, "here")
    assert [c.held for c in made] == [True, False, True, True, True]
    assert "1.70-1.90x plain decoding here (median 1.80x)" in made[3].text
    assert "0.42 ms async speculating, 0.75 ms async plain" in made[3].text
    assert not sp.async_claim(both.assign(async_speedup=[1.4]), "here").held, \
        "slower than the synchronous loop against the same plain loop"
    assert not sp.async_claim(both.assign(async_same_tokens=[False]), "here").held
    assert sp.async_claim(both.assign(async_same_tokens=[False]), "here", exact=False).held
    two_k = pd.concat([both, both.assign(k=[2], async_speedup=[float("nan")])])
    assert len(sp.speedup_claims(two_k.reset_index(drop=True), 0.15, "here")) == 5
    # the async pair's speed-up is held to its own prediction as well
    near = both.assign(predicted=[2.0], async_predicted=[1.9])
    assert sp.speedup_claims(near, 0.15, "here")[1].held
    far = near.assign(async_predicted=[2.6])
    assert not sp.speedup_claims(far, 0.15, "here")[1].held, "1.8 against 2.6 is 31% off"
    assert sp.speedup_claims(near.assign(async_predicted=[float("nan")]), 0.15, "here")[1].held
    # in bf16 outputs may differ at near ties: no equality claim is made, held or not
    bf16 = sp.speedup_claims(speed.assign(same_tokens=[False]), 0.15, "here", exact=False)
    assert [c.held for c in bf16] == [True, False]


def test_decode_span_times_full_graph_replays_where_any_replayed():
    def step(graph, ms, t):
        return SimpleNamespace(graph=graph, duration_s=ms / 1e3, start_s=t, end_s=t + ms / 1e3,
                               device_s=ms / 2e3,  # half its wall time on the device
                               stats=SimpleNamespace(num_prefill_tokens=0, num_spec_proposed=4))

    class Fake:
        def __init__(self, graphs):
            self.step_history, self.graphs = [], graphs

        def generate(self, prompts, params):
            prefill = step("piecewise", 9.0, 0.0)
            prefill.stats.num_prefill_tokens = 8
            self.step_history += [prefill] + [step(g, ms, 0.01 * i) for i, (g, ms) in
                                              enumerate(self.graphs, 1)]
            return [SimpleNamespace(token_ids=[1] * 11)]

    # two replays at 1 ms and the short-draft tail at 5 ms twice: the median is the replays'
    run = sp.decode_span(Fake([("full verify", 1.0), ("full verify", 1.0), ("piecewise", 5.0),
                               ("piecewise", 5.0)]), [[1]], max_tokens=11)
    assert run["step_ms"] == pytest.approx(1.0) and run["timed_steps"] == 2
    assert run["device_ms"] == pytest.approx(0.5), "the device time of the same steps"
    assert run["graphs"] == {"full verify": 2, "piecewise": 2}
    run = sp.decode_span(Fake([("eager", 2.0), ("eager", 3.0), ("eager", 4.0)]), [[1]], 11)
    assert run["step_ms"] == pytest.approx(3.0) and run["timed_steps"] == 3, "none replayed: all"


def test_the_gpu_cost_claim_reads_batch_one_k_four_on_the_gpus_clock():
    costs = pd.DataFrame({"batch": [1, 1, 8], "k": [2, 4, 4], "low": [0.9, 1.0, 1.1],
                          "high": [1.0, 1.1, 1.3], "decode_gpu_ms": [1.1, 1.1, 1.2],
                          "verify_gpu_ms": [1.2, 1.3, 1.9], "gpu_low": [1.0, 1.1, 1.5],
                          "gpu_high": [1.1, 1.25, 1.7]})
    c = sp.gpu_cost_claim(costs, "here")
    assert c.held and "1.10-1.25x" in c.text and "1.00-1.10x" in c.text
    assert "decode 1.10 ms, verify 1.30 ms" in c.text, "each figure named, not paired by order"
    assert not sp.gpu_cost_claim(costs.assign(gpu_high=[1.1, 2.2, 1.7]), "here").held


def test_the_graph_claim_needs_replays_in_every_cell_on_a_gpu():
    costs = pd.DataFrame({"batch": [1, 8], "k": [4, 4], "full_decode_share": [1.0, 0.9],
                          "full_verify_share": [0.75, 0.8]})
    made = sp.graph_claim(costs, gpu=True, where="here")
    assert made.held and "75%-80% of the verify steps" in made.text
    assert "and 100% of the decode steps" in sp.graph_claim(
        costs.assign(full_decode_share=[1.0, 1.0]), gpu=True, where="here").text
    # verify steps that fell back to piecewise graphs: the medians compared other things
    assert not sp.graph_claim(costs.assign(full_verify_share=[0.75, 0.0]), True, "here").held
    assert not sp.graph_claim(costs, gpu=False, where="here").held, "a CPU replays none"


def test_a_random_draft_model_proposes_and_outputs_stay_plain(model):
    result = sp.draft_acceptance(model, k=3, batch=2, max_tokens=12, device="cpu")
    assert result["proposed"] > 0 and result["accepted"] <= result["proposed"]
    assert result["same_tokens"] and sp.draft_claim(result).held
    assert not sp.draft_claim({**result, "same_tokens": False}).held


def test_plain_engines_run_the_speculating_engines_loop(monkeypatch):
    # a speculating engine runs without async scheduling; the plain engine it is timed against
    # must too (on a GPU the plain default is async), unless async is what is asked for
    seen = []
    monkeypatch.setattr(measure, "_engine", lambda model, k, **kw: seen.append((k, kw)))
    measure._plain("m", 4)
    measure._plain("m", 4, async_scheduling=True)
    assert seen == [(None, {"max_num_seqs": 4, "async_scheduling": False}),
                    (None, {"max_num_seqs": 4, "async_scheduling": True})]


def test_what_only_counts_tokens_builds_eager_engines_unless_told(model, monkeypatch):
    """Capturing graphs is most of an engine's build on a GPU and nothing counted needs them:
    the acceptance counts build every engine (reference runs alike) with cudagraph_mode none."""
    seen = []
    real = measure.LLM

    def recording(*args, **kw):
        seen.append(kw.get("cudagraph_mode"))
        return real(*args, **kw)
    monkeypatch.setattr(measure, "LLM", recording)
    sp.acceptance_check(model, accepts=(0.8,), ks=(2,), batch=2, max_tokens=6, device="cpu")
    sp.ngram_acceptance(model, k=2, batch=2, max_tokens=6, device="cpu")
    sp.draft_acceptance(model, k=2, batch=2, max_tokens=6, device="cpu")
    assert seen and set(seen) == {"none"}, seen
    seen.clear()
    sp.acceptance_check(model, accepts=(0.8,), ks=(2,), batch=2, max_tokens=6, device="cpu",
                        cudagraph_mode="piecewise")
    assert set(seen) == {"piecewise"}


def test_step_costs_on_a_gpu_capture_full_graphs_only_unless_told(monkeypatch, model):
    """Only full-graph replays are timed there, so no engine captures piecewise graphs."""
    seen = []

    class Built(Exception):
        pass

    def engine(m, k, **kw):
        seen.append(kw.get("cudagraph_mode"))
        raise Built
    monkeypatch.setattr(measure, "_engine", engine)
    on_gpu = SimpleNamespace(config=model.config, parameters=lambda: iter(
        [SimpleNamespace(device=torch.device("cuda"))]))
    for m, kw, want in ((on_gpu, {}, "full_decode_only"),
                        (on_gpu, {"cudagraph_mode": "piecewise"}, "piecewise"),
                        (model, {}, None)):
        with pytest.raises(Built):
            sp.step_costs(m, batches=(1,), ks=(1,), **kw)
        assert seen.pop() == want


def test_runs_in_turn_start_at_a_different_one_each_round_and_keep_their_order():
    order = []
    runs = [lambda i=i: order.append(i) or i * 10 for i in range(3)]
    assert [measure._in_turn(runs, r) for r in range(4)] == [[0, 10, 20]] * 4
    assert order == [0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]
