"""What the block manager refuses, before it changes anything.

- A token id that is not an int (a bool, a float, a string) or does not fit in int64: refused
  with the same message whether prefix caching is on or off, naming where the bad id sits.
- More new blocks than are free or evictable: :class:`OutOfBlocks`, which says how many were
  needed, how many there are, and what to change.
"""
from __future__ import annotations

from array import array
from operator import index


TOKEN_IDS = "token ids must be ints (a tokenizer's output)"


def check_token_id(token_id, where: str) -> int:
    """One token id as an int; the same refusal with prefix caching on or off."""
    if isinstance(token_id, bool):
        raise TypeError(f"{TOKEN_IDS}: {where} is a bool ({token_id}); pass the id itself")
    try:
        token_id = index(token_id)
    except TypeError:
        raise TypeError(f"{TOKEN_IDS}: {where} is {type(token_id).__name__} {token_id!r}") \
            from None
    if not -2**63 <= token_id < 2**63:
        raise ValueError(f"{TOKEN_IDS} in [-2**63, 2**63): {where} is {token_id}")
    return token_id


def token_bytes(token_ids) -> bytes:
    """A prompt's token ids packed as int64, or the error that names the first bad one."""
    if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__len__"):
        raise TypeError(f"token_ids must be a list of ints, got {type(token_ids).__name__}: "
                        "pass list(...) of the tokenizer's ids")
    try:
        if any(t.__class__ is bool for t in token_ids):
            raise TypeError
        return array("q", token_ids).tobytes()
    except (TypeError, OverflowError):
        for i, t in enumerate(token_ids):
            check_token_id(t, f"token_ids[{i}]")
        raise


class OutOfBlocks(RuntimeError):
    """Not enough free or evictable blocks; nothing was changed."""

    def __init__(self, what: str, needed: int, available: int, num_blocks: int):
        self.needed, self.available = needed, available
        super().__init__(
            f"{what} needs {needed} new block(s) but only {available} of {num_blocks} are free "
            f"or evictable: free (or preempt) running sequences, or make num_blocks larger")
