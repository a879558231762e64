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


if __name__ == "__main__":
    import timeit

    import labkit  # noqa: F401  (before triton: interpreter on where there is no GPU)
    import triton

    for n in (0, 1, 2, 3, 17, 1000, 1024, 1025):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
        assert all(cdiv(n, b) == triton.cdiv(n, b) for b in (1, 3, 16))
    print("cdiv and next_power_of_2 agree with Triton's")
    for name, ours, theirs in (("cdiv", lambda: cdiv(1000, 64), lambda: triton.cdiv(1000, 64)),
                               ("next_power_of_2", lambda: next_power_of_2(1000),
                                lambda: triton.next_power_of_2(1000))):
        a, b = (min(timeit.repeat(f, number=10000, repeat=5)) / 10000 * 1e6 for f in (ours, theirs))
        print(f"{name}: {a:.2f} us here, {b:.2f} us as triton.{name} (host time per call)")
