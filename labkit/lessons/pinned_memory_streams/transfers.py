"""Host <-> device copies, measured: pageable against pinned, what pinning costs, a copy read
too early, and a pinned buffer refilled while its copy is still queued.

Every comparison runs in interleaved rounds (:func:`labkit.measure.rounds.interleaved`) on the
host clock: a case ends in a synchronisation, so its time is how long the data took to be on
the device as the CPU sees it. The GPU-only experiments raise on a CPU with a pointer to the
recorded figures.
"""
from __future__ import annotations

import functools
import statistics
import time

import pandas as pd
import torch

from labkit.device import select_device, synchronize
from labkit.measure.bench import Timing
from labkit.measure.rounds import Spread, interleaved
from labkit.overlap import PinnedStagingPool

# Cases of the bandwidth sweep, each timed once per round per size.
SWEEP_CASES = ("pageable", "pinned", "pin_cached_then_copy", "pin_fresh_then_copy",
               "pageable_call", "pinned_call")


def cuda_device(device) -> torch.device:
    dev = select_device(device)
    if dev.type != "cuda":
        raise ValueError("this experiment needs a CUDA device (pinned memory, streams, DMA); on "
                         "a CPU show the recorded figures: labkit.tools.recorded.load('pinned_memory_streams')")
    return dev


@functools.cache
def _cycles_per_ms(index: int) -> float:
    with torch.cuda.device(index):
        torch.cuda._sleep(1000)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        return 10_000_000 / start.elapsed_time(end)


def gpu_sleep(ms: float, device=None) -> None:
    """Keep the current stream busy for ``ms``: stands in for earlier work still queued."""
    dev = torch.device(device or "cuda")
    torch.cuda._sleep(int(ms * _cycles_per_ms(dev.index or 0)))


def host_timer(fn, *, device="auto", warmup: int = 1, repeats: int = 5) -> Timing:
    """A timer for :func:`interleaved`: the host clock around each call, the device synchronised
    before each sample so no earlier work is still queued. For work that ends in its own
    synchronisation, and for how long a call holds the CPU."""
    dev = select_device(device)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        synchronize(dev)
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    synchronize(dev)
    xs = sorted(samples)
    at = lambda q: xs[round(q * (len(xs) - 1))]
    return Timing(median_us=statistics.median(xs), p20_us=at(0.2), p80_us=at(0.8), min_us=xs[0],
                  repeats=repeats, device=str(dev), method="host clock")


def _host_allocations() -> int | None:
    """Pinned blocks PyTorch's host allocator has created so far (None where it does not say)."""
    try:
        return int(torch.cuda.memory.host_memory_stats().get("num_host_alloc", 0))
    except (AttributeError, RuntimeError):
        return None


def _empty_host_cache() -> None:
    """Hand the pinned blocks the sweep freed back to the OS, where this torch can."""
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            fn()
            return


def _sweep_cases(pageable: torch.Tensor, pinned: torch.Tensor, dst: torch.Tensor,
                 fresh: list) -> dict:
    """The sweep's cases for one size; ``fresh`` keeps every fresh pin alive."""
    def to_device(src):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(dst.device)

    def pin_fresh_then_copy():
        fresh.append(pageable.pin_memory())
        to_device(fresh[-1])

    return {"pageable": lambda: to_device(pageable),
            "pinned": lambda: to_device(pinned),
            "pin_cached_then_copy": lambda: to_device(pageable.pin_memory()),
            "pin_fresh_then_copy": pin_fresh_then_copy,
            "pageable_call": lambda: dst.copy_(pageable, non_blocking=True),
            "pinned_call": lambda: dst.copy_(pinned, non_blocking=True)}


