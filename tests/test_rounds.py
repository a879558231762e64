"""Interleaved rounds: every case timed in every round, medians with ranges, targets on ranges."""
import itertools
import json
import time

import pytest

from labkit.measure.bench import Timing
from labkit.measure.rounds import Spread, interleaved


def fake_timer(times):
    """A timer that returns the next prescribed time for each case (us), and logs the order."""
    log, its = [], {k: iter(v) for k, v in times.items()}

    def timer(fn, **kwargs):
        name = fn()
        log.append(name)
        t = next(its[name])
        return Timing(t, t, t, t, 1, "cpu", "fake")
    return timer, log


def cases(*names):
    return {n: (lambda n=n: n) for n in names}


def test_cases_alternate_within_each_round():
    timer, log = fake_timer({"a": [1, 1, 1], "b": [2, 2, 2]})
    r = interleaved(cases("a", "b"), rounds=3, timer=timer)
    assert log == ["a", "b"] * 3 and r.orders == (("a", "b"),) * 3


def test_shuffled_rounds_still_time_every_case_once_per_round():
    timer, log = fake_timer({"a": [1] * 6, "b": [2] * 6, "c": [3] * 6})
    r = interleaved(cases("a", "b", "c"), rounds=6, shuffle=True, seed=1, timer=timer)
    assert all(sorted(o) == ["a", "b", "c"] for o in r.orders)
    assert len(set(r.orders)) > 1, "a shuffled run should not repeat one order every round"


def test_a_ratio_is_taken_within_each_round_so_drift_cancels():
    # the machine slows down 2x between rounds; b is always exactly twice as fast as a
    timer, _ = fake_timer({"a": [10, 20, 40], "b": [5, 10, 20]})
    r = interleaved(cases("a", "b"), rounds=3, timer=timer)
    gain = r.ratio("a", "b")
    assert gain.values == (2.0, 2.0, 2.0) and gain.relative_range == 0
    assert r.us("a").low == 10 and r.us("a").high == 40 and r.us("a").median == 20


def test_a_target_is_met_only_when_the_whole_range_clears_it():
    s = Spread.of([1.58, 1.63, 1.71])
    assert s.median > 1.6 and not s.above(1.6), "the median clears 1.6, the range does not"
    assert s.above(1.5) and s.below(1.8) and not s.below(1.7)


def test_a_spread_formats_with_its_range():
    assert f"{Spread.of([2.2, 2.31, 2.45]):.2fx}" == "2.31x (2.20-2.45, 3 rounds)"
    assert f"{Spread.of([10.0, 12.5, 11.0]):.1f}" == "11.0 (10.0-12.5, 3 rounds)"
    assert f"{Spread.of([7.59]):.1fx}" == "7.6x", "one value has no range to show"


@pytest.mark.parametrize("rounds", [0, 1, 2, 2.5])
def test_fewer_than_three_rounds_are_refused(rounds):
    with pytest.raises(ValueError, match="rounds"):
        interleaved(cases("a"), rounds=rounds)


def test_a_real_timing_runs_each_case_every_round():
    counts = {"x": itertools.count(), "y": itertools.count()}
    r = interleaved({k: (lambda k=k: next(counts[k])) for k in counts}, rounds=3, warmup=1,
                    repeats=2, device="cpu")
    assert next(counts["x"]) == 3 * (1 + 2) and len(r.table()) == 2


def test_flush_l2_reaches_the_timer_and_a_timer_that_cannot_flush_is_not_asked():
    seen = []

    def timer(fn, **kwargs):
        seen.append(kwargs.get("flush_l2"))
        return Timing(1, 1, 1, 1, 1, "cpu", "fake")
    interleaved(cases("a", "b"), rounds=3, timer=timer, flush_l2=True)
    assert seen == [True] * 6
    seen.clear()
    interleaved(cases("a"), rounds=3, timer=lambda fn, device, warmup, repeats:
                seen.append(None) or Timing(1, 1, 1, 1, 1, "cpu", "fake"))
    assert seen == [None] * 3


def test_flushed_rounds_time_the_work_not_the_flush(monkeypatch):
    from labkit.measure import bench

    monkeypatch.setattr(bench, "l2_flush", lambda dev: lambda: time.sleep(0.01))
    r = interleaved(cases("a", "b"), rounds=3, device="cpu", warmup=0, repeats=2, flush_l2=True)
    assert all(t.l2_flushed for ts in r.timings.values() for t in ts)
    assert r.us("a").high < 5_000, "the flush was timed"


def test_a_spread_as_plain_data_keeps_every_round():
    s = Spread.of([1.5, 0.5, 1.0])
    assert s.as_dict() == {"median": 1.0, "low": 0.5, "high": 1.5, "values": [1.5, 0.5, 1.0]}
    json.dumps(s.as_dict())  # plain data: a result file takes it as it is
