import pandas as pd
import pytest
import torch

from labkit.lessons import launch_overhead as lo


def test_the_chain_runs_one_add_per_kernel():
    x = torch.zeros(5)
    lo.tiny_kernels(x, 7)
    assert torch.equal(x, torch.full((5,), 7.0))


def test_graph_mode_on_cpu_says_what_to_compare_instead():
    with pytest.raises(ValueError, match="compiled"):
        lo.chain_runner("graph", 16, 4, torch.device("cpu"))


def test_unknown_mode_is_rejected():
    with pytest.raises(ValueError, match="eager"):
        lo.chain_runner("turbo", 16, 4, torch.device("cpu"))


def _synthetic(eager, fast):
    rows = [{"numel": n, "mode": "eager", "us_per_kernel": e} for n, e in eager.items()]
    rows += [{"numel": n, "mode": "graph", "us_per_kernel": f} for n, f in fast.items()]
    return pd.DataFrame(rows)


def test_crossover_is_the_first_size_where_the_gain_drops_under_ten_percent():
    df = _synthetic({1: 7.0, 2: 7.0, 4: 9.0, 8: 20.0}, {1: 1.0, 2: 2.0, 4: 8.5, 8: 19.9})
    assert lo.crossover(df) == 4
    assert lo.speedup_table(df).speedup.iloc[0] == pytest.approx(7.0)


def test_no_crossover_when_the_fast_mode_always_wins():
    assert lo.crossover(_synthetic({1: 7.0, 2: 7.0}, {1: 1.0, 2: 1.0})) is None


def test_an_eager_kernel_is_bound_by_the_max_of_launch_and_kernel_not_their_sum():
    # launch floor 7 us; the kernel itself 1, 2, 9, 20 us (what the replay measures)
    bound = lo.launch_bound(_synthetic({1: 7.0, 2: 7.0, 4: 9.2, 8: 20.5},
                                       {1: 1.0, 2: 2.0, 4: 9.0, 8: 20.0}))
    assert bound.launch_floor_us.iloc[0] == 7.0
    assert list(bound.model_us) == [7.0, 7.0, 9.0, 20.0], "max(launch, kernel) per size"
    assert list(bound.bound) == ["launch", "launch", "kernel", "kernel"]
    assert bound.model_error.abs().max() < 0.03
    assert bound.launch_share.iloc[0] == pytest.approx(1 - 1 / 7)


def recorded_sweep():
    from labkit.tools import recorded
    rec = recorded.load("launch_overhead")
    return rec, pd.DataFrame(rec.data["sweep"])


def test_notebook_01s_sweep_claims_hold_on_the_recording(fresh_claims):
    rec, df = recorded_sweep()
    assert all(c.held for c in lo.sweep_claims(df, "graph", recorded=rec))


def test_notebook_01s_sweep_claims_fail_with_eager_and_graph_swapped(fresh_claims):
    rec, df = recorded_sweep()
    swapped = df.assign(mode=df["mode"].map({"eager": "graph", "graph": "eager"}))
    flat, gain, cross = lo.sweep_claims(swapped, "graph", recorded=rec)
    assert not gain.held and not cross.held


def test_notebook_01s_flat_claim_fails_when_tiny_kernels_grow_with_size(fresh_claims):
    df = _synthetic({1: 7.0, 2: 14.0, 4: 30.0}, {1: 1.0, 2: 1.5, 4: 30.0})
    assert not lo.sweep_claims(df, "graph", expect_crossover=False)[0].held


def test_notebook_01s_timeline_claims_fail_with_the_timelines_swapped(fresh_claims):
    from labkit.measure.profile import Trace
    from labkit.tools import recorded
    rec = recorded.load("launch_overhead")
    eager, graph = (Trace.from_dict(rec.data[k]).summary for k in ("trace_eager", "trace_graph"))
    assert all(c.held for c in lo.timeline_claims(eager, graph, "graph", 30, recorded=rec))
    swapped = lo.timeline_claims(graph, eager, "graph", 30, recorded=rec)
    assert not swapped[0].held and not swapped[1].held


