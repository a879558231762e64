"""Notebook 04's second exercise: the copy stream, its event, and ``record_stream``, raw.

The learner writes the prefetch handshake in PyTorch's own calls, through a ``cuda`` argument:
each host batch is copied to the device on a copy stream, an event is recorded behind the copy,
the compute stream waits on that event (the CPU does not), and the device tensor, allocated on
the copy stream and read on the compute stream, is handed to the compute stream with
``record_stream`` before it is dropped.

On a GPU ``cuda`` is ``torch.cuda`` with pinned host batches, in two timings. A late copy:
every ``with cuda.stream(s):`` block starts with GPU sleep on ``s``, so a compute stream that skips
the wait reads the block before its copy lands. A slow compute: the compute sleeps on the GPU
before it reads, so a skipped ``record_stream`` lets the next batch's copy reuse the block first.
One more case runs on CPU tensors under the stand-in below, which catches both mistakes on every
run. On a CPU ``cuda`` is ``labkit.graphs.emulated_cuda`` inside ``running()``: a queued copy
runs as late as the stream order allows (a read that skips the wait gets NaN), and a cross-stream
read with no ``record_stream`` is reported by the allocator's rule.
"""
from __future__ import annotations

import contextlib
import random

import torch

from labkit.graphs import emulated_cuda
from labkit.teaching.exercises import Case, Exercise

SLEEP_MS = 2.0  # GPU only: the copy stream's work before a late copy, the compute's before a read
LATE_COPY, SLOW_COMPUTE = "late copy", "slow compute"  # the two GPU timings


