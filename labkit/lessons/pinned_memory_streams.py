"""Host <-> device transfers, measured: the experiments behind notebook 04.

* :func:`h2d_sweep`: pageable against pinned host-to-device bandwidth over sizes, how long the
  CPU is blocked by each, and what ``pin_memory()`` itself costs.
* :func:`d2h_read_too_early`: a non-blocking device-to-host copy read before its event completed.
* :func:`early_reuse`: refilling a pinned buffer while its copy is still queued, checked with
  checksums; ``safe=True`` runs the same loop through :class:`PinnedStagingPool`.
* :func:`copy_compute_runner` (for ``labkit.measure.profile.trace``): copies and compute with and without
  the copy stream; :func:`copy_compute_overlap` measures the overlap on the timeline.
* :func:`step_times`: the CPU prepares the next batch while the GPU computes this one.

The GPU-only experiments raise on a CPU with a pointer to the recorded figures.
"""
from __future__ import annotations

import functools
import time

import pandas as pd
import torch

from labkit.measure import bench, intervals
from labkit.device import select_device
from labkit.overlap import PinnedStagingPool, Prefetcher, copy_to_host, start_copy_to_host


def _cuda(device) -> torch.device:
    dev = select_device(device)
    if dev.type != "cuda":
        raise ValueError("this experiment needs a CUDA device (pinned memory, streams, DMA); on "
                         "a CPU show the recorded figures: labkit.tools.recorded.load('pinned_memory_streams')")
    return dev


@functools.lru_cache(maxsize=None)
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


