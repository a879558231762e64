"""Timing that is honest on a GPU and on a CPU.

GPU work is asynchronous: a host clock read right after a launch measures the launch, not the
kernel. So on a GPU each sample is bracketed by CUDA events; on a CPU we synchronise and read
``perf_counter``. Both warm up first (compilation, allocator, caches), take many samples and
report the median with the 20th-80th percentile spread. Inputs small enough to stay in L2 are
rotated through enough copies that every sample reads from HBM, as a real model step would.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from labkit.device import select_device


@dataclass(frozen=True)
class Timing:
    median_us: float
    p20_us: float
    p80_us: float
    min_us: float
    repeats: int
    device: str
    method: str
    input_sets: int = 1

    @property
    def spread(self) -> float:
        """(p80 - p20) / median: how much to trust a difference between two timings."""
        return (self.p80_us - self.p20_us) / self.median_us if self.median_us else 0.0

    def __str__(self) -> str:
        return (f"{self.median_us:,.2f} us (p20-p80 {self.p20_us:,.2f}-{self.p80_us:,.2f}, "
                f"n={self.repeats}, {self.method})")


def cache_bytes(device: torch.device) -> int:
    """The last-level cache that repeated runs over one buffer would measure instead of memory."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20))
    for name in ("SC_LEVEL3_CACHE_SIZE", "SC_LEVEL2_CACHE_SIZE"):
        try:
            size = os.sysconf(name)
        except (ValueError, OSError):
            continue
        if size and size > 0:
            return int(size)
    return 32 * 2**20


def _tensor_bytes(args: Sequence) -> int:
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def _percentile(sorted_xs: list[float], q: float) -> float:
    idx = (len(sorted_xs) - 1) * q
    lo, hi = math.floor(idx), math.ceil(idx)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (idx - lo)


def measure(
    fn: Callable,
    make_inputs: Callable[[], Sequence] | None = None,
    *,
    device: str | torch.device = "auto",
    warmup: int = 3,
    repeats: int = 25,
    calls_per_sample: int = 1,
    rotate: bool = True,
) -> Timing:
    """Time ``fn(*make_inputs())``; returns the per-call time.

    ``calls_per_sample`` > 1 amortises the clock for calls far shorter than its resolution.
    With ``rotate`` and inputs smaller than twice the cache, enough input sets are made that
    consecutive calls never find their data still cached.
    """
    if repeats < 1 or warmup < 0 or calls_per_sample < 1:
        raise ValueError(f"need repeats >= 1, warmup >= 0, calls_per_sample >= 1; got "
                         f"{repeats}, {warmup}, {calls_per_sample}")
    dev = select_device(device)
    input_sets: list[Sequence] = [make_inputs() if make_inputs else ()]
    one_set = _tensor_bytes(input_sets[0])
    if rotate and make_inputs and 0 < one_set < 2 * cache_bytes(dev):
        copies = min(64, math.ceil(3 * cache_bytes(dev) / one_set))
        input_sets += [make_inputs() for _ in range(copies - 1)]

    calls = 0

    def call():
        nonlocal calls
        args = input_sets[calls % len(input_sets)]
        calls += 1
        return fn(*args)

    for _ in range(warmup):
        call()
    samples: list[float] = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for i in range(repeats):
            starts[i].record()
            for _ in range(calls_per_sample):
                call()
            ends[i].record()
        torch.cuda.synchronize(dev)
        samples = [s.elapsed_time(e) * 1e3 / calls_per_sample for s, e in zip(starts, ends)]
        method = "cuda events"
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(calls_per_sample):
                call()
            samples.append((time.perf_counter() - t0) * 1e6 / calls_per_sample)
        method = "perf_counter"
    xs = sorted(samples)
    return Timing(
        median_us=statistics.median(xs), p20_us=_percentile(xs, 0.2), p80_us=_percentile(xs, 0.8),
        min_us=xs[0], repeats=repeats, device=str(dev), method=method, input_sets=len(input_sets),
    )


def gbps(nbytes: float, t: Timing) -> float:
    """Bytes moved per median call, as GB/s (10^9)."""
    return nbytes / (t.median_us * 1e-6) / 1e9


def tflops(flops: float, t: Timing) -> float:
    return flops / (t.median_us * 1e-6) / 1e12


class TritonCompiles:
    """Counts Triton JIT compiles while active (``with TritonCompiles() as c: ...``; then
    ``c.count`` and ``c.kernels``, the kernel names in order). A compile inside a timed region
    is a first-use cost, not the steady speed: a GPU compiles a new variant of a kernel for
    every new combination of its compile-time constants (tile sizes chosen from the lengths,
    integers specialised as 1 or a multiple of 16). Under Triton's interpreter nothing is
    compiled and the count stays 0. Hooks chain: a hook installed before keeps running."""

    def __init__(self):
        self.kernels: list[str] = []
        self._previous = None

    @property
    def count(self) -> int:
        return len(self.kernels)

    def _hook(self, *, fn, **kwargs):
        self.kernels.append(fn.name)
        if self._previous is not None:
            return self._previous(fn=fn, **kwargs)
        return None

    def __enter__(self) -> "TritonCompiles":
        from triton import knobs

        self._previous = knobs.runtime.jit_post_compile_hook
        knobs.runtime.jit_post_compile_hook = self._hook
        return self

    def __exit__(self, *exc) -> None:
        from triton import knobs

        knobs.runtime.jit_post_compile_hook = self._previous


def save_results(out_dir, filename: str, results: dict):
    """A benchmark's ``results`` as ``out_dir/filename`` (JSON, the machine's fingerprint
    beside them, the folder made if missing); nothing when ``out_dir`` is None. -> the path."""
    if out_dir is None:
        return None
    import json
    from pathlib import Path

    from labkit.device import fingerprint
    path = Path(out_dir) / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"fingerprint": fingerprint(), "results": results}, indent=1,
                               default=str))
    return path