class _LateCopies:
    """``torch.cuda``, except that each ``with cuda.stream(s):`` block starts with GPU sleep on
    ``s``: the copy queued inside lands late, so only a wait on the compute stream makes it safe."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @contextlib.contextmanager
    def stream(self, s):
        from labkit.lessons.pinned_memory_streams import gpu_sleep

        with torch.cuda.stream(s):
            if s is not None:
                gpu_sleep(SLEEP_MS, s.device)
            yield


def _compute(device, timing):
    """What the compute stream does with a batch: in a slow compute, after GPU sleep."""
    if timing != SLOW_COMPUTE:
        return lambda x: x * 2 + 1

    from labkit.lessons.pinned_memory_streams import gpu_sleep

    def compute(x):
        gpu_sleep(SLEEP_MS, device)
        return x * 2 + 1
    return compute


def _cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    gpu = device.type == "cuda"

    def host(n, dtype=torch.float32):  # pinned by _run on a GPU: a deep copy would unpin it
        return (torch.randn(n, generator=g) * 100).to(dtype)

    def on(timing):  # the timing a GPU case runs in, named in its label; None: the stand-in
        return (f", {timing}", timing) if gpu else ("", None)

    n = rng.randrange(1000, 5000)
    late, slow = on(LATE_COPY), on(SLOW_COMPUTE)
    cases = [Case("one batch" + late[0], ([host(n)], late[1])),
             Case("one element, twice" + late[0], ([host(1), host(1)], late[1])),
             Case("six batches of one size: the allocator's favourite case for reuse" + slow[0],
                  ([host(n) for _ in range(6)], slow[1])),
             Case(f"integers, sizes {n} then {n + 7} then {n}" + slow[0],
                  ([host(n, torch.int64), host(n + 7, torch.int64), host(n, torch.int64)],
                   slow[1]))]
    if gpu:  # the stand-in catches both mistakes whatever the GPU's timing
        cases.append(Case("six batches on labkit's CPU stand-in, each copy run as late as the "
                          "stream order allows", ([host(n) for _ in range(6)], None)))
    return cases


def _run(fn, case: Case) -> dict:
    hosts, timing = case.args
    device = torch.device("cuda" if timing else "cpu")
    if device.type == "cuda":
        hosts = [h.pin_memory() for h in hosts]
        cuda = _LateCopies() if timing == LATE_COPY else torch.cuda
        outs = fn(cuda, hosts, _compute(device, timing), device)
        torch.cuda.synchronize()
        missing = 0
    else:
        with emulated_cuda.running() as streams:
            outs = fn(emulated_cuda, hosts, _compute(device, timing), device)
        missing = len(streams.missing_record_stream())
    return {"outputs": [o.cpu() if isinstance(o, torch.Tensor) else o for o in outs],
            "reads with no record_stream": missing}


def _expected(case: Case) -> dict:
    hosts, _ = case.args
    return {"outputs": [h * 2 + 1 for h in hosts], "reads with no record_stream": 0}


def _diagnose(case: Case, got: dict, expected: dict) -> str | None:
    hosts, timing = case.args
    if got.get("reads with no record_stream"):
        return ("A batch allocated on the copy stream was read on the compute stream with no "
                "`dev.record_stream(cuda.current_stream())`: when you drop it, the caching "
                "allocator hands its memory to the copy stream's next allocation at once, while "
                "the compute stream may still be reading it.")
    outs = got.get("outputs") or []
    if timing == LATE_COPY or any(isinstance(o, torch.Tensor) and o.is_floating_point()
                                  and o.isnan().any() for o in outs):
        return ("The compute read a batch before its copy ran. Record an event on the copy "
                "stream right after the copy (`ready = cuda.Event(); ready.record()` inside the "
                "`with cuda.stream(copy_stream):` block) and make the compute stream wait for "
                "it: `cuda.current_stream().wait_event(ready)`.")
    later = [h * 2 + 1 for h in hosts]
    for i, o in enumerate(outs):
        if isinstance(o, torch.Tensor) and any(
                j != i and o.shape == later[j].shape and torch.equal(o, later[j])
                for j in range(len(later))):
            return (f"Output {i} holds another batch's result: its device block was reused for "
                    "a later copy while the compute stream had yet to read it. Call "
                    "`dev.record_stream(cuda.current_stream())` before dropping `dev`.")
    return None


def _note(device) -> str:
    if device.type == "cuda":
        return (f"Checked with torch.cuda and pinned batches: {SLEEP_MS} ms of GPU work queued "
                "on the copy stream before each copy (a late copy: a missing wait shows) or on "
                "the compute stream before each read (a slow compute: a missing record_stream "
                "shows), and once on labkit's CPU stand-in.")
    return ("No GPU here: `cuda` is labkit.graphs.emulated_cuda, where a queued copy runs as late "
            "as the stream order allows and the allocator's record_stream rule is checked; on a "
            "GPU the same function gets torch.cuda.")


EXERCISES = [Exercise(
    id="04.1", title="prefetch on a copy stream, raw", entry="prefetch",
    task="copy each batch on a copy stream, record an event, make the compute stream wait on "
         "it, record_stream the device tensor, compute",
    cases=_cases, run=_run, expected=_expected, diagnose=_diagnose, note=_note,
    atol=1e-5, rtol=1e-5,
    hints=(
        "Make one `copy_stream = cuda.Stream()` before the loop. Inside `with "
        "cuda.stream(copy_stream):` allocate `dev = torch.empty_like(host, device=device)` and "
        "`dev.copy_(host, non_blocking=True)`.",
        "Still inside that block, `ready = cuda.Event(); ready.record()`: the event sits behind "
        "the copy. Outside it, `cuda.current_stream().wait_event(ready)`: the compute stream "
        "waits, the CPU does not.",
        "`dev` was allocated on the copy stream and is read on the compute stream: "
        "`dev.record_stream(cuda.current_stream())`, then `compute(dev)`.",
    ),
    seen="The CPU never waited: it queued each copy, recorded an event behind it and told the "
         "compute stream to wait for that event, so copies and compute could overlap. "
         "record_stream kept each device block from going back to the copy stream's pool until "
         "the compute stream had read it. This is what `labkit.overlap.Prefetcher` does for "
         "every batch; the staging pool adds the same care for the pinned host side.",
)]