def test_notebook_01s_chain_length_claim_fails_when_the_cost_is_not_per_kernel(fresh_claims):
    assert lo.chain_length_claim(2.0, 2.2, 64, 4, 16).held
    assert lo.chain_length_claim(9.1, 13.0, 100, 4, 256).held, "the H200's 1.43x: still per kernel"
    assert not lo.chain_length_claim(2.0, 8.0, 64, 4, 16).held, "4x per kernel: not a flat cost"
    assert not lo.chain_length_claim(2.0, 0.5, 64, 4, 16).held, "a cost per chain, not per kernel"


def test_cpu_sweep_measures_every_size_in_every_round():
    df = lo.sweep([16, 1024], n_kernels=4, modes=("eager",), device="cpu", repeats=3, rounds=4)
    assert list(df.numel) == [16, 1024] and (df.us_per_kernel > 0).all()
    assert (df.low_us <= df.us_per_kernel).all() and (df.us_per_kernel <= df.high_us).all()


def test_the_two_tiny_sizes_take_turns_and_keep_each_rounds_fastest_sample():
    flat = lo.flat_cost_rounds([16, 256], n_kernels=4, device="cpu", rounds=3, samples=4)
    assert sorted(flat) == [16, 256] and all(len(v) == 3 and min(v) > 0 for v in flat.values())


def test_the_flat_claim_compares_the_two_sizes_round_by_round(fresh_claims):
    df = _synthetic({16: 4.0, 256: 4.1, 1024: 9.0}, {16: 1.0, 256: 1.0, 1024: 8.0})
    # the whole machine slowed down in round 2: both sizes alike, so the cost is still flat
    drift = {16: [4.0, 6.4, 4.1], 256: [4.1, 6.5, 4.0]}
    claim = lo.sweep_claims(df, "graph", expect_crossover=False, flat=drift)[0]
    assert claim.held and "3 rounds" in claim.text
    # one round where the larger size cost twice as much: not a fixed cost in every round
    grows = {16: [4.0, 4.0, 4.1], 256: [4.1, 8.2, 4.0]}
    assert not lo.sweep_claims(df, "graph", expect_crossover=False, flat=grows)[0].held


@pytest.mark.gpu
def test_graph_replay_computes_what_eager_computes_and_is_faster_for_tiny_kernels():
    dev = torch.device("cuda")
    x = torch.zeros(256, device=dev)
    g = lo.capture_chain(x, 50)      # two warm-up runs add 100; capturing runs nothing
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 100.0)), "capture must record, not execute"
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, torch.full_like(x, 150.0)), "one replay runs the 50 kernels once"
    df = lo.sweep([256], n_kernels=100, device=dev)
    assert lo.speedup_table(df).speedup.iloc[0] > 2


@pytest.mark.gpu
def test_a_graph_runner_keeps_the_buffer_its_graph_writes_alive():
    # The graph holds no reference to its buffer: freed, the replays wrote memory the allocator
    # handed to others (notebook 01's sweep died of an illegal address on the H200).
    run = lo.chain_runner("graph", 1 << 16, 10, torch.device("cuda"))
    torch.cuda.empty_cache()
    others = [torch.full((1 << 16,), -1.0, device="cuda") for _ in range(4)]
    out = run()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 30.0)), "two warm-ups and one replay of 10"
    assert all(bool((o == -1).all()) for o in others), "the replay wrote nobody else's memory"


def test_the_chain_length_claim_over_rounds_fails_when_one_round_looks_like_a_cost_per_chain(
        fresh_claims):
    made = lo.chain_length_claim([3.6, 3.5, 3.7], [3.4, 3.5, 3.3], 64, 4, 16)
    assert made.held and "3 rounds" in made.text
    assert not lo.chain_length_claim([3.6, 3.5, 7.2], [3.4, 3.5, 3.3], 64, 4, 16).held


def test_chain_rounds_times_both_chains_per_kernel(fresh_claims):
    chains = lo.chain_rounds(16, 8, 4, "cpu", rounds=3, repeats=3)
    assert len(chains["base_us"]) == len(chains["longer_us"]) == 3
    assert all(v > 0 for v in chains["base_us"] + chains["longer_us"])
