"""Device-to-host readback that is never stale: a non-blocking copy into pinned memory,
read only once its event has completed."""
from __future__ import annotations

import torch

from labkit.overlap.staging import InFlightCopy, announce_synchronous


def _check_out(t: torch.Tensor, out: torch.Tensor | None) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a host tensor to copy into (or None), got "
                        f"{type(out).__name__}")
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
