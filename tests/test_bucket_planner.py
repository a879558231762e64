import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from labkit.graphs.bucket_planner import padding_waste, plan_buckets, powers_of_two


def test_padding_waste_counts_rows_padded_up_to_each_bucket():
    plan = padding_waste([1, 3, 3, 8, 9], buckets=(4, 8))
    assert plan.padded_rows == 3 + 1 + 1 + 0 and plan.real_rows == 15 and plan.eager_calls == 1


def test_powers_of_two_cover_the_largest_batch():
    assert powers_of_two(1) == (1,) and powers_of_two(100) == (1, 2, 4, 8, 16, 32, 64, 128)


def test_unlimited_graphs_waste_nothing():
    assert plan_buckets([3, 5, 5, 7]).padded_rows == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 4))
def test_the_plan_is_optimal_against_brute_force(sizes, k):
    plan = plan_buckets(sizes, k)
    assert len(plan.buckets) <= k and plan.buckets[-1] == max(sizes) and plan.eager_calls == 0
    observed = sorted(set(sizes))
    best = min(padding_waste(sizes, combo + (max(sizes),)).padded_rows
               for r in range(0, min(k, len(observed)))
               for combo in itertools.combinations(observed[:-1], r))
    assert plan.padded_rows == best


def test_the_planner_beats_powers_of_two_with_the_same_number_of_graphs():
    rng = random.Random(0)
    trace = [min(256, max(1, int(rng.lognormvariate(3, 1)))) for _ in range(3000)]
    naive = padding_waste(trace, powers_of_two(max(trace)))
    planned = plan_buckets(trace, len(naive.buckets))
    assert planned.padded_rows < naive.padded_rows


def test_a_memory_budget_limits_the_number_of_graphs():
    trace = list(range(1, 65))
    plan = plan_buckets(trace, memory_budget=10_000, bytes_per_graph=2_000, bytes_per_row=0)
    assert len(plan.buckets) == 5


def test_a_budget_too_small_for_one_graph_says_what_to_change():
    with pytest.raises(ValueError, match="raise the budget"):
        plan_buckets([64], memory_budget=100, bytes_per_graph=50, bytes_per_row=10)


def test_an_empty_trace_is_an_error():
    with pytest.raises(ValueError, match="at least one"):
        plan_buckets([])


def test_padding_by_bucket_adds_up_to_the_total():
    from labkit.graphs.bucket_planner import padding_by_bucket

    trace = [1, 3, 3, 5, 8, 8]
    table = padding_by_bucket(trace, (4, 8))
    assert list(table.steps) == [3, 3] and list(table.padded_rows) == [3 + 1 + 1, 3]
    assert table.padded_rows.sum() == padding_waste(trace, (4, 8)).padded_rows
