"""Host-side arithmetic for launch grids and tile sizes.

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions: called from host code
they also unwrap every argument, a few microseconds a call. A kernel wrapper that an engine calls
a few hundred times a step pays that on each, beside the launch itself, so the wrappers use
these plain-int versions (tests check they agree with Triton's).
"""


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0), as ``triton.next_power_of_2``."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()
