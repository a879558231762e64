"""Choose graph buckets from the batch sizes a server actually sees.

Every call is padded up to the smallest bucket that holds it; the padded rows are computed and
thrown away. More buckets waste fewer rows but cost capture time and graph memory. Given a
measured batch-size distribution and a budget (a number of graphs, or bytes), this picks the
buckets that minimise the trace's total step time, each step costing T(its bucket):
``step_time`` is T, measured (a table {bucket: time}, interpolated between the measured sizes)
or a model (a callable). Without it T(bucket) = bucket, which minimises padded rows. Where a
step is launch-bound T is nearly flat, so padding costs little time; where it is GPU-bound
every padded row costs.

The search is an exact dynamic programme over the observed sizes: the observed sizes a bucket
serves are a run of them, sizes[i..j], and its best place is the cheapest T between sizes[j]
and the next observed size (anywhere in that range it serves the same steps).
"""
from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from labkit.graphs.buckets import bucket_for, check_buckets, check_size


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[int, ...]
    padded_rows: int
    real_rows: int
    eager_calls: int = 0  # batches larger than the largest bucket
    time: float | None = None  # sum of T(bucket) over the graphed steps, when T was given

    @property
    def waste(self) -> float:
        """Padded rows as a fraction of all rows computed."""
        total = self.padded_rows + self.real_rows
        return self.padded_rows / total if total else 0.0

    def __str__(self) -> str:
        time = "" if self.time is None else f", total step time {self.time:,.4g}"
        return (f"{len(self.buckets)} buckets {list(self.buckets)}: {self.padded_rows:,} padded "
                f"rows, {self.waste:.1%} of computed rows wasted{time}")


StepTime = Callable[[int], float] | Mapping[int, float]


class _Cost:
    """T(bucket) over the buckets it can price: a callable over 1.. (any size), a table over
    its measured range, linear between measured sizes."""

    def __init__(self, step_time: StepTime):
        if isinstance(step_time, Mapping):
            if not step_time:
                raise ValueError("step_time needs at least one measured bucket")
            table = {check_size(f"step_time key {k!r}", k): _time(f"step_time[{k}]", v)
                     for k, v in step_time.items()}
            self.sizes = sorted(table)
            self.times = [table[k] for k in self.sizes]
            self.lo, self.hi = self.sizes[0], self.sizes[-1]
            self.fn = self._interpolated
        elif callable(step_time):
            self.lo, self.hi, self.fn = 1, None, step_time
        else:
            raise TypeError("step_time must be a callable T(bucket) or a table {bucket: time}, "
                            f"got {type(step_time).__name__}")

    def _interpolated(self, bucket: int) -> float:
        i = bisect.bisect_left(self.sizes, bucket)
        if self.sizes[i] == bucket:
            return self.times[i]
        (a, ta), (b, tb) = (self.sizes[i - 1], self.times[i - 1]), (self.sizes[i], self.times[i])
        return ta + (tb - ta) * (bucket - a) / (b - a)

    def __call__(self, bucket: int) -> float:
        if bucket < self.lo or (self.hi is not None and bucket > self.hi):
            raise ValueError(f"step_time has no time for bucket {bucket}: measured buckets span "
                             f"{self.lo}..{self.hi}; measure a step at that size")
        return _time(f"step_time({bucket})", self.fn(bucket))


