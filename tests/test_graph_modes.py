"""Notebook 08's cudagraph_mode rows: every mode x async scheduling, one engine per row, shuffled
rounds; a mode the device cannot run says why; the claims fail on the tables that contradict
them."""
import pandas as pd
import pytest

from labkit.engine import ModelConfig, random_model
from labkit.engine.runner import CUDAGRAPH_MODES
from labkit.lessons.putting_it_together import graph_modes as gm
from labkit.lessons.putting_it_together.workload import Workload


@pytest.fixture(scope="module")
def modes():
    model = random_model(ModelConfig.tiny(), seed=0, device="cpu")
    return gm.run_modes(model, Workload(4, (8, 40), (3, 6), seed=1), rounds=3,
                        max_num_batched_tokens=16, cudagraph_capture_sizes=(1, 2, 4, 8, 16))


def test_every_mode_has_a_row_with_and_without_async_scheduling(modes):
    t = modes.table
    assert sorted(zip(t.cudagraph_mode, t.async_scheduling)) == sorted(
        (m, a) for m in CUDAGRAPH_MODES for a in (False, True))
    ran = t[t.status == "ran"]
    assert set(ran.cudagraph_mode) == {"none", "piecewise"}, "on CPU: eager and the stand-in"
    refused = t[t.status != "ran"]
    assert refused.reason.str.contains("needs a CUDA device").all()
    assert len(modes.rounds) == 3 * len(ran), "one run per row per round"


def test_the_rows_say_how_their_steps_ran(modes):
    eager, pw = modes.row("none", False), modes.row("piecewise", False)
    assert eager.eager_steps == eager.steps and eager.piecewise_steps == 0
    assert pw.piecewise_steps == pw.steps and pw.mixed_steps > 0
    assert pw.mixed_replayed == pw.mixed_steps and eager.mixed_replayed == 0
    assert pw.padded_tokens > 0 and eager.padded_tokens == 0
    assert modes.row("piecewise", True).graphs == pw.graphs > 0


def test_the_claims_hold_here_and_fail_on_contradicting_tables(modes, fresh_claims):
    assert all(c.held for c in gm.mode_claims(modes))
    wrong = gm.ModeExperiment(modes.table.assign(same_tokens=[False] + [True] * 7),
                              modes.rounds, modes.device)
    assert not gm.mode_claims(wrong)[0].held, "a mode whose tokens differ"
    t = modes.table.copy()
    t.loc[(t.cudagraph_mode == "piecewise") & ~t.async_scheduling, "mixed_replayed"] = 0
    assert not gm.mode_claims(gm.ModeExperiment(t, modes.rounds, modes.device))[1].held


def test_on_a_gpu_the_mixed_step_claim_compares_round_by_round(modes, fresh_claims):
    rounds = modes.rounds.copy()
    slow = rounds.cudagraph_mode.eq("piecewise") & ~rounds.async_scheduling
    fast = rounds.cudagraph_mode.eq("none") & ~rounds.async_scheduling
    rounds.loc[fast, "mixed_step_ms"] = [10.0, 10.0, 10.0]
    rounds.loc[slow, "mixed_step_ms"] = [4.0, 4.0, 4.0]
    gpu = gm.ModeExperiment(modes.table, rounds, "cuda:0")
    assert gm.mode_claims(gpu)[-1].held and "2.50x" in gm.mode_claims(gpu)[-1].text
    rounds.loc[slow, "mixed_step_ms"] = [4.0, 11.0, 4.0]  # one round where it lost
    assert not gm.mode_claims(gm.ModeExperiment(modes.table, rounds, "cuda:0"))[-1].held


def test_where_the_forward_is_cut():
    model = random_model(ModelConfig.tiny(), seed=0, device="cpu")
    table = gm.pieces_table(model)
    assert len(table) == model.config.num_hidden_layers + 1
    assert table.iloc[0, 1].startswith("embed") and table.iloc[-1, 1].endswith("final norm")
    assert isinstance(gm.compact(gm.ModeExperiment(pd.DataFrame(columns=gm.COLUMNS),
                                                   pd.DataFrame(), "cpu")), pd.DataFrame)


def _claim(made, starts):
    return next(c for c in made if c.text.startswith(starts))


def test_first_tokens_are_compared_with_eager_against_itself(modes, fresh_claims):
    assert modes.baseline_first_tokens == 1.0 and modes.num_requests == 4
    ran = modes.table[modes.table.status == "ran"]
    assert ran.same_first_tokens.between(0, 1).all()
    held = _claim(gm.mode_claims(modes), "Every mode repeated")
    assert held.held and "4 requests" in held.text
    t = modes.table.copy()
    t.loc[t.cudagraph_mode == "piecewise", "same_first_tokens"] = 0.5  # two of four differ
    worse = gm.ModeExperiment(t, modes.rounds, modes.device, 1.0, 4)
    assert not _claim(gm.mode_claims(worse), "Every mode repeated").held
    t.loc[t.cudagraph_mode == "piecewise", "same_first_tokens"] = 0.75  # one: within the slack
    assert _claim(gm.mode_claims(gm.ModeExperiment(t, modes.rounds, modes.device, 1.0, 4)),
                  "Every mode repeated").held


def test_on_a_gpu_graph_memory_is_predicted_before_capture(modes, fresh_claims):
    pw = modes.row("piecewise", False)
    assert pw.graph_MiB > 0 and pw.graph_MiB_predicted == pw.graph_MiB, (
        "on CPU the stand-in holds only the static buffers, predicted exactly")
    gpu = gm.ModeExperiment(modes.table, modes.rounds, "cuda:0", 1.0, 4)
    assert _claim(gm.mode_claims(gpu), "Each mode's graph memory").held
    t = modes.table.copy()
    piecewise = t.cudagraph_mode == "piecewise"
    t.loc[piecewise, "graph_MiB"], t.loc[piecewise, "graph_MiB_predicted"] = 3.0, 4.5
    made = gm.mode_claims(gm.ModeExperiment(t, modes.rounds, "cuda:0", 1.0, 4))
    assert _claim(made, "Each mode's graph memory").held, "1.5 MiB off: within one segment"
    t.loc[piecewise, "graph_MiB"], t.loc[piecewise, "graph_MiB_predicted"] = 100.0, 150.0
    made = gm.mode_claims(gm.ModeExperiment(t, modes.rounds, "cuda:0", 1.0, 4))
    assert not _claim(made, "Each mode's graph memory").held
    assert "at worst 50.0 MiB off" in _claim(made, "Each mode's graph memory").text
