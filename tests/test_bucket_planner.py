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


@pytest.mark.parametrize("entry, error, match", [
    (float("nan"), TypeError, "got float nan"),      # was planned as a bucket of its own
    (2.5, TypeError, "got float 2.5"),
    (True, TypeError, "got bool True"),
    ("a", TypeError, "got str 'a'"),
    (0, ValueError, "got 0"), (-3, ValueError, "got -3")],
    ids=["nan", "float", "bool", "str", "zero", "negative"])
def test_every_observed_batch_size_must_be_a_positive_int(entry, error, match):
    for call in (lambda: plan_buckets([3, entry, 4], 2), lambda: padding_waste([3, entry], [4])):
        with pytest.raises(error, match=rf"batch_sizes\[1\] must be a positive int, {match}"):
            call()


@pytest.mark.parametrize("buckets, error, match", [
    ([0, 2], ValueError, r"buckets\[0\] must be a positive int, got 0"),
    ([2.5], TypeError, r"buckets\[0\] must be a positive int, got float 2.5"),
    (["a"], TypeError, r"buckets\[0\] .* got str 'a'")])
def test_the_buckets_to_score_must_be_positive_ints(buckets, error, match):
    with pytest.raises(error, match=match):
        padding_waste([1, 2], buckets)


def test_no_buckets_at_all_means_every_batch_runs_eagerly():
    plan = padding_waste([1, 2, 2], [])
    assert (plan.eager_calls, plan.padded_rows) == (3, 0)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_graphs=1.5), TypeError, "max_graphs must be a positive int, got float"),
    (dict(max_graphs=True), TypeError, "max_graphs must be a positive int, got bool"),
    (dict(max_graphs="2"), TypeError, "max_graphs must be a positive int, got str"),
    (dict(memory_budget=float("nan"), bytes_per_graph=1), TypeError, "memory_budget must be a "
     "finite number"),
    (dict(memory_budget=float("inf"), bytes_per_graph=1), TypeError, "memory_budget"),
    (dict(memory_budget=100, bytes_per_graph=-1), ValueError, "bytes_per_graph must be >= 0"),
    (dict(memory_budget=100, bytes_per_graph=1, bytes_per_row=float("nan")), TypeError,
     "bytes_per_row")], ids=["float graphs", "bool graphs", "str graphs", "nan budget",
                             "inf budget", "negative per graph", "nan per row"])
def test_plan_options_must_be_counts_and_finite_byte_sizes(kwargs, error, match):
    with pytest.raises(error, match=match):
        plan_buckets([1, 2, 3, 4], **kwargs)


@pytest.mark.timeout(10)   # a NaN used to loop forever
@pytest.mark.parametrize("largest, error", [(float("nan"), TypeError), (float("inf"), TypeError),
                                            (2.5, TypeError), (0, ValueError), (-5, ValueError)])
def test_powers_of_two_needs_a_positive_int_and_never_loops_forever(largest, error):
    with pytest.raises(error, match="largest must be a positive int"):
        powers_of_two(largest)


def test_padding_by_bucket_adds_up_to_the_total():
    from labkit.graphs.bucket_planner import padding_by_bucket

    trace = [1, 3, 3, 5, 8, 8]
    table = padding_by_bucket(trace, (4, 8))
    assert list(table.steps) == [3, 3] and list(table.padded_rows) == [3 + 1 + 1, 3]
    assert table.padded_rows.sum() == padding_waste(trace, (4, 8)).padded_rows


# ------------------------------------------------------------------------ measured step times
def _brute_force_time(sizes, k, T, candidates):
    """Least total time over every bucket set of at most k candidates covering max(sizes)."""
    best = None
    for r in range(1, k + 1):
        for combo in itertools.combinations(candidates, r):
            if combo[-1] < max(sizes):
                continue
            t = padding_waste(sizes, combo, step_time=T).time
            best = t if best is None or t < best else best
    return best


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(1, 10), min_size=1, max_size=20), st.integers(1, 3),
       st.lists(st.integers(0, 50), min_size=10, max_size=10))
def test_the_time_plan_is_optimal_against_brute_force_for_any_step_time(sizes, k, times):
    T = dict(zip(range(1, 11), map(float, times)))     # not monotone: any measured shape
    plan = plan_buckets(sizes, k, step_time=T.__getitem__)
    assert len(plan.buckets) <= k and plan.buckets[-1] >= max(sizes) and plan.eager_calls == 0
    best = _brute_force_time(sizes, k, T.__getitem__, range(1, max(sizes) + 1))
    assert plan.time == pytest.approx(best)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=20), st.integers(1, 3),
       st.dictionaries(st.integers(1, 16), st.integers(0, 50), min_size=1, max_size=6))
def test_a_measured_table_is_interpolated_and_the_plan_stays_within_it(sizes, k, table):
    table = {**table, 16: table.get(16, 60)}           # a measurement that covers every batch
    lo = min(table)
    plan = plan_buckets(sizes, k, step_time=table)
    assert all(lo <= b <= 16 for b in plan.buckets)
    best = _brute_force_time(sizes, k, table, range(max(lo, 1), 17))
    assert plan.time == pytest.approx(best)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=25), st.integers(1, 4))
def test_step_time_equal_to_the_bucket_plans_the_fewest_padded_rows(sizes, k):
    assert (plan_buckets(sizes, k, step_time=float).padded_rows
            == plan_buckets(sizes, k).padded_rows)


def test_without_a_limit_the_time_plan_is_the_best_of_every_limit():
    rng = random.Random(1)
    trace = [rng.randint(1, 40) for _ in range(300)]
    T = {1: 10.0, 8: 10.0, 16: 30.0, 40: 100.0}
    free = plan_buckets(trace, step_time=T)
    assert free.time == pytest.approx(min(plan_buckets(trace, k, step_time=T).time
                                          for k in range(1, len(set(trace)) + 1)))


def test_a_flat_step_time_needs_one_graph_and_a_steep_one_needs_more():
    trace = [1, 2, 3, 5, 8, 13] * 10
    assert plan_buckets(trace, 4, step_time=lambda b: 100.0).buckets == (13,)
    assert len(plan_buckets(trace, 4, step_time=lambda b: b ** 2).buckets) == 4


def test_the_interpolated_table_reads_between_measured_buckets():
    plan = padding_waste([3, 6], (4, 6), step_time={2: 10.0, 6: 30.0})
    assert plan.time == pytest.approx(20.0 + 30.0)


@pytest.mark.parametrize("step_time, error, match", [
    ({8: 1.0}, ValueError, "measure a step at a bucket >= 9"),
    ({}, ValueError, "at least one measured bucket"),
    ({9: float("nan")}, TypeError, "finite time"),
    ({9: -1.0}, ValueError, ">= 0"),
    ("fast", TypeError, "callable T")], ids=["too small", "empty", "nan", "negative", "str"])
def test_a_step_time_must_cover_the_trace_with_finite_times(step_time, error, match):
    with pytest.raises(error, match=match):
        plan_buckets([1, 9], 2, step_time=step_time)


def test_scoring_a_bucket_outside_the_measured_table_says_so():
    with pytest.raises(ValueError, match="no time for bucket 1"):
        padding_waste([1], (1,), step_time={2: 1.0, 4: 2.0})