def _time(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite time, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def padding_waste(batch_sizes: Iterable[int], buckets: Sequence[int],
                  step_time: StepTime | None = None) -> BucketPlan:
    """What a given bucket list wastes on a batch-size trace (too-large batches run eager;
    with no buckets at all, every batch does); with ``step_time`` (T(bucket), a callable or a
    table of measured times) also the graphed steps' total time."""
    empty = isinstance(buckets, (list, tuple)) and not buckets
    buckets = () if empty else tuple(check_buckets("buckets", buckets))
    cost = None if step_time is None else _Cost(step_time)
    padded = real = eager = 0
    time = None if cost is None else 0.0
    for size, count in _check(batch_sizes, allow_empty=True).items():
        bucket = bucket_for(size, buckets, default=None)
        if bucket is None:
            eager += count
            continue
        padded += (bucket - size) * count
        real += size * count
        if cost is not None:
            time += cost(bucket) * count
    return BucketPlan(buckets, padded, real, eager, time)


def _check(batch_sizes: Iterable[int], allow_empty: bool = False) -> Counter:
    """The trace as counts per size, each size an int >= 1: a NaN or a float would become a
    bucket of its own, a 0 or a negative size a negative waste."""
    if isinstance(batch_sizes, (str, bytes)) or not hasattr(batch_sizes, "__iter__"):
        raise TypeError(f"batch_sizes must be a list of observed batch sizes (ints >= 1), got "
                        f"{type(batch_sizes).__name__}")
    sizes = [check_size(f"batch_sizes[{i}]", b) for i, b in enumerate(batch_sizes)]
    if not sizes and not allow_empty:
        raise ValueError("need at least one observed batch size to plan buckets")
    return Counter(sizes)


def _bytes(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number of bytes, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {value}")
    return value


def plan_buckets(batch_sizes: Iterable[int], max_graphs: int | None = None, *,
                 memory_budget: float | None = None, bytes_per_row: float = 0.0,
                 bytes_per_graph: float = 0.0, step_time: StepTime | None = None) -> BucketPlan:
    """The buckets (at most ``max_graphs``; within ``memory_budget`` if given) that cover the
    largest observed batch and minimise the trace's total step time, sum of T(bucket) over its
    steps. ``step_time`` is T: a callable, or a table {bucket: measured time} (buckets are then
    chosen within the measured range, T linear between measured sizes). Without it
    T(bucket) = bucket: the fewest padded rows. Ties go to fewer graphs.

    Memory model for the budget: ``bytes_per_graph`` for each graph plus ``bytes_per_row``
    times the largest bucket (graphs captured into one shared pool cost about the largest).
    """
    counts = _check(batch_sizes)
    sizes = sorted(counts)
    m = len(sizes)
    limit = m if max_graphs is None else check_size("max_graphs", max_graphs)
    bytes_per_row = _bytes("bytes_per_row", bytes_per_row)
    bytes_per_graph = _bytes("bytes_per_graph", bytes_per_graph)
    if memory_budget is not None:
        memory_budget = _bytes("memory_budget", memory_budget)
    cost = None if step_time is None else _Cost(step_time)
    if cost is not None and cost.hi is not None and cost.hi < sizes[-1]:
        raise ValueError(f"step_time's largest measured bucket is {cost.hi}, the trace has a "
                         f"batch of {sizes[-1]}: measure a step at a bucket >= {sizes[-1]}")
    if memory_budget is not None and bytes_per_graph > 0:
        affordable = int((memory_budget - bytes_per_row * sizes[-1]) // bytes_per_graph)
        if affordable < 1:
            raise ValueError(
                f"memory_budget {memory_budget:,.0f} B cannot hold even one graph for batch "
                f"{sizes[-1]} ({bytes_per_graph + bytes_per_row * sizes[-1]:,.0f} B): raise the "
                "budget or cap the batch size")
        limit = min(limit, affordable)
    limit = min(limit, m)
    if cost is None and limit == m:  # a bucket at every observed size wastes nothing
        return padding_waste(counts.elements(), sizes)

    # place[j]: the cheapest bucket for a run of sizes ending at sizes[j], and its T
    place: list[tuple[int, float] | None] = []
    for j, s in enumerate(sizes):
        if cost is None:
            place.append((s, s))
            continue
        top = sizes[j + 1] - 1 if j + 1 < m else (cost.hi or s)
        options = [(cost(c), c) for c in range(max(s, cost.lo), top + 1)]
        place.append(None if not options else min(options)[::-1])
    n_pre = [0] * (m + 1)
    for i, s in enumerate(sizes):
        n_pre[i + 1] = n_pre[i] + counts[s]

    def run_cost(i: int, j: int) -> float:  # the steps of sizes[i..j], all on place[j]
        return inf if place[j] is None else place[j][1] * (n_pre[j + 1] - n_pre[i])

    inf = float("inf")
    if limit == m:  # no limit that binds: one pass, least cost then fewest graphs, O(m^2)
        free: list[tuple[float, int, int]] = []  # (cost, graphs, previous run's end) up to j
        for j in range(m):
            free.append(min(((0.0 if i == 0 else free[i - 1][0]) + run_cost(i, j),
                             (1 if i == 0 else free[i - 1][1] + 1), i - 1) for i in range(j + 1)))
        chosen, j = [], m - 1
        while j >= 0:
            chosen.append(place[j][0])
            j = free[j][2]
        return padding_waste(counts.elements(), sorted(chosen), step_time)
    # best[k][j]: least cost covering sizes[0..j] with k buckets, the last one ending at j
    best = [[inf] * m for _ in range(limit + 1)]
    back = [[-1] * m for _ in range(limit + 1)]
    for j in range(m):
        best[1][j] = run_cost(0, j)
    for k in range(2, limit + 1):
        for j in range(k - 1, m):
            if place[j] is None:
                continue
            for i in range(k - 2, j):
                c = best[k - 1][i] + run_cost(i + 1, j)
                if c < best[k][j]:
                    best[k][j], back[k][j] = c, i
    k = min(range(1, limit + 1), key=lambda kk: (best[kk][m - 1], kk))
    chosen, j = [], m - 1
    while k >= 1 and j >= 0:
        chosen.append(place[j][0])
        j, k = back[k][j], k - 1
    return padding_waste(counts.elements(), sorted(chosen), step_time)


def powers_of_two(largest: int) -> tuple[int, ...]:
    """The usual naive list: 1, 2, 4, ... up to the first power of two >= ``largest``."""
    largest = check_size("largest", largest)   # a NaN would never be reached: an endless loop
    out, b = [], 1
    while True:
        out.append(b)
        if b >= largest:
            return tuple(out)
        b *= 2


def padding_by_bucket(batch_sizes: Iterable[int], buckets: Sequence[int]):
    """Per bucket: how many steps it served, their real rows and the rows padded onto them."""
    import pandas as pd

    buckets = tuple(check_buckets("buckets", buckets))
    rows = {b: {"bucket": b, "steps": 0, "real_rows": 0, "padded_rows": 0} for b in buckets}
    for size, count in _check(batch_sizes, allow_empty=True).items():
        bucket = bucket_for(size, buckets, default=None)
        if bucket is not None:
            r = rows[bucket]
            r["steps"] += count
            r["real_rows"] += size * count
            r["padded_rows"] += (bucket - size) * count
    table = pd.DataFrame(list(rows.values()))
    table["waste"] = table.padded_rows / (table.padded_rows + table.real_rows).where(lambda s: s > 0)
    return table
