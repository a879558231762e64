"""Pinned staging buffers: host-to-device copies that run while the CPU and the GPU carry on.

From pageable memory a copy cannot be a plain DMA (the OS may move or swap the page), so the
driver first copies the data into a pinned buffer of its own and the call returns only once that
is done. From pinned (page-locked) memory the copy engine reads directly: ``copy_(...,
non_blocking=True)`` returns at once and the copy runs later, in its stream's order.

That freedom has a price. The copy reads the host buffer *when the copy engine gets to it*, not
when it was enqueued, so writing the next batch into the same buffer too early silently sends
the next batch (or half of each). :class:`PinnedStagingPool` keeps a few persistent pinned
buffers, hands them out in turn, and hands one out again only after the event recorded behind
its last copy has completed.

    pool = PinnedStagingPool(num_buffers=2)
    x = pool.to_device(batch)            # the current stream waits for the copy on the GPU
    host = pool.stage((256,), torch.int64)   # or: write the batch straight into pinned memory
    host.copy_(token_ids); x = pool.submit().wait()

With no GPU the same API copies synchronously, pins nothing and says so once.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from labkit.device import select_device

_announced = False


class SynchronousFallbackWarning(UserWarning):
    """Emitted once per process when the overlap utilities run with no CUDA device."""


def announce_synchronous(device: torch.device) -> None:
    """Say once per process that there is nothing to overlap here."""
    global _announced
    if _announced:
        return
    _announced = True
    warnings.warn(
        f"labkit.overlap on {device}: no CUDA device, so copies run synchronously, nothing is "
        "pinned and streams/events do nothing; the API and the results are the same",
        SynchronousFallbackWarning, stacklevel=3)


@dataclass(frozen=True)
class StagingStats:
    num_buffers: int
    bytes_pinned: int      # host memory the pool holds page-locked
    copies: int
    bytes_copied: int
    waits: int             # handing a buffer out had to wait for its previous copy to finish
    wait_ms: float         # CPU time spent in those waits
    grows: int             # buffers (re)allocated larger
    pinned: bool           # False on the synchronous path


@dataclass
class InFlightCopy:
    """A copy that may still be running: ``tensor`` holds the data once ``done`` has completed.

    ``done is None`` means the copy already happened (the synchronous path). ``source`` keeps
    the memory the copy reads from alive until this handle is dropped.
    """
    tensor: torch.Tensor
    done: torch.cuda.Event | None
    stream: torch.cuda.Stream | None
    source: torch.Tensor | None = None

    def wait(self, stream: torch.cuda.Stream | None = None) -> torch.Tensor:
        """Make ``stream`` (default: the current one) wait for the copy on the GPU; the CPU
        does not block. Use the returned tensor on that stream only."""
        if self.done is None:
            return self.tensor
        on_device = self.tensor.device.type == "cuda"
        consumer = stream or torch.cuda.current_stream(self.tensor.device if on_device else None)
        consumer.wait_event(self.done)
        if on_device and consumer != self.stream:
            # The tensor was allocated on the copy stream. Without this the caching allocator,
            # once it is freed, could hand its memory to the next copy while the consumer's
            # kernels still read it.
            self.tensor.record_stream(consumer)
        return self.tensor

    def synchronize(self) -> torch.Tensor:
        """Block the CPU until the copy is done (what a device-to-host read needs)."""
        if self.done is not None:
            self.done.synchronize()
        return self.tensor

    def ready(self) -> bool:
        return self.done is None or self.done.query()


def _byte_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int number of bytes, got {type(value).__name__} "
                        f"{value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {value}")
    return value


def _shape_and_dtype(shape, dtype) -> torch.Size:
    """What ``stage`` may hand out: a shape of ints >= 0 and a real dtype (dtype=None would
    silently mean float32)."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r}")
    try:
        size = torch.Size(shape)
    except TypeError:
        raise TypeError(f"shape must be a tuple of ints such as (256,), got {shape!r}") from None
    if any(d < 0 for d in size):
        raise ValueError(f"shape {tuple(size)} has a negative size; sizes must be >= 0")
    return size


def _nbytes(shape: torch.Size, dtype: torch.dtype) -> int:
    return shape.numel() * torch.empty((), dtype=dtype).element_size()


def _capacity_for(nbytes: int, minimum: int) -> int:
    """Next power of two: awkward, slowly growing sizes then cost few re-pinnings."""
    need = max(nbytes, minimum, 1)
    return 1 << (need - 1).bit_length()


