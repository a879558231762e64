"""kernels/grid.py: the wrappers' host arithmetic agrees with Triton's."""
import pytest
import triton

import labkit  # noqa: F401
from labkit.kernels.grid import cdiv, next_power_of_2


@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 5, 17, 1000, 1024, 1025])
def test_host_arithmetic_matches_triton(n):
    assert next_power_of_2(n) == triton.next_power_of_2(n)
    for b in (1, 3, 16):
        assert cdiv(n, b) == triton.cdiv(n, b)