def h2d_sweep(sizes, device="cuda", repeats: int = 10) -> pd.DataFrame:
    """Per size (bytes): copy time and GB/s from pageable and from pinned memory, how long the
    CPU is blocked inside ``copy_(non_blocking=True)``, and the cost of ``pin_memory()``."""
    dev = _cuda(device)
    torch.empty(1, pin_memory=True)   # the pinned allocator's one-time start-up is not pinning
    rows = []
    for nbytes in sizes:
        pageable = torch.ones(int(nbytes), dtype=torch.uint8)   # touched: every page exists
        t0 = time.perf_counter()
        pinned = pageable.pin_memory()
        pin_first_us = (time.perf_counter() - t0) * 1e6
        dst = torch.empty(int(nbytes), dtype=torch.uint8, device=dev)
        row = {"bytes": int(nbytes), "pin_first_us": pin_first_us}
        for name, src in (("pageable", pageable), ("pinned", pinned)):
            t = bench.measure(lambda: dst.copy_(src, non_blocking=True), device=dev, warmup=2,
                              repeats=repeats)
            blocked = []
            for _ in range(5):
                torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                blocked.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize(dev)
            row.update({f"{name}_us": t.median_us, f"{name}_gbps": bench.gbps(nbytes, t),
                        f"{name}_cpu_blocked_us": sorted(blocked)[2]})
        row["pin_cached_us"] = bench.measure(pageable.pin_memory, device="cpu", warmup=1,
                                             repeats=max(3, repeats // 2)).median_us
        row["pin_then_copy_us"] = row["pin_cached_us"] + row["pinned_us"]
        rows.append(row)
    return pd.DataFrame(rows)


def pin_payoff(df: pd.DataFrame) -> pd.DataFrame:
    """Per size: pinning once costs ``pin_first_us``, each copy from pinned memory saves
    ``pageable_us - pinned_us``; how many copies of one buffer before pinning it pays off."""
    saved = df.pageable_us - df.pinned_us
    return pd.DataFrame({"bytes": df.bytes, "pageable_us": df.pageable_us,
                         "pin_once_then_copy_us": df.pin_first_us + df.pinned_us,
                         "pin_cached_then_copy_us": df.pin_then_copy_us,
                         "copies_to_break_even": (df.pin_first_us / saved.where(saved > 0)).round(1)})


def d2h_read_too_early(numel: int = 1 << 20, sleep_ms: float = 20.0, device="cuda") -> dict:
    """The GPU is busy, then writes 42 into ``result``; a non-blocking copy to pinned memory is
    read at once (old values), then after its event (42). Into pageable memory the same call
    blocks until the data is there."""
    dev = _cuda(device)
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
    """Which batch a checksum belongs to (not a whole number: a copy that read a torn mix)."""
    return (checksum - numel * (numel - 1) // 2) / numel**2


def early_reuse(safe: bool, n_batches: int = 16, numel: int = 1 << 18, sleep_ms: float = 0.5,
                device="cuda") -> dict:
    """Copy ``n_batches`` through pinned memory while the copy stream is kept busy.

    Unsafe: one pinned buffer, refilled by the CPU as soon as each copy is enqueued. Safe: the
    same loop through a two-buffer :class:`PinnedStagingPool`.
    """
    dev = _cuda(device)
    batches = [make_batch(i, numel) for i in range(n_batches)]
    pool = PinnedStagingPool(2, dev) if safe else None
    copy_stream = pool.copy_stream if safe else torch.cuda.Stream(dev)
    staging = None if safe else torch.empty(numel, dtype=torch.int32, pin_memory=True)
    torch.cuda.synchronize(dev)
    outs = []
    for batch in batches:
        with torch.cuda.stream(copy_stream):
            gpu_sleep(sleep_ms, dev)   # the copy engine's queue is busy with earlier work
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
            "corrupt": sum(g != e for g, e in zip(got, expected)),
            "pool_waits": pool.stats.waits if safe else 0}


def compute(x: torch.Tensor, w: torch.Tensor, matmuls: int) -> torch.Tensor:
    """x: [rows, cols], w: [cols, cols] -> [rows, cols]; stands in for a model's step."""
    for _ in range(matmuls):
        x = torch.tanh(x @ w)
    return x


def weight(cols: int, device, seed: int = 1) -> torch.Tensor:
    """w: [cols, cols] with gain 2, so repeated tanh(x @ w) stays near +-1 instead of decaying
    into denormals (which a CPU computes a hundred times slower)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(cols, cols, generator=g) * (2.0 / cols**0.5)).to(device)


def host_batches(n_batches: int, rows: int, cols: int, pinned: bool, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randn(rows, cols, generator=g) for _ in range(n_batches)]
    return [b.pin_memory() for b in batches] if pinned else batches


def copy_compute_runner(overlap: bool, n_batches: int = 4, rows: int = 2048, cols: int = 2048,
                        matmuls: int = 2, device="auto"):
    """A zero-argument callable: copy each batch to the device and compute on it, through a
    :class:`Prefetcher` with (``overlap``) or without the copy stream. Returns the outputs."""
    dev = select_device(device)
    batches = host_batches(n_batches, rows, cols, pinned=dev.type == "cuda")
    w = weight(cols, dev)
    pool = PinnedStagingPool(2, dev)
    runner = {"prefetcher": None}

    def run() -> list[torch.Tensor]:
        runner["prefetcher"] = Prefetcher(batches, dev, overlap=overlap, pool=pool)
        return [compute(x, w, matmuls) for x in runner["prefetcher"]]

    run.last = runner   # the last run's Prefetcher, for its stats
    return run


def copy_compute_overlap(events: pd.DataFrame) -> dict:
    """From a trace's events: GPU time in copies, in kernels, and in both at once."""
    def spans(kind):
        sel = events[events.kind == kind] if len(events) else events
        return intervals.union(sel.start_us, sel.start_us + sel.dur_us) if len(sel) else []

    copies, kernels = spans("memcpy"), spans("kernel")
    busy = intervals.union(*zip(*(copies + kernels))) if copies or kernels else []
    return {"copy_us": intervals.total(copies), "compute_us": intervals.total(kernels),
            "overlapped_us": intervals.overlap(copies, kernels), "span_us": busy[-1][1] - busy[0][0] if busy else 0.0}


def _prepare(step: int, tokens: int, vocab: int, prep_ms: float) -> torch.Tensor:
    t0 = time.perf_counter()
    ids = torch.randint(vocab, (tokens,), generator=torch.Generator().manual_seed(step))
    while (time.perf_counter() - t0) * 1e3 < prep_ms:
        pass   # stands in for scheduling, block-table updates, tokenisation: CPU work
    return ids


def step_times(steps: int = 12, tokens: int = 256, d_model: int = 4096, vocab: int = 4096,
               prep_ms: float = 3.0, compute_ms: float = 3.0, device="auto") -> pd.DataFrame:
    """A decode-like loop: the CPU prepares token ids, the GPU runs matmuls and picks the next
    token per row, the CPU reads them back. Serial: prepare, copy, compute, wait, repeat.
    Overlapped: the next step is prepared while the GPU computes this one, and a step's tokens
    are read one step later. Both must return the same tokens."""
    dev = select_device(device)
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(vocab, d_model, generator=g).to(dev)
    w = weight(d_model, dev)

    def forward(ids: torch.Tensor, matmuls: int) -> torch.Tensor:
        return (compute(emb[ids], w, matmuls) @ emb.T).argmax(dim=1)   # [tokens] next ids

    ids0 = _prepare(0, tokens, vocab, 0.0).to(dev)
    one = bench.measure(lambda: forward(ids0, 8), device=dev, warmup=2, repeats=5).median_us / 8
    matmuls = max(1, round(compute_ms * 1e3 / one))
    measured_compute_ms = bench.measure(lambda: forward(ids0, matmuls), device=dev, warmup=1,
                                        repeats=5).median_us / 1e3
    prepare = functools.partial(_prepare, tokens=tokens, vocab=vocab, prep_ms=prep_ms)
    pool = PinnedStagingPool(2, dev)

    def run(mode: str, n: int) -> tuple[float, torch.Tensor]:
        out = []
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        if mode == "serial":
            for step in range(n):
                ids = prepare(step).to(dev)               # a blocking copy
                out.append(copy_to_host(forward(ids, matmuls)))
        else:
            pending = None
            for ids in Prefetcher((prepare(s) for s in range(n)), dev, pool=pool):
                now = start_copy_to_host(forward(ids, matmuls))   # queued behind this step
                if pending is not None:
                    out.append(pending.synchronize())   # last step's tokens, long done
                pending = now
            out.append(pending.synchronize())
        return (time.perf_counter() - t0) * 1e3, torch.stack(out)

    rows, results = [], {}
    for mode in ("serial", "overlapped"):
        run(mode, 2)   # warm-up: first calls allocate and pick kernels
        wall_ms, results[mode] = run(mode, steps)
        rows.append({"mode": mode, "step_ms": wall_ms / steps, "prep_ms": prep_ms,
                     "compute_ms": measured_compute_ms, "matmuls": matmuls, "steps": steps,
                     "device": str(dev)})
    df = pd.DataFrame(rows)
    df["same_tokens"] = bool(torch.equal(results["serial"], results["overlapped"]))
    return df


def bandwidth_figure(df: pd.DataFrame, title: str):
    """GB/s over copy size: pageable, pinned, and pinning first then copying (once)."""
    import plotly.graph_objects as go

    once = df.bytes / ((df.pin_first_us + df.pinned_us) * 1e-6) / 1e9
    fig = go.Figure()
    for name, y in (("pageable", df.pageable_gbps), ("pinned", df.pinned_gbps),
                    ("pin_memory() then copy, once", once)):
        fig.add_scatter(x=df.bytes, y=y, mode="lines+markers", name=name)
    fig.update_layout(title=title, xaxis_type="log", xaxis_title="bytes copied",
                      yaxis_title="GB/s host to device")
    return fig


def reuse_figure(unsafe: dict, safe: dict, title: str):
    """Which batch each copy delivered: the diagonal when the data is intact."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, run in (("one pinned buffer, refilled at once", unsafe),
                      ("PinnedStagingPool (events)", safe)):
        fig.add_scatter(x=list(range(run["n_batches"])), y=run["arrived"], mode="lines+markers",
                        name=f"{name}: {run['corrupt']} corrupt")
    fig.update_layout(title=title, xaxis_title="batch sent", yaxis_title="batch that arrived "
                      "(from its checksum)")
    return fig


def step_figure(df: pd.DataFrame, title: str):
    """Step time serial against overlapped, beside the CPU and GPU work per step."""
    import plotly.graph_objects as go

    fig = go.Figure(go.Bar(x=df["mode"], y=df.step_ms, text=df.step_ms.round(2),
                           name="measured step"))
    prep, comp = float(df.prep_ms.iloc[0]), float(df.compute_ms.iloc[0])
    for y, what in ((prep + comp, "prepare + compute"), (max(prep, comp), "max(prepare, compute)")):
        fig.add_hline(y=y, line_dash="dash", annotation_text=f"{what}: {y:.2f} ms")
    fig.update_layout(title=title, yaxis_title="ms per step")
    return fig


def record() -> dict:
    """`make record`: the bandwidth sweep, both hazards, the two timelines and the step times."""
    from labkit.measure.profile import trace

    dev = _cuda("cuda")
    out = {"h2d_sweep": h2d_sweep([2**k for k in range(12, 29, 2)], dev).to_dict(orient="list"),
           "d2h_too_early": d2h_read_too_early(device=dev),
           "reuse_unsafe": early_reuse(False, device=dev),
           "reuse_safe": early_reuse(True, device=dev),
           "steps": step_times(device=dev).to_dict(orient="list")}
    for name, overlap in (("serial", False), ("overlap", True)):
        run = copy_compute_runner(overlap, device=dev)
        t = trace(run, device=dev, warmup=1)
        run()
        out[f"trace_{name}"] = t.to_dict()
        out[f"timeline_{name}"] = copy_compute_overlap(t.events)
        out[f"prefetch_{name}"] = run.last["prefetcher"].stats.as_dict()
    return out
