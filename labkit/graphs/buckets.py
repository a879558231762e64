"""The bucket a size runs in: the smallest captured (or compiled) size that holds it.

A graph or a compiled kernel is made for fixed sizes, so a batch of ``n`` rows runs padded up to
the smallest bucket ``>= n``; a batch larger than every bucket has none and runs eagerly.
"""
from __future__ import annotations

from operator import index
from typing import Sequence

_RAISE = object()


def check_size(name: str, value, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``: a float would be truncated (2.7 -> 2) and a bool is
    not a size, so both are refused, as is anything else that is not an int."""
    kind = "a positive int" if minimum == 1 else f"an int >= {minimum}"
    try:
        if isinstance(value, bool):
            raise TypeError
        value = index(value)
    except TypeError:
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}") \
            from None
    if value < minimum:
        raise ValueError(f"{name} must be {kind}, got {value}")
    return value


def check_buckets(name: str, buckets, what: str = "batch sizes") -> list[int]:
    """Bucket sizes sorted, each an int >= 1; the error names ``name`` and the bad entry."""
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise TypeError(f"{name} must be a list of {what} (ints >= 1), e.g. [1, 2, 4, 8]; got "
                        f"{type(buckets).__name__} {buckets!r}")
    out = [check_size(f"{name}[{i}]", b) for i, b in enumerate(buckets)]
    if not out:
        raise ValueError(f"{name} is empty: give at least one of the {what} to capture")
    return sorted(set(out))


def bucket_for(n: int, buckets: Sequence[int], default=_RAISE):
    """The smallest of ``buckets`` (any order) that is ``>= n``. When none is: ``default`` if
    given (``None`` for "run it eagerly"), else a ValueError that says what to change."""
    fitting = [b for b in buckets if b >= n]
    if fitting:
        return min(fitting)
    if default is not _RAISE:
        return default
    if not buckets:
        raise ValueError(f"no buckets to put batch {n} in: give at least one bucket size")
    raise ValueError(f"batch {n} is larger than the largest bucket {max(buckets)}; add a "
                     "bucket at least that large or run such batches eagerly")
