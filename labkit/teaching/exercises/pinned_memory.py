"""Notebook 04's exercise: the event wait that makes a pinned buffer safe to refill.

A ring of pinned host buffers feeds a copy stream. A copy reads its buffer when the copy engine
gets to it, not when it was enqueued, so the CPU may write the next batch into a buffer only
after the event recorded behind that buffer's last copy has completed. The learner writes that
wait, and only that wait: waiting for more (the whole stream, the device) is correct but stops
the CPU from running ahead, and the check says so.

With no GPU the ring is simulated (:class:`SimStream`): a copy runs only when something waits
for it, the latest moment a real stream may run it, so every missing wait shows. That checks
the ordering; it does not run a DMA engine. On a GPU the ring is real: pinned buffers, a copy
stream kept busy, CUDA events.
"""
from __future__ import annotations

import random

import torch

from labkit.teaching.exercises import Case, Exercise

STRIDE = 1_000_000  # batch j holds j * STRIDE + arange(n): its first value says which batch it is


def make_batch(j: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int64) + j * STRIDE


class SimStream:
    """An in-order queue of copies that runs nothing until something waits on it."""

    def __init__(self):
        self._ops: list = []
        self.enqueued = self.completed = 0

    def enqueue(self, op) -> None:
        self._ops.append(op)
        self.enqueued += 1

    def run_until(self, position: int) -> None:
        while self.completed < position:
            self._ops.pop(0)()
            self.completed += 1

    def synchronize(self) -> None:
        self.run_until(self.enqueued)


class SimEvent:
    """Recorded behind everything enqueued so far on ``stream``."""

    def __init__(self, stream: SimStream, ring: "SimRing"):
        self.stream, self.position, self._ring = stream, stream.enqueued, ring

    def query(self) -> bool:
        return self.stream.completed >= self.position

    def synchronize(self) -> None:
        """Block the CPU until the copies before this event have run."""
        self.stream.run_until(self.position)

    def wait(self, stream=None) -> None:
        """Make a *stream* wait (on the GPU): the CPU does not wait at all."""
        self._ring.gpu_waits += 1


class SimRing:
    """``num_buffers`` host buffers of ``capacity`` int64, copied out on a simulated stream.

    ``last_copy[i]`` is the event behind buffer i's last copy (None before the first).
    """

    def __init__(self, num_buffers: int, capacity: int):
        self.buffers = [torch.zeros(capacity, dtype=torch.int64) for _ in range(num_buffers)]
        self.last_copy: list = [None] * num_buffers
        self.copy_stream = SimStream()
        self.max_in_flight, self.gpu_waits, self._next = 0, 0, 0

    def next_index(self) -> int:
        i, self._next = self._next, (self._next + 1) % len(self.buffers)
        return i

    def copy_async(self, i: int, n: int):
        """Enqueue the copy of ``buffers[i][:n]``; returns (device tensor, event behind it)."""
        dst, src = torch.full((n,), -1, dtype=torch.int64), self.buffers[i]
        self.copy_stream.enqueue(lambda: dst.copy_(src[:n]))
        in_flight = self.copy_stream.enqueued - self.copy_stream.completed
        self.max_in_flight = max(self.max_in_flight, in_flight)
        return dst, SimEvent(self.copy_stream, self)

    def drain(self) -> None:
        self.copy_stream.synchronize()


class CudaRing(SimRing):
    """The same ring on a GPU: pinned buffers, a real copy stream kept busy, CUDA events."""

    def __init__(self, num_buffers: int, capacity: int, device):
        from labkit.lessons.pinned_memory_streams import gpu_sleep

        self._sleep, self.device = gpu_sleep, device
        self.buffers = [torch.zeros(capacity, dtype=torch.int64, pin_memory=True)
                        for _ in range(num_buffers)]
        self.last_copy = [None] * num_buffers
        self.copy_stream = torch.cuda.Stream(device)
        self.max_in_flight, self.gpu_waits, self._next = None, 0, 0

    def copy_async(self, i: int, n: int):
        with torch.cuda.stream(self.copy_stream):
            self._sleep(0.5, self.device)  # the copy stream is still busy with earlier work
            dst = torch.empty(n, dtype=torch.int64, device=self.device)
            dst.copy_(self.buffers[i][:n], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.copy_stream)
        return dst, done

    def drain(self) -> None:
        self.copy_stream.synchronize()


def make_ring(num_buffers: int, capacity: int, device):
    device = torch.device(device)
    return CudaRing(num_buffers, capacity, device) if device.type == "cuda" else \
        SimRing(num_buffers, capacity)


def _arrived(dst: torch.Tensor, j: int) -> int:
    """Which batch ``dst`` holds (-1: a torn mix or nothing)."""
    if dst.numel() == 0:
        return j
    dst = dst.cpu()
    k = int(dst[0]) // STRIDE
    return k if torch.equal(dst, make_batch(k, dst.numel())) else -1


