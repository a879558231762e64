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
as a CUDA capture does. Streams and events exist for their calls; on one CPU thread every op
runs in issue order, so they order nothing.
"""
from __future__ import annotations

import contextlib

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
        self.recorded = False

    def record(self, stream: Stream | None = None) -> None:
        self.recorded = True

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Stream:
    def wait_stream(self, other: Stream) -> None:
        pass

    def wait_event(self, event: Event) -> None:
        pass

    def record_event(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT = Stream()


def current_stream(device=None) -> Stream:
    return _DEFAULT


@contextlib.contextmanager
def stream(s: Stream | None):
    yield s


def synchronize(device=None) -> None:
    pass


def is_current_stream_capturing() -> bool:
    return bool(_capturing)
