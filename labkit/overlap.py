"""Overlap copies with compute: pinned staging, a copy stream, events, prefetch, safe readback.

    from labkit.overlap import PinnedStagingPool, Prefetcher, copy_to_host

* :class:`~labkit.staging.PinnedStagingPool`: pinned host buffers reused in turn for
  host-to-device copies, each handed out again only after its last copy's event completed.
* :class:`~labkit.prefetch.Prefetcher`: copy batch i+1 on a copy stream while the compute
  stream works on batch i.
* :class:`~labkit.tensor_parallel.TensorParallelMLP`: a column- then row-parallel MLP whose
  all-reduce runs serially or overlapped with the next chunk's compute, across processes.
* :func:`copy_to_host` (device to host): a non-blocking copy into pinned memory that returns
  only once the copy's event has completed, so the values read are never stale.
  :func:`start_copy_to_host` returns at once with the handle, for reading one step later.

With no CUDA device every one of them works synchronously, pins nothing and says so once.
"""
from __future__ import annotations

import torch

from labkit.prefetch import PrefetchStats, Prefetcher
from labkit.staging import (InFlightCopy, PinnedStagingPool, StagingStats,
                            SynchronousFallbackWarning, announce_synchronous)
from labkit.tensor_parallel import (TensorParallelMLP, TPConfig, TPExperiment, mlp_reference,
                                    run_experiment)

__all__ = ["PinnedStagingPool", "Prefetcher", "copy_to_host", "start_copy_to_host",
           "InFlightCopy", "StagingStats", "PrefetchStats", "SynchronousFallbackWarning",
           "TensorParallelMLP", "TPConfig", "TPExperiment", "mlp_reference", "run_experiment"]


def _check_out(t: torch.Tensor, out: torch.Tensor | None) -> None:
    if out is None:
        return
    if out.shape != t.shape or out.dtype != t.dtype:
        raise ValueError(f"out is {tuple(out.shape)} {out.dtype} but the tensor to copy is "
                         f"{tuple(t.shape)} {t.dtype}: pass a matching out, or none")
    if out.device.type != "cpu":
        raise ValueError(f"out must be a host tensor, got one on {out.device}")
    if t.device.type == "cuda" and not out.is_pinned():
        raise ValueError("out is pageable: a copy into it cannot be asynchronous (the driver "
                         "stages it and blocks); allocate it with pin_memory=True, or pass none")


def start_copy_to_host(t: torch.Tensor, out: torch.Tensor | None = None) -> InFlightCopy:
    """Enqueue ``t`` -> pinned host memory on the current stream (after the work that produces
    ``t``) and return at once. Read ``.synchronize()``'s result, never ``.tensor`` directly:
    until the event completes it holds whatever was there before."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(t).__name__}")
    _check_out(t, out)
    if t.device.type != "cuda":
        announce_synchronous(t.device)
        host = t.clone() if out is None else out.copy_(t)
        return InFlightCopy(host, None, None)
    host = out if out is not None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    stream = torch.cuda.current_stream(t.device)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(stream)
    return InFlightCopy(host, done, stream, source=t)


def copy_to_host(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` copied to (pinned) host memory; returns only when the copy's event has completed.

    ``out``: a pinned host tensor of the same shape and dtype to reuse (no allocation); it is
    overwritten, and it is safe to read when this returns.
    """
    return start_copy_to_host(t, out).synchronize()
