"""Overlap copies with compute: pinned staging, a copy stream, events, prefetch, safe readback.

    from labkit.overlap import PinnedStagingPool, Prefetcher, copy_to_host

* :class:`~labkit.overlap.staging.PinnedStagingPool`: pinned host buffers reused in turn for
  host-to-device copies, each handed out again only after its last copy's event completed.
* :class:`~labkit.overlap.prefetch.Prefetcher`: copy batch i+1 on a copy stream while the compute
  stream works on batch i.
* :func:`copy_to_host` (device to host): a non-blocking copy into pinned memory that returns
  only once the copy's event has completed, so the values read are never stale.
  :func:`start_copy_to_host` returns at once with the handle, for reading one step later.

With no CUDA device every one of them works synchronously, pins nothing and says so once.
"""
from labkit.overlap.prefetch import PrefetchStats, Prefetcher
from labkit.overlap.readback import copy_to_host, start_copy_to_host
from labkit.overlap.staging import (InFlightCopy, PinnedStagingPool, StagingStats,
                                    SynchronousFallbackWarning, announce_synchronous)

__all__ = ["PinnedStagingPool", "Prefetcher", "copy_to_host", "start_copy_to_host",
           "InFlightCopy", "StagingStats", "PrefetchStats", "SynchronousFallbackWarning",
           "announce_synchronous"]
