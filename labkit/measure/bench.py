"""Timing that is honest on a GPU and on a CPU.

GPU work is asynchronous: a host clock read right after a launch measures the launch, not the
kernel. So on a GPU each sample is bracketed by CUDA events; on a CPU we synchronise and read
``perf_counter``. Both warm up first (compilation, allocator, caches), take many samples and
report the median with the 20th-80th percentile spread.

A call whose data fits in the L2 finds it still there when it is timed again, and measures the
cache instead of memory; a real model step finds its inputs in HBM. So every timed case says
which of three things holds (:func:`l2_statement`): its working set is over twice the L2 (read
from HBM every call), its inputs rotate over enough sets (``make_inputs``), or the L2 is flushed
between samples (``flush_l2``): a buffer twice the L2 read before each sample's start mark,
never inside the timed region.
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
    l2_flushed: bool = False

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


def _cache_name(device: torch.device) -> str:
    return "L2" if device.type == "cuda" else "CPU cache"


def l2_flush(device: torch.device) -> Callable[[], torch.Tensor]:
    """A function that evicts the cache: it reads a buffer of twice :func:`cache_bytes`, so
    whatever the timed call read last is gone, as a working set over twice the cache evicts it.
    Read, not written: written lines would be dirty, and the timed call would pay their
    write-back to memory. It runs between samples, never inside one."""
    buffer = torch.ones(2 * cache_bytes(device) // 4, dtype=torch.float32, device=device)
    return buffer.sum


def flush_needed(bytes_read: int, device: str | torch.device = "auto") -> bool:
    """Whether a call reading ``bytes_read`` could find part of it still cached from the call
    before: at most twice the cache (past that, each call evicts what the next one reads)."""
    return bytes_read <= 2 * cache_bytes(select_device(device))


def _mib(nbytes: float) -> str:
    mib = nbytes / 2**20
    return f"{mib:,.0f} MiB" if mib >= 10 else f"{mib:.2g} MiB"


def l2_statement(bytes_read: int, device: str | torch.device = "auto", *, flushed: bool = False,
                 input_sets: int = 1) -> str:
    """What a timed case read its data from, in one line: its working set (``bytes_read`` per
    call) over twice the cache, its inputs rotated over ``input_sets`` sets that together are,
    or the cache ``flushed`` between samples (a :class:`Timing` carries both). A working set
    that fits and is neither is refused: its time would be the cache's."""
    dev = select_device(device)
    cache, name = cache_bytes(dev), _cache_name(dev)
    if input_sets > 1 and input_sets * bytes_read > 2 * cache:  # fewer sets cycle in the cache
        return (f"inputs rotated over {input_sets} sets of {_mib(bytes_read)} "
                f"({_mib(input_sets * bytes_read)} > 2x {name})")
    if flushed:
        return f"{name} flushed between samples (working set {_mib(bytes_read)})"
    if bytes_read > 2 * cache:
        memory = "HBM" if dev.type == "cuda" else "memory"
        return (f"working set {_mib(bytes_read)} > 2x {name} ({_mib(2 * cache)}): read from "
                f"{memory} every call")
    raise ValueError(f"a working set of {_mib(bytes_read)} fits in 2x the {name} "
                     f"({_mib(2 * cache)}) and was neither flushed nor rotated, so its time is "
                     "the cache's: time it with flush_l2=True (or rotate its inputs)")


# What benchmarks of whole engine steps state: they time workloads, not one call repeated.
ENGINE_STEPS_L2 = ("not flushed: whole engine steps, each reading every weight of the model "
                   "(over 2 GB for the 1B model on a GPU) and its KV cache, far more than the L2 "
                   "holds")


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
    flush_l2: bool = False,
) -> Timing:
    """Time ``fn(*make_inputs())``; returns the per-call time.

    ``calls_per_sample`` > 1 amortises the clock for calls far shorter than its resolution.
    With ``rotate`` and inputs smaller than twice the cache, enough input sets are made that
    consecutive calls never find their data still cached. ``flush_l2`` evicts the cache before
    each sample, outside its timed region; the flush keeps the GPU busy while the host queues
    the sample, so it suits GPU-bound calls (a host-bound one would hide host time behind it).
    """
    if repeats < 1 or warmup < 0 or calls_per_sample < 1:
        raise ValueError(f"need repeats >= 1, warmup >= 0, calls_per_sample >= 1; got "
                         f"{repeats}, {warmup}, {calls_per_sample}")
    if flush_l2 and calls_per_sample > 1:
        raise ValueError(f"flush_l2=True needs calls_per_sample=1, got calls_per_sample="
                         f"{calls_per_sample}: the flush runs between samples, so every call of "
                         "a sample after its first would find the cache warm. Time one call per "
                         "sample, or rotate inputs (make_inputs) instead of flushing")
    dev = select_device(device)
    input_sets: list[Sequence] = [make_inputs() if make_inputs else ()]
    one_set = _tensor_bytes(input_sets[0])
    if rotate and make_inputs and 0 < one_set and flush_needed(one_set, dev):
        copies = min(64, math.ceil(3 * cache_bytes(dev) / one_set))
        input_sets += [make_inputs() for _ in range(copies - 1)]

    calls = 0

    def call():
        nonlocal calls
        args = input_sets[calls % len(input_sets)]
        calls += 1
        return fn(*args)

    flush = l2_flush(dev) if flush_l2 else None
    for _ in range(warmup):
        call()
    clock = _EventClock(dev, repeats) if dev.type == "cuda" else _HostClock(repeats)
    for i in range(repeats):
        if flush is not None:
            flush()  # before the start mark: on a GPU the start event waits for it in stream order
        clock.mark(i, 0)
        for _ in range(calls_per_sample):
            call()
        clock.mark(i, 1)
    xs = sorted(us / calls_per_sample for us in clock.samples_us())
    return Timing(
        median_us=statistics.median(xs), p20_us=_percentile(xs, 0.2), p80_us=_percentile(xs, 0.8),
        min_us=xs[0], repeats=repeats, device=str(dev), method=clock.method,
        input_sets=len(input_sets), l2_flushed=flush is not None,
    )


class _EventClock:
    """Start and end marks as CUDA events: the GPU's own timestamps, in stream order."""
    method = "cuda events"

    def __init__(self, dev: torch.device, repeats: int):
        self.dev = dev
        torch.cuda.synchronize(dev)  # the warm-up's work is not the first sample's
        self.marks = [[torch.cuda.Event(enable_timing=True) for _ in range(2)]
                      for _ in range(repeats)]

    def mark(self, i: int, end: int) -> None:
        self.marks[i][end].record()

    def samples_us(self) -> list[float]:
        torch.cuda.synchronize(self.dev)
        return [start.elapsed_time(end) * 1e3 for start, end in self.marks]


class _HostClock:
    """Start and end marks from ``perf_counter``: on a CPU the work is done when the call returns."""
    method = "perf_counter"

    def __init__(self, repeats: int):
        self.marks = [[0.0, 0.0] for _ in range(repeats)]

    def mark(self, i: int, end: int) -> None:
        self.marks[i][end] = time.perf_counter()

    def samples_us(self) -> list[float]:
        return [(end - start) * 1e6 for start, end in self.marks]


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
