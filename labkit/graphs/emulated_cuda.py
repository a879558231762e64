"""A CPU stand-in for the ``torch.cuda`` calls that capture and replay a graph.

``cuda = torch.cuda if on_gpu else emulated_cuda`` lets a learner write the raw idiom on any
machine, with the names PyTorch documents::

    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        step(static_in)                      # warm-up, outside the graph
    cuda.current_stream().wait_stream(side)
    g = cuda.CUDAGraph()
    with cuda.graph(g):
        static_out = step(static_in)
    static_in.copy_(batch); g.replay()       # static_out now holds step(batch)

Capture records every aten op the step runs, with the very tensors it read and wrote; replay
reruns them in order and writes each result into the tensor the capture produced. So it freezes
what a CUDA Graph freezes: the input tensors (a rebound name is not read), every Python value
and branch (they were never recorded), and the output storage (the next replay overwrites it).
Reading a value back to the host during capture (``.item()``, ``bool(t)``, ``nonzero``) raises,
as a CUDA capture does.

Streams and events order work only inside ``running()`` (the exercise checks enter it): there,
an op issued while a side stream is current is queued on that stream and runs as late as the
stream order allows (when an event behind it is waited on, the stream is waited on or
synchronised, or ``running()`` ends), and what it allocates reads as NaN (-1 for integers)
until then. So a read that skips the wait gets poison instead of data, every time. A tensor
allocated on one stream and read on another is noted, with the ``record_stream`` calls made
for it: the caching allocator's rule (without one, freeing it lets its memory go to its own
stream's next allocation while the other stream still reads it). Outside ``running()`` every op
runs at once, in issue order.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# ops that read a device value back to the host: illegal while a CUDA stream captures
_HOST_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
               torch.ops.aten.nonzero.default, torch.ops.aten.item.default}
_capturing: list[CUDAGraph] = []


class _Recorder(TorchDispatchMode):
    def __init__(self, ops: list):
        super().__init__()
        self.ops = ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _HOST_READS:
            raise RuntimeError(
                f"CUDA error: operation not permitted when stream is capturing ({func.__name__} "
                "reads a value back to the host; labkit's CPU stand-in refuses it as CUDA does)")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class CUDAGraph:
    """``capture_begin()`` / ``capture_end()`` (what ``graph(g)`` calls), ``replay()``,
    ``reset()``."""

    def __init__(self):
        self._ops: list | None = None
        self._recorder: _Recorder | None = None

    def capture_begin(self, *args, **kwargs) -> None:
        if _capturing:
            raise RuntimeError("a capture is already under way: end it before starting another")
        self._ops, self._recorder = [], None
        self._recorder = _Recorder(self._ops)
        self._recorder.__enter__()
        _capturing.append(self)

    def capture_end(self) -> None:
        _capturing.remove(self)
        self._recorder.__exit__(None, None, None)
        self._recorder = None

    def _abandon(self) -> None:
        self.capture_end()
        self._ops = None  # a failed capture leaves nothing to replay

    def replay(self) -> None:
        if self._ops is None:
            raise RuntimeError("replay() of a graph that holds no finished capture")
        with torch.inference_mode():
            for func, args, kwargs, out in self._ops:
                result = func(*args, **kwargs)
                for kept, new in zip(tree_leaves(out), tree_leaves(result)):
                    # views and in-place ops already wrote where the capture did
                    if isinstance(kept, torch.Tensor) and not _same_storage(kept, new):
                        kept.copy_(new)

    def reset(self) -> None:
        self._ops = None

    def pool(self):
        return None


class graph(contextlib.AbstractContextManager):
    """``with graph(g):`` captures the block into ``g`` (``pool`` and ``stream`` are accepted
    and mean nothing on one CPU thread)."""

    def __init__(self, cuda_graph: CUDAGraph, pool=None, stream=None, **kwargs):
        self.cuda_graph = cuda_graph

    def __enter__(self):
        self.cuda_graph.capture_begin()
        return self

    def __exit__(self, kind, error, tb):
        if kind is None:
            self.cuda_graph.capture_end()
        else:
            self.cuda_graph._abandon()
        return False


class Event:
    def __init__(self, enable_timing: bool = False, **kwargs):
        self.stream: Stream | None = None
        self.position = 0

    def record(self, stream: Stream | None = None) -> None:
        self.stream = stream or current_stream()
        self.position = len(self.stream.issued)

    def wait(self, stream: Stream | None = None) -> None:
        self.synchronize()  # the waiting stream's later work follows: run the work before us

    def query(self) -> bool:
        return self.stream is None or self.stream.done >= self.position

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.position)


class Stream(torch.Stream):
    """A ``torch.Stream`` (so ``Tensor.record_stream`` takes it) with an in-order queue.
    Streams compare equal as torch.Streams on one device do: tell them apart with ``is``."""

    _made = 0

    def __new__(cls, device=None, priority: int = 0, **kwargs):
        Stream._made += 1  # a stream id of its own: record_stream passes the id, not the object
        return super().__new__(cls, stream_id=Stream._made, device_index=-1, device_type=0)

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.issued: list = []   # closures, in issue order
        self.done = 0            # how many of them have run

    def run_until(self, position: int) -> None:
        while self.done < position:
            self.done += 1
            with _passing_through():
                self.issued[self.done - 1]()

    def wait_stream(self, other: Stream) -> None:
        other.run_until(len(other.issued))

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.run_until(len(self.issued))

    def query(self) -> bool:
        return self.done >= len(self.issued)


_DEFAULT = Stream()
_entered: list[Stream] = []   # the streams `with stream(s):` made current, innermost last
_sides: list[Stream] = []     # every side stream that queued work, to drain at the end
_ACTIVE: list[_Streams] = []


def current_stream(device=None) -> Stream:
    return _entered[-1] if _entered else _DEFAULT


@contextlib.contextmanager
def stream(s: Stream | None):
    if s is None:
        yield s
        return
    _entered.append(s)
    try:
        yield s
    finally:
        _entered.pop()


def synchronize(device=None) -> None:
    for s in _sides:
        s.synchronize()


def graph_pool_handle():
    """A shared memory pool for graphs: one CPU thread has nothing to share, so None."""
    return None


def is_current_stream_capturing() -> bool:
    return bool(_capturing)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _poisoned(t: torch.Tensor) -> torch.Tensor:
    return torch.full_like(t, float("nan") if t.is_floating_point() else -1)


class _Streams(TorchDispatchMode):
    """Queues side-stream ops; notes cross-stream reads and record_stream calls."""

    def __init__(self):
        super().__init__()
        self.owner: dict[int, Stream] = {}        # storage -> the stream that allocated it
        self.crossed: dict[tuple, str] = {}       # (storage, reading stream_id) -> op name
        self.recorded: set[tuple] = set()         # (storage, stream_id) record_stream named
        self.passing = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.passing:
            return func(*args, **kwargs)
        if func is torch.ops.aten.record_stream.default:
            self.recorded.add((_key(args[0]), args[1].stream_id))
            return None
        here = current_stream()
        for t in tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor) and (owner := self.owner.get(_key(t))) is not None \
                    and owner is not here:
                self.crossed.setdefault((_key(t), here.stream_id), func.__name__)
        if here is _DEFAULT:
            return func(*args, **kwargs)
        if not any(s is here for s in _sides):  # streams compare equal: by identity
            _sides.append(here)
        if func._schema.is_mutable:  # in place (copy_, add_): it happens when the stream runs
            here.issued.append(lambda: func(*args, **kwargs))
            return args[0]
        result = func(*args, **kwargs)
        if not isinstance(result, torch.Tensor):
            return result
        out = _poisoned(result)
        self.owner[_key(out)] = here
        if not func.overloadpacket.__name__.startswith("empty"):  # empty*: nothing to compute
            here.issued.append(lambda: out.copy_(func(*args, **kwargs)))
        return out

    def missing_record_stream(self) -> list[str]:
        """Cross-stream reads of a tensor with no record_stream for the reading stream."""
        return [op for (storage, reader), op in self.crossed.items()
                if (storage, reader) not in self.recorded]


@contextlib.contextmanager
def _passing_through():
    modes = [m for m in _ACTIVE if not m.passing]
    for m in modes:
        m.passing = True
    try:
        yield
    finally:
        for m in modes:
            m.passing = False


def cuda_for(device):
    """``torch.cuda`` on a CUDA device, this stand-in elsewhere: one ``cuda`` for both."""
    return torch.cuda if torch.device(device).type == "cuda" else sys.modules[__name__]


def order(device) -> contextlib.AbstractContextManager:
    """``running()`` on a CPU; on a GPU nothing: its streams order work themselves."""
    return contextlib.nullcontext() if torch.device(device).type == "cuda" else running()


@contextlib.contextmanager
def running():
    """Streams that order work (see the module docstring); yields the mode, whose
    ``missing_record_stream()`` lists the cross-stream reads no ``record_stream`` covered.
    Every queued op has run when it ends (the device drained)."""
    mode = _Streams()
    _ACTIVE.append(mode)
    try:
        with mode:
            yield mode
            synchronize()
    finally:
        _ACTIVE.remove(mode)
        _sides.clear()
