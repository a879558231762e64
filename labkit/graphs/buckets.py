"""The bucket a size runs in: the smallest captured (or compiled) size that holds it.

A graph or a compiled kernel is made for fixed sizes, so a batch of ``n`` rows runs padded up to
the smallest bucket ``>= n``; a batch larger than every bucket has none and runs eagerly.
"""
from __future__ import annotations

from typing import Sequence

_RAISE = object()


def bucket_for(n: int, buckets: Sequence[int], default=_RAISE):
    """The smallest of ``buckets`` (any order) that is ``>= n``. When none is: ``default`` if
    given (``None`` for "run it eagerly"), else a ValueError that says what to change."""
    fitting = [b for b in buckets if b >= n]
    if fitting:
        return min(fitting)
    if default is not _RAISE:
        return default
    raise ValueError(f"batch {n} is larger than the largest bucket {max(buckets)}; add a "
                     "bucket at least that large or run such batches eagerly")
