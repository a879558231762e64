"""Comparisons that survive noise: interleaved rounds, a median and its range.

Timing A and then B puts every drift of the machine (clocks settling, another process, a
thermal step) on whichever runs second. So a comparison runs its cases in rounds, A B A B ...
(optionally in a shuffled order each round), each round a full :func:`labkit.measure.bench.measure`
of every case. A case is reported as the median of its round medians with the range over
rounds; a ratio as the median of the per-round ratios with their range. A target is met only
when the whole range clears it (:meth:`Spread.above`): a median that clears it while the range
straddles it is noise, not a result.

    rounds = interleaved({"eager": step, "graph": replay}, rounds=5)
    gain = rounds.ratio("eager", "graph")      # eager time / graph time, per round
    gain.above(2.0)                            # True only if every round gained more than 2x
    f"{gain:x}"                                # '2.31x (2.20-2.45, 5 rounds)'
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import pandas as pd

from labkit import check_positive_int
from labkit.measure.bench import Timing, measure


@dataclass(frozen=True)
class Spread:
    """A quantity measured once per round: its median and its range over the rounds."""
    values: tuple[float, ...]

    def __post_init__(self):
        if not self.values:
            raise ValueError("a spread needs at least one value")

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        return cls(tuple(float(v) for v in values))

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        return min(self.values)

    @property
    def high(self) -> float:
        return max(self.values)

    def as_dict(self) -> dict:
        """As plain data for a JSON result: median, low, high and every round's value."""
        return {"median": self.median, "low": self.low, "high": self.high,
                "values": list(self.values)}

    @property
    def rounds(self) -> int:
        return len(self.values)

    @property
    def relative_range(self) -> float:
        """(high - low) / median: the run-to-run noise, as a fraction of the value."""
        return (self.high - self.low) / self.median if self.median else float("inf")

    def above(self, target: float) -> bool:
        """Every round exceeded ``target``."""
        return self.low > target

    def below(self, target: float) -> bool:
        """Every round stayed under ``target``."""
        return self.high < target

    def __format__(self, spec: str) -> str:
        """``f"{s:.1f}"`` -> '12.3 (11.9-12.8, 5 rounds)'; a trailing 'x' formats a ratio. One
        value (a recording that kept the median only) has no range: '12.3'."""
        unit, spec = ("x", spec[:-1]) if spec.endswith("x") else ("", spec)
        spec = spec or ".3g"
        if self.rounds == 1:
            return f"{self.median:{spec}}{unit}"
        return (f"{self.median:{spec}}{unit} ({self.low:{spec}}-{self.high:{spec}}, "
                f"{self.rounds} round{'s' if self.rounds != 1 else ''})")

    def __str__(self) -> str:
        return format(self, "")


@dataclass(frozen=True)
class Rounds:
    """Every case's timing in every round, in the order the rounds ran them."""
    timings: Mapping[str, tuple[Timing, ...]]
    orders: tuple[tuple[str, ...], ...]

    def us(self, case: str) -> Spread:
        """The case's per-round median time in microseconds."""
        if case not in self.timings:
            raise KeyError(f"no case {case!r}; timed: {list(self.timings)}")
        return Spread.of([t.median_us for t in self.timings[case]])

    def ratio(self, numerator: str, denominator: str) -> Spread:
        """``numerator`` time / ``denominator`` time, taken within each round (so drift between
        rounds cancels): a speed-up of ``denominator`` over ``numerator``."""
        top, bottom = self.us(numerator).values, self.us(denominator).values
        return Spread.of([a / b for a, b in zip(top, bottom)])

    def table(self) -> pd.DataFrame:
        rows = []
        for case in self.timings:
            s = self.us(case)
            rows.append({"case": case, "median_us": s.median, "low_us": s.low, "high_us": s.high,
                         "relative_range": s.relative_range, "rounds": s.rounds})
        return pd.DataFrame(rows)


def interleaved(cases: Mapping[str, Callable[[], object]], *, rounds: int = 5,
                shuffle: bool = False, seed: int = 0, device="auto", warmup: int = 2,
                repeats: int = 10, timer: Callable[..., Timing] = measure,
                flush_l2: bool = False) -> Rounds:
    """Time every case once per round, the cases alternating within each round (A B, A B, ...;
    with ``shuffle`` a fresh order each round, drawn from ``seed``). At least 3 rounds: with two
    a range says little, with one it says nothing. ``flush_l2`` goes to the timer (the cache
    flushed before every sample of every case: :func:`labkit.measure.bench.measure`)."""
    if len(cases) < 1:
        raise ValueError("interleaved needs at least one case to time")
    check_positive_int("rounds", rounds)
    if rounds < 3:
        raise ValueError(f"rounds must be at least 3 for a range to mean anything, got {rounds}")
    names = list(cases)
    rng = random.Random(seed)
    timings: dict[str, list[Timing]] = {name: [] for name in names}
    flush = {"flush_l2": True} if flush_l2 else {}  # a timer that cannot flush is never asked to
    orders = []
    for _ in range(rounds):
        order = rng.sample(names, len(names)) if shuffle else names
        for name in order:
            timings[name].append(timer(cases[name], device=device, warmup=warmup,
                                       repeats=repeats, **flush))
        orders.append(tuple(order))
    return Rounds({k: tuple(v) for k, v in timings.items()}, tuple(orders))