def h2d_sweep(sizes, device="cuda", rounds: int = 5, repeats: int = 3) -> pd.DataFrame:
    """Per size (bytes), in interleaved rounds: a copy from pageable memory, from pinned memory,
    ``pin_memory()`` then the copy with the pinned block cached by PyTorch's allocator and with
    fresh pages each time (every earlier result kept alive, so the allocator must page-lock new
    memory), and how long the CPU is held inside ``copy_(non_blocking=True)`` (``*_call``).

    Columns: ``{case}_rounds`` (the case's median per round, us) and ``{case}_us`` (their
    median); ``pageable_gbps`` and ``pinned_gbps`` from the medians; ``fresh_allocations``: the
    pinned blocks the allocator created while the size ran (None where torch does not say)."""
    dev = cuda_device(device)
    torch.empty(1, pin_memory=True)   # the pinned allocator's one-time start-up is not pinning
    rows = []
    for nbytes in sizes:
        nbytes = int(nbytes)
        pageable = torch.ones(nbytes, dtype=torch.uint8)   # touched: every page exists
        pinned = pageable.pin_memory()
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        fresh: list[torch.Tensor] = []
        cases = _sweep_cases(pageable, pinned, dst, fresh)
        allocs = _host_allocations()
        timed = interleaved(cases, rounds=rounds, device=dev, warmup=1, repeats=repeats,
                            timer=host_timer)
        after = _host_allocations()
        row = {"bytes": nbytes,
               "fresh_allocations": None if allocs is None or after is None else after - allocs}
        for case in SWEEP_CASES:
            spread = timed.us(case)
            row[f"{case}_us"] = spread.median
            row[f"{case}_rounds"] = list(spread.values)
        row["pageable_gbps"] = nbytes / row["pageable_us"] / 1e3
        row["pinned_gbps"] = nbytes / row["pinned_us"] / 1e3
        rows.append(row)
        fresh.clear()
        _empty_host_cache()
    return pd.DataFrame(rows)


def spread_of(row, case: str) -> Spread:
    """One sweep row's case as a median with its range over the rounds."""
    return Spread.of(row[f"{case}_rounds"])


def per_round(fn, *spreads: Spread) -> Spread:
    """``fn`` applied round by round to spreads timed in the same rounds (drift cancels)."""
    return Spread.of([fn(*vals) for vals in zip(*(s.values for s in spreads))])


def verdict(ratio: Spread) -> str:
    """``ratio``: the reference's time over the alternative's, per round."""
    return "sooner" if ratio.above(1.0) else "later" if ratio.below(1.0) else "within noise"


def pin_verdicts(df: pd.DataFrame) -> pd.DataFrame:
    """Per size, from the sweep's rounds: does ``pin_memory()`` then one copy get the data there
    sooner than a pageable copy (fresh pages, and a cached pinned block)? What pinning fresh
    pages costs (``pin_fresh_then_copy - pinned``), what each copy from pinned memory saves
    (``pageable - pinned``), and so after how many copies of one buffer pinning it pays off."""
    rows = []
    for _, row in df.iterrows():
        pageable, pinned = spread_of(row, "pageable"), spread_of(row, "pinned")
        fresh, cached = spread_of(row, "pin_fresh_then_copy"), spread_of(row, "pin_cached_then_copy")
        pin_cost = per_round(lambda f, p: f - p, fresh, pinned)
        saving = per_round(lambda a, p: a - p, pageable, pinned)
        copies = per_round(lambda c, s: c / s if s > 0 else float("inf"), pin_cost, saving)
        rows.append({"bytes": int(row["bytes"]), "pageable_us": pageable.median,
                     "once_fresh_us": fresh.median, "once_cached_us": cached.median,
                     "once_fresh": verdict(per_round(lambda a, b: a / b, pageable, fresh)),
                     "once_cached": verdict(per_round(lambda a, b: a / b, pageable, cached)),
                     "pin_cost_us": pin_cost.median, "saved_per_copy_us": saving.median,
                     "saving_measurable": saving.above(0.0),
                     "copies_to_break_even": copies.median, "copies_low": copies.low,
                     "copies_high": copies.high})
    return pd.DataFrame(rows)


def pin_payoff(df: pd.DataFrame) -> pd.DataFrame:
    """Per size, from medians: pinning once costs ``pin_first_us``, each copy from pinned memory
    saves ``pageable_us - pinned_us``; how many copies of one buffer before pinning it pays off.
    (:func:`pin_verdicts` says the same with the rounds' ranges.)"""
    saved = df.pageable_us - df.pinned_us
    return pd.DataFrame({"bytes": df.bytes, "pageable_us": df.pageable_us,
                         "pin_once_then_copy_us": df.pin_first_us + df.pinned_us,
                         "pin_cached_then_copy_us": df.pin_then_copy_us,
                         "copies_to_break_even": (df.pin_first_us / saved.where(saved > 0)).round(1)})


