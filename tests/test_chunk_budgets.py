"""chunk_budgets: the token-budget sweep runs every budget and the whole prompt in the same
rounds, and its claims hold only where the measured trade and the chosen budget bear them out."""
import pandas as pd
import pytest
import torch

from labkit.engine import ModelConfig, random_model
from labkit.lessons.prefill_vs_decode import chunk_budgets as cb
from labkit.lessons.prefill_vs_decode.chunked_prefill import Interference


@pytest.fixture(scope="module")
def sweep():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = random_model(ModelConfig.tiny(), seed=0, device="cpu")
        return cb.budget_sweep(model, budgets=(32, 8, 16), cudagraph_mode="none", num_running=2,
                               running_tokens=10, long_prompt=60, arrive_after=3, rounds=3)
    finally:
        torch.set_num_threads(threads)


def test_the_sweep_runs_each_budget_ascending_then_the_whole_prompt_in_the_same_rounds(sweep):
    assert [(r.chunked, r.budget) for r in sweep] == [(True, 8), (True, 16), (True, 32),
                                                      (False, 62)]
    for r in sweep:
        assert len(r.per_round("long_ttft_ms")) == 3 and r.cudagraph_mode == "none"
        assert r.steps.num_prefill_tokens.max() <= r.budget
    assert sweep[-1].steps.num_prefill_tokens.max() == 60, "the unchunked run takes it whole"
    t = cb.trade(sweep)
    assert list(t["token budget"]) == [8, 16, 32]
    assert list(t["steps"]) == [len(r.steps) for r in sweep[:3]]
    fig = cb.figure(sweep, "t")
    assert [list(bar.x) for bar in fig.data] == [["8", "16", "32"]] * 2


def test_the_sweep_refuses_budgets_that_are_not_chunks():
    with pytest.raises(ValueError, match="no room for a chunk"):
        cb.budget_sweep(None, budgets=(2, 16), num_running=2, long_prompt=60)
    with pytest.raises(ValueError, match="holds the whole prompt"):
        cb.budget_sweep(None, budgets=(16, 62), num_running=2, long_prompt=60)
    with pytest.raises(ValueError, match="budget must be a positive int"):
        cb.budget_sweep(None, budgets=(0, 16), num_running=2, long_prompt=60)
    with pytest.raises(ValueError, match="at least one token budget"):
        cb.budget_sweep(None, budgets=(), num_running=2, long_prompt=60)


def fake(budget, gaps, ttfts, chunked=True):
    steps = pd.DataFrame({"num_prefill_tokens": [0, 5], "num_decode_tokens": [2, 2]})
    gap_rows = pd.DataFrame({"request": [0], "token": [2], "t_ms": [1.0], "gap_ms": [gaps[0]]})
    return Interference(chunked, budget, gap_rows, steps, ttfts[0], round_figures=[
        {"long_ttft_ms": t, "worst_gap_ms": g, "prefill_gap_ms": g, "mixed_step_ms": 1.0}
        for g, t in zip(gaps, ttfts)])


WHOLE = fake(4000, [150, 148, 152], [140, 141, 139], chunked=False)


def runs(gap_small, gap_big, ttft_small, ttft_big):
    return [fake(512, gap_small, ttft_small), fake(2048, gap_big, ttft_big), WHOLE]


def test_the_claims_hold_where_the_trade_is_measured_and_the_chosen_budget_meets_both():
    good = runs([11, 11.5, 11.2], [30, 31, 29], [255, 254, 265], [186, 187, 182])
    assert cb.ENGINE_BUDGET == 2048, "LLM's default max_num_batched_tokens"
    trade_claim, target_claim = cb.budget_claims(good, device="GPU")
    assert trade_claim.held and target_claim.held
    assert "budgets tried (512, 2,048 tokens), these meet both on GPU: 2,048." in target_claim.text
    t = cb.trade(good)
    assert list(t["meets both"]) == [False, True], "512: TTFT 1.8x the one step's"
    assert t.gap_cut[1] == pytest.approx(150 / 30)


def test_the_claims_fail_when_the_trade_reverses_or_the_chosen_budget_misses():
    flat = runs([11, 11.5, 11.2], [30, 31, 29], [186, 187, 182], [255, 254, 265])
    assert not cb.budget_claims(flat, chosen=2048)[0].held, "TTFT rising with the budget"
    good = runs([11, 11.5, 11.2], [30, 31, 29], [255, 254, 265], [186, 187, 182])
    assert not cb.budget_claims(good, chosen=512)[1].held, "512 misses the TTFT mark"
    assert not cb.budget_claims(good, chosen=1024)[1].held, "a budget not measured"
    # one round over the TTFT mark is enough to miss it
    edge = runs([11, 11.5, 11.2], [30, 31, 29], [255, 254, 265], [186, 187, 212])
    assert not cb.budget_claims(edge, chosen=2048)[1].held
