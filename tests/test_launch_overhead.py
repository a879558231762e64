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


def test_fixed_cost_share_falls_as_kernels_grow():
    share = lo.overhead_share(_synthetic({1: 5.0, 2: 5.0, 4: 50.0}, {1: 1, 2: 1, 4: 1}))
    assert list(share.fixed_cost_share) == [1.0, 1.0, 0.1]


def test_cpu_sweep_measures_every_size_in_both_modes():
    df = lo.sweep([16, 1024], n_kernels=4, modes=("eager",), device="cpu", repeats=3)
    assert list(df.numel) == [16, 1024] and (df.us_per_kernel > 0).all()


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