def d2h_read_too_early(numel: int = 1 << 20, sleep_ms: float = 20.0, device="cuda") -> dict:
    """The GPU is busy, then writes 42 into ``result``; a non-blocking copy to pinned memory is
    read at once (old values), then after its event (42). Into pageable memory the same call
    blocks until the data is there."""
    dev = cuda_device(device)
    result = torch.zeros(numel, device=dev)
    pinned = torch.zeros(numel, pin_memory=True)
    torch.cuda.synchronize(dev)
    gpu_sleep(sleep_ms, dev)
    result.fill_(42.0)
    t0 = time.perf_counter()
    pinned.copy_(result, non_blocking=True)
    pinned_call_us = (time.perf_counter() - t0) * 1e6
    read_early = pinned[:4].tolist()
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    read_after_event = pinned[:4].tolist()

    pageable = torch.zeros(numel)
    gpu_sleep(sleep_ms, dev)
    result.fill_(43.0)
    t0 = time.perf_counter()
    pageable.copy_(result, non_blocking=True)
    pageable_call_us = (time.perf_counter() - t0) * 1e6
    return {"numel": numel, "sleep_ms": sleep_ms, "expected": 42.0,
            "pinned_read_early": read_early, "pinned_read_after_event": read_after_event,
            "pinned_call_us": pinned_call_us, "pageable_expected": 43.0,
            "pageable_read_at_once": pageable[:4].tolist(), "pageable_call_us": pageable_call_us}


def make_batch(i: int, numel: int) -> torch.Tensor:
    """Batch ``i``: int32 [numel], ``arange + i * numel``, so its checksum names it."""
    return torch.arange(numel, dtype=torch.int32) + i * numel


def arrived_batch(checksum: int, numel: int) -> float:
    """Which batch a checksum belongs to. A copy that read a torn mix gives the element-weighted
    mean of the batches it holds (not a whole number): 1/8 of batch 1 and 7/8 of batch 0 reads
    0.125."""
    return (checksum - numel * (numel - 1) // 2) / numel**2


def batch_mix(received: torch.Tensor, n_batches: int) -> list[list[float]]:
    """received: [numel] -> ``[[batch, share], ...]``: which batches its elements came from
    (element j of batch i holds ``j + i * numel``); batch -1 for elements no batch holds."""
    numel = received.numel()
    offset = received.to(torch.int64) - torch.arange(numel, device=received.device)
    origin = torch.div(offset, numel, rounding_mode="floor")
    valid = (offset % numel == 0) & (origin >= 0) & (origin < n_batches)
    counts = torch.bincount(origin[valid], minlength=n_batches).tolist()
    mix = [[float(b), c / numel] for b, c in enumerate(counts) if c]
    unknown = numel - int(valid.sum())
    return mix + ([[-1.0, unknown / numel]] if unknown else [])


def early_reuse(safe: bool, n_batches: int = 16, numel: int = 1 << 18, sleep_ms: float = 0.5,
                device="cuda") -> dict:
    """Copy ``n_batches`` through pinned memory while the copy stream is kept busy.

    Unsafe: one pinned buffer, refilled by the CPU as soon as each copy is enqueued. Safe: the
    same loop through a two-buffer :class:`PinnedStagingPool`. ``arrived`` is what each copy's
    checksum says; ``mix`` which batches its elements came from, and in what shares.

    A checksum names one batch only when the copy holds one whole batch. A copy the DMA read
    while the CPU was still rewriting the buffer is *torn*: its checksum gives a fractional
    "batch" (:func:`arrived_batch`), and since element j of batch i holds ``j + i * numel``,
    each element says which batch it came from (:func:`batch_mix`).
    """
    dev = cuda_device(device)
    batches = [make_batch(i, numel) for i in range(n_batches)]
    pool = PinnedStagingPool(2, dev) if safe else None
    copy_stream = pool.copy_stream if safe else torch.cuda.Stream(dev)
    staging = None if safe else torch.empty(numel, dtype=torch.int32, pin_memory=True)
    torch.cuda.synchronize(dev)
    outs = []
    for batch in batches:
        with torch.cuda.stream(copy_stream):
            gpu_sleep(sleep_ms, dev)   # the copy stream is busy with earlier work
        if safe:
            outs.append(pool.copy_async(batch))
            continue
        staging.copy_(batch)           # refill at once: the previous copy may not have run yet
        with torch.cuda.stream(copy_stream):
            dst = torch.empty(numel, dtype=torch.int32, device=dev)
            dst.copy_(staging, non_blocking=True)
        outs.append(dst)
    if safe:
        outs = [copy.wait() for copy in outs]
    else:
        torch.cuda.current_stream(dev).wait_stream(copy_stream)
    got = torch.stack([o.sum(dtype=torch.int64) for o in outs]).tolist()
    expected = [int(b.sum(dtype=torch.int64)) for b in batches]
    return {"safe": safe, "n_batches": n_batches, "numel": numel, "sleep_ms": sleep_ms,
            "expected": expected, "got": got,
            "arrived": [arrived_batch(g, numel) for g in got],
            "mix": [batch_mix(o, n_batches) for o in outs],
            "corrupt": sum(g != e for g, e in zip(got, expected)),
            "pool_waits": pool.stats.waits if safe else 0}