def send_all(send_batch, num_buffers: int, sizes: list[int], device) -> dict:
    """Push batches of ``sizes`` through a fresh ring with ``send_batch(ring, batch)``."""
    ring = make_ring(num_buffers, max(sizes + [1]), device)
    dsts = [send_batch(ring, make_batch(j, n)) for j, n in enumerate(sizes)]
    ring.drain()
    out = {"arrived": [_arrived(d, j) for j, d in enumerate(dsts)]}
    if ring.max_in_flight is not None:
        out["copies in flight at most"] = ring.max_in_flight
    out["_gpu_waits"] = ring.gpu_waits
    return out


def refill_at_once(ring, batch):
    """The hazard: write into the next buffer without waiting for its last copy."""
    i = ring.next_index()
    ring.buffers[i][: len(batch)].copy_(batch)
    dst, ring.last_copy[i] = ring.copy_async(i, len(batch))
    return dst


def _cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)

    def sizes(count, cap=8):
        return [rng.randrange(1, cap + 1) for _ in range(count)]

    return [Case("one buffer, 4 batches", (1, sizes(4), device)),
            Case("two buffers, 6 batches of different sizes", (2, sizes(6), device)),
            Case("three buffers, 7 batches", (3, sizes(7), device)),
            Case("two buffers: an empty batch and a one-element batch", (2, [4, 0, 1, 6, 3], device)),
            Case("more buffers than batches", (4, sizes(2), device))]


def _run(fn, case: Case) -> dict:
    num_buffers, sizes, device = case.args
    return send_all(fn, num_buffers, sizes, device)


def _expected(case: Case) -> dict:
    num_buffers, sizes, device = case.args
    out = {"arrived": list(range(len(sizes)))}
    if torch.device(device).type != "cuda":
        out["copies in flight at most"] = min(num_buffers, len(sizes))
    return out


def _diagnose(case: Case, got: dict, expected: dict) -> str | None:
    num_buffers = case.args[0]
    arrived = got.get("arrived") or []
    wrong = [(j, a) for j, a in enumerate(arrived) if a != j]
    if wrong:
        j, a = wrong[0]
        held = "a torn mix of batches" if a < 0 else f"batch {a}'s data"
        text = (f"Batch {j} arrived holding {held}: its copy read buffer {j % num_buffers} after "
                "the CPU had written a later batch into it. Before refilling a buffer, block the "
                "CPU on the event recorded behind that buffer's last copy.")
        if got.get("_gpu_waits"):
            text += (" You called event.wait(): that makes a stream wait, on the GPU; the CPU "
                     "went on writing at once. The CPU needs event.synchronize().")
        return text
    most = got.get("copies in flight at most")
    if most is not None and most < expected.get("copies in flight at most", 0):
        return (f"Every batch arrived, but never more than {most} copy was in flight with "
                f"{num_buffers} buffers: you waited for more than the buffer's own last copy (the "
                "whole stream, or the device?), so the CPU never ran ahead of the copy engine.")
    return None


def _note(device) -> str:
    if torch.device(device).type == "cuda":
        return ("Checked on this GPU: pinned buffers, a copy stream kept busy with a sleep kernel "
                "before every copy, CUDA events.")
    return ("No GPU here: the copy stream is simulated, and runs each copy only when something "
            "waits for it (the latest a real stream may). This proves the ordering: you wait for "
            "the right event before reusing a buffer, and for no more. It does not exercise a "
            "real DMA engine; on a GPU the same check does.")


EXERCISES = [Exercise(
    id="04.2", title="wait before refilling a pinned buffer", entry="send_batch",
    task="make it safe to write into ring.buffers[i], and wait no longer than that needs",
    cases=_cases, run=_run, expected=_expected, diagnose=_diagnose, note=_note,
    hints=(
        "The copy of buffer i that you enqueued two batches ago may not have run yet. What did "
        "`ring.copy_async` hand back besides the device tensor? (It is in `ring.last_copy[i]`.)",
        "An event marks a point in a stream. `event.synchronize()` blocks the CPU until the "
        "stream has got there; `event.wait()` only makes another *stream* wait.",
        "Before the first use of a buffer there is nothing to wait for: `ring.last_copy[i]` is "
        "None.",
    ),
    seen="With the wait, every batch arrives intact, and with two or more buffers the CPU still "
         "runs ahead: it writes batch j+1 while batch j's copy is queued. Without it, batches "
         "arrive holding later batches' data and nothing raises. This is `PinnedStagingPool` in "
         "`labkit/overlap/staging.py`: one event per buffer, waited for only when that buffer comes round.",
)]