class PinnedStagingPool:
    """``num_buffers`` pinned host buffers reused in turn for copies to ``device``.

    A buffer is handed out again only after the event behind its last copy has completed (the
    CPU waits when it has not; ``stats`` counts those waits). Buffers grow on demand, never
    inside a CUDA graph capture: call :meth:`reserve` before capturing.
    """

    def __init__(self, num_buffers: int = 2, device: str | torch.device = "auto",
                 copy_stream: torch.cuda.Stream | None = None, min_buffer_bytes: int = 1 << 16):
        if isinstance(num_buffers, bool) or not isinstance(num_buffers, int) or num_buffers < 1:
            raise ValueError(f"num_buffers must be an int >= 1 (2 lets the CPU fill one buffer "
                             f"while the other is being copied), got {num_buffers!r}")
        _byte_count("min_buffer_bytes", min_buffer_bytes)
        self.device = select_device(device)
        self.pinned = self.device.type == "cuda"
        if not self.pinned:
            if copy_stream is not None:
                raise ValueError(f"copy_stream was given but the pool copies to {self.device}, "
                                 "where there are no streams; leave it out")
            announce_synchronous(self.device)
        self.copy_stream = (copy_stream or torch.cuda.Stream(self.device)) if self.pinned else None
        self.min_buffer_bytes = min_buffer_bytes
        self._buffers: list[torch.Tensor | None] = [None] * num_buffers   # uint8 [capacity]
        self._events: list[torch.cuda.Event | None] = [None] * num_buffers
        self._next = 0
        self._staged: tuple[int, torch.Tensor] | None = None
        self._copies = self._bytes_copied = self._waits = self._grows = 0
        self._wait_s = 0.0

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)

    @property
    def stats(self) -> StagingStats:
        return StagingStats(
            num_buffers=self.num_buffers,
            bytes_pinned=sum(b.numel() for b in self._buffers if b is not None),
            copies=self._copies, bytes_copied=self._bytes_copied, waits=self._waits,
            wait_ms=self._wait_s * 1e3, grows=self._grows, pinned=self.pinned)

    def __repr__(self) -> str:
        s = self.stats
        return (f"PinnedStagingPool({s.num_buffers} buffers, {s.bytes_pinned:,} bytes pinned, "
                f"{s.copies} copies, {s.waits} waits, device={self.device})")

    def _wait_for(self, i: int) -> None:
        event = self._events[i]
        if event is not None and not event.query():
            t0 = time.perf_counter()
            event.synchronize()
            self._wait_s += time.perf_counter() - t0
            self._waits += 1

    def _ensure_capacity(self, i: int, nbytes: int) -> None:
        buf = self._buffers[i]
        if buf is not None and buf.numel() >= nbytes:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"staging buffer {i} holds {0 if buf is None else buf.numel():,} bytes and "
                f"{nbytes:,} were asked for during a CUDA graph capture, where memory cannot be "
                f"pinned: call pool.reserve({nbytes}) before capturing")
        self._wait_for(i)   # the old buffer may still be read by its last copy
        new = torch.empty(_capacity_for(nbytes, self.min_buffer_bytes), dtype=torch.uint8,
                          pin_memory=True)
        self._buffers[i] = new
        self._grows += 1

    def reserve(self, nbytes: int) -> None:
        """Grow every buffer to hold at least ``nbytes`` now (e.g. before a graph capture)."""
        _byte_count("nbytes", nbytes)
        if self.pinned:
            for i in range(self.num_buffers):
                self._ensure_capacity(i, nbytes)

    def stage(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer of ``shape``/``dtype`` that no copy is reading: fill it, then
        :meth:`submit`. Pinned on a GPU; a fresh CPU tensor on the synchronous path."""
        if self._staged is not None:
            raise RuntimeError("a buffer is already staged: submit() it before staging another")
        shape = _shape_and_dtype(shape, dtype)
        if not self.pinned:
            host = torch.empty(shape, dtype=dtype)
        else:
            nbytes = _nbytes(shape, dtype)
            i = self._next
            self._ensure_capacity(i, nbytes)
            if not torch.cuda.is_current_stream_capturing():
                self._wait_for(i)
            host = self._buffers[i][:nbytes].view(dtype).view(shape)
        self._staged = (self._next, host)
        return host

    def submit(self, stream: torch.cuda.Stream | None = None) -> InFlightCopy:
        """Copy the staged buffer to the device on ``stream`` (default: the pool's copy stream)
        and record the event that guards the buffer's reuse."""
        if self._staged is None:
            raise RuntimeError("nothing is staged: call stage(shape, dtype), fill the buffer it "
                               "returns, then submit()")
        i, host = self._staged
        if not self.pinned:
            copy = InFlightCopy(host, None, None)
        else:
            stream = stream or self.copy_stream
            with torch.cuda.stream(stream):
                # Allocated on the copy stream: its memory's previous user is ordered before
                # this copy, without making the copy wait for the compute stream.
                dst = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                dst.copy_(host, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            self._events[i] = done
            copy = InFlightCopy(dst, done, stream)
        self._staged = None
        self._next = (i + 1) % self.num_buffers
        self._copies += 1
        self._bytes_copied += host.numel() * host.element_size()
        return copy

    def copy_async(self, src: torch.Tensor, stream: torch.cuda.Stream | None = None) -> InFlightCopy:
        """Stage ``src`` (a host tensor, any layout) and start its copy; returns at once on a GPU."""
        if not isinstance(src, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor on the host, got {type(src).__name__}")
        if src.device.type != "cpu":
            raise ValueError(f"the pool copies host tensors to {self.device}; this one is already "
                             f"on {src.device}: use it as it is")
        host = self.stage(src.shape, src.dtype)
        try:
            host.copy_(src)
        except BaseException:
            self._staged = None
            raise
        return self.submit(stream)

    def to_device(self, src: torch.Tensor) -> torch.Tensor:
        """``src`` on the device, ready for the current stream (which waits on the GPU, not the
        CPU). ``src`` may be overwritten as soon as this returns."""
        return self.copy_async(src).wait()
