"""Programmatic dependent launch (PDL): a kernel starts while the one ahead of it is finishing.

A decode step at batch 1 is a chain of small kernels, each a few microseconds, and between two
of them the GPU idles: the last programs of one kernel drain, then the next kernel's programs
are scheduled and issue their first loads. On Hopper (sm_90) a kernel launched as a
*programmatic dependent* may start before the kernel ahead of it in the stream has finished:

* the kernel ahead calls ``gdc_launch_dependents()`` (griddepcontrol.launch_dependents); once
  every one of its programs has called it (or exited), the next kernel's programs may be
  scheduled on the SMs it leaves;
* the dependent calls ``gdc_wait()`` (griddepcontrol.wait) before it reads anything the kernel
  ahead wrote: it returns once that kernel has finished and its writes are visible. Whatever
  no kernel of the step writes (weights) it may load before waiting.

CUDA Graph capture keeps these edges, so a replayed step overlaps each kernel's start with its
predecessor's tail. A kernel launched this way that runs behind a kernel that never calls
``gdc_launch_dependents()`` (a torch op, cuBLAS) simply starts when that one ends.

``wait_for_kernel_ahead(PDL)`` is the two calls for a kernel with nothing to load early;
``launch_options(pdl)`` the launch's keyword; ``pdl_for(device)`` whether to use it (on for
compiled Triton on sm_90+, unless ``pdl_launches(False)`` turned it off).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager

import labkit  # noqa: F401  (before triton: interpreter on where there is no GPU)
import torch
import triton
import triton.language as tl
from labkit.device import interpreter_on
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

ENABLED = True


@functools.lru_cache(maxsize=None)  # asked at every launch: an eager step launches hundreds
def pdl_supported(device: torch.device) -> bool:
    """Programmatic dependent launch: compiled Triton on a Hopper (sm_90) or newer GPU."""
    return (device.type == "cuda" and not interpreter_on()
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_for(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch as programmatic dependents now."""
    return ENABLED and pdl_supported(device)


@contextmanager
def pdl_launches(on: bool):
    """Turn programmatic dependent launch on or off for the kernels launched (or captured)
    inside, to compare the two."""
    global ENABLED
    before, ENABLED = ENABLED, on
    try:
        yield
    finally:
        ENABLED = before


def launch_options(pdl: bool) -> dict:
    """The Triton launch keyword for a programmatic dependent (empty when off)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def wait_for_kernel_ahead(PDL: tl.constexpr):
    """First thing in a kernel launched with ``launch_options(True)``: wait for the kernel ahead
    to finish, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def _add_one_kernel(X, Y, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_kernel_ahead(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=ok) + 1.0, mask=ok)


if __name__ == "__main__":
    from labkit.measure.bench import measure

    device = labkit.select_device("auto")
    n, steps, block = 1 << 16, 64, 1024
    bufs = [torch.zeros(n, device=device) for _ in range(2)]

    def chain(pdl: bool):
        """``steps`` kernels, each reading what the one before wrote."""
        for i in range(steps):
            _add_one_kernel[(n // block,)](bufs[i % 2], bufs[(i + 1) % 2], n, BLOCK=block,
                                           PDL=pdl, **launch_options(pdl))
    pdl = pdl_for(torch.device(device))
    bufs[0].zero_()
    chain(pdl)
    assert torch.equal(bufs[steps % 2], torch.full_like(bufs[0], float(steps))), \
        "a dependent kernel read its input before the kernel ahead had written it"
    print(f"{steps} chained kernels on {device}, programmatic dependent launch "
          f"{'on' if pdl else 'off (needs compiled Triton on sm_90+)'}: every one read the "
          f"value the one ahead wrote")
    if pdl:
        from labkit.graphs import capture_graph
        for on in (False, True):
            graph, _ = capture_graph(lambda on=on: chain(on))
            t = measure(graph.replay, device=device, repeats=20)
            print(f"replayed chain, PDL {'on ' if on else 'off'}: {t.median_us / steps:.2f} us "
                  f"a kernel")
