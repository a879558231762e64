"""Choose graph buckets from the batch sizes a server actually sees.

Every call is padded up to the smallest bucket that holds it; the padded rows are computed and
thrown away. More buckets waste fewer rows but cost capture time and graph memory. Given a
measured batch-size distribution and a budget (a number of graphs, or bytes), this picks the
buckets that minimise padded rows: an exact dynamic programme over the observed sizes (an
optimal bucket always sits on an observed size, else it could shrink and waste less).
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Sequence

from labkit.graphs.buckets import bucket_for, check_buckets, check_size


@dataclass(frozen=True)
class BucketPlan:
    buckets: tuple[int, ...]
    padded_rows: int
    real_rows: int
    eager_calls: int = 0  # batches larger than the largest bucket

    @property
    def waste(self) -> float:
        """Padded rows as a fraction of all rows computed."""
        total = self.padded_rows + self.real_rows
        return self.padded_rows / total if total else 0.0

    def __str__(self) -> str:
        return (f"{len(self.buckets)} buckets {list(self.buckets)}: {self.padded_rows:,} padded "
                f"rows, {self.waste:.1%} of computed rows wasted")


def padding_waste(batch_sizes: Iterable[int], buckets: Sequence[int]) -> BucketPlan:
    """What a given bucket list wastes on a batch-size trace (too-large batches run eager;
    with no buckets at all, every batch does)."""
    empty = isinstance(buckets, (list, tuple)) and not buckets
    buckets = () if empty else tuple(check_buckets("buckets", buckets))
    padded = real = eager = 0
    for size, count in _check(batch_sizes, allow_empty=True).items():
        bucket = bucket_for(size, buckets, default=None)
        if bucket is None:
            eager += count
            continue
        padded += (bucket - size) * count
        real += size * count
    return BucketPlan(buckets, padded, real, eager)


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
                 bytes_per_graph: float = 0.0) -> BucketPlan:
    """The buckets (at most ``max_graphs``; within ``memory_budget`` if given) that minimise
    padded rows while covering the largest observed batch.

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
    if memory_budget is not None and bytes_per_graph > 0:
        affordable = int((memory_budget - bytes_per_row * sizes[-1]) // bytes_per_graph)
        if affordable < 1:
            raise ValueError(
                f"memory_budget {memory_budget:,.0f} B cannot hold even one graph for batch "
                f"{sizes[-1]} ({bytes_per_graph + bytes_per_row * sizes[-1]:,.0f} B): raise the "
                "budget or cap the batch size")
        limit = min(limit, affordable)
    limit = min(limit, m)
    if limit == m:  # a bucket at every observed size wastes nothing
        return padding_waste(counts.elements(), sizes)

    # prefix sums so the waste of serving sizes[i..j] with bucket sizes[j] is O(1)
    n_pre, s_pre = [0] * (m + 1), [0] * (m + 1)
    for i, s in enumerate(sizes):
        n_pre[i + 1] = n_pre[i] + counts[s]
        s_pre[i + 1] = s_pre[i] + counts[s] * s

    def cost(i: int, j: int) -> int:  # sizes[i..j] all padded up to sizes[j]
        return sizes[j] * (n_pre[j + 1] - n_pre[i]) - (s_pre[j + 1] - s_pre[i])

    inf = float("inf")
    # best[k][j]: least waste covering sizes[0..j] with k buckets, the last one at sizes[j]
    best = [[inf] * m for _ in range(limit + 1)]
    back = [[-1] * m for _ in range(limit + 1)]
    for j in range(m):
        best[1][j] = cost(0, j)
    for k in range(2, limit + 1):
        for j in range(k - 1, m):
            for i in range(k - 2, j):
                c = best[k - 1][i] + cost(i + 1, j)
                if c < best[k][j]:
                    best[k][j], back[k][j] = c, i
    k = min(range(1, limit + 1), key=lambda kk: (best[kk][m - 1], kk))
    chosen, j = [], m - 1
    while k >= 1 and j >= 0:
        chosen.append(sizes[j])
        j, k = back[k][j], k - 1
    return padding_waste(counts.elements(), sorted(chosen))


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
