"""Notebook 04's second exercise: the copy stream, its event, and ``record_stream``, raw.

The learner writes the prefetch handshake in PyTorch's own calls, through a ``cuda`` argument:
each host batch is copied to the device on a copy stream, an event is recorded behind the copy,
the compute stream waits on that event (the CPU does not), and the device tensor, allocated on
the copy stream and read on the compute stream, is handed to the compute stream with
``record_stream`` before it is dropped.

On a GPU ``cuda`` is ``torch.cuda``: host batches are pinned, and the compute first sleeps on
the GPU, so a skipped wait reads a copy that has not landed and a skipped ``record_stream`` lets
the next batch's copy reuse the block the compute has yet to read. On a CPU it is
``labkit.graphs.emulated_cuda`` inside ``running()``: a queued copy runs as late as the stream
order allows (a read that skips the wait gets NaN), and a cross-stream read with no
``record_stream`` is reported by the allocator's rule.
"""
from __future__ import annotations

import random

import torch

from labkit.graphs import emulated_cuda
from labkit.teaching.exercises import Case, Exercise

SLEEP_MS = 2.0  # the compute stream's work before it reads a batch (GPU only)


def _compute(device):
    """What the compute stream does with a batch: on a GPU, after a GPU-side sleep."""
    if device.type != "cuda":
        return lambda x: x * 2 + 1

    from labkit.lessons.pinned_memory_streams import gpu_sleep

    def compute(x):
        gpu_sleep(SLEEP_MS, device)
        return x * 2 + 1
    return compute


def _cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    pin = device.type == "cuda"

    def host(n, dtype=torch.float32):
        t = (torch.randn(n, generator=g) * 100).to(dtype)
        return t.pin_memory() if pin else t

    n = rng.randrange(1000, 5000)
    return [Case("one batch", ([host(n)],)),
            Case("one element, twice", ([host(1), host(1)],)),
            Case("six batches of one size: the allocator's favourite case for reuse",
                 ([host(n) for _ in range(6)],)),
            Case(f"integers, sizes {n} then {n + 7} then {n}",
                 ([host(n, torch.int64), host(n + 7, torch.int64), host(n, torch.int64)],))]


def _run(fn, case: Case) -> dict:
    (hosts,) = case.args
    device = torch.device("cuda" if hosts[0].is_pinned() else "cpu")
    cuda = emulated_cuda.cuda_for(device)
    if device.type == "cuda":
        outs = fn(cuda, hosts, _compute(device), device)
        torch.cuda.synchronize()
        missing = 0
    else:
        with emulated_cuda.running() as streams:
            outs = fn(cuda, hosts, _compute(device), device)
        missing = len(streams.missing_record_stream())
    return {"outputs": [o.cpu() if isinstance(o, torch.Tensor) else o for o in outs],
            "reads with no record_stream": missing}


def _expected(case: Case) -> dict:
    (hosts,) = case.args
    return {"outputs": [h * 2 + 1 for h in hosts], "reads with no record_stream": 0}


def _diagnose(case: Case, got: dict, expected: dict) -> str | None:
    (hosts,) = case.args
    if got.get("reads with no record_stream"):
        return ("A batch allocated on the copy stream was read on the compute stream with no "
                "`dev.record_stream(cuda.current_stream())`: when you drop it, the caching "
                "allocator hands its memory to the copy stream's next allocation at once, while "
                "the compute stream may still be reading it.")
    outs = got.get("outputs") or []
    if any(isinstance(o, torch.Tensor) and o.is_floating_point() and o.isnan().any()
           for o in outs):
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
        return (f"Checked with torch.cuda: pinned batches, a real copy stream, and {SLEEP_MS} ms "
                "of GPU work before each read, so a missing wait or record_stream shows.")
    return ("No GPU here: `cuda` is labkit.graphs.emulated_cuda, where a queued copy runs as late "
            "as the stream order allows and the allocator's record_stream rule is checked; on a "
            "GPU the same function gets torch.cuda.")


EXERCISES = [Exercise(
    id="04.2", title="prefetch on a copy stream, raw", entry="prefetch",
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
