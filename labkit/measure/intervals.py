"""Interval arithmetic on a timeline, in microseconds: what was busy, and for how long two kinds
of work ran at once. Every overlap figure in the lab (copies under kernels, NCCL under matmuls,
metadata copies under a step) is one of these three functions applied to trace events."""
from __future__ import annotations

from typing import Iterable

Interval = tuple[float, float]


def union(starts: Iterable[float], ends: Iterable[float]) -> list[Interval]:
    """The busy intervals: overlapping or touching ``[start, end)`` pairs merged, sorted."""
    merged: list[list[float]] = []
    for s, e in sorted(zip(starts, ends)):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    return [(s, e) for s, e in merged]


def total(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in intervals)


def overlap(a: list[Interval], b: list[Interval]) -> float:
    """Time covered by both ``a`` and ``b``, each a sorted list of disjoint intervals (as
    :func:`union` returns): a merge walk, linear in their lengths."""
    shared, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        shared += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        i, j = (i + 1, j) if a[i][1] < b[j][1] else (i, j + 1)
    return shared
