"""Host <-> device transfers, measured: the experiments behind notebook 04.

* ``transfers``: pageable against pinned host-to-device copies over sizes in interleaved rounds
  (how long each takes, how long the CPU is held, what ``pin_memory()`` costs and when it pays),
  a device-to-host copy read before its event completed, and refilling a pinned buffer while
  its copy is still queued (checked with checksums and each copy's batch mix).
* ``steps``: copies beside compute through the Prefetcher (timeline and its accounting over
  rounds), and a serving-like loop whose CPU work overlaps the GPU's, with the host time of every
  phase of a step and each stream's GPU time: what the overlapped step is bound by.
* ``claims``: what the notebook states, computed from those results and checked.
* ``figures``: the notebook's plots.

The GPU-only experiments raise on a CPU with a pointer to the recorded figures.
"""
from labkit.lessons.pinned_memory_streams.claims import (
    BOUND_WITHIN,
    NO_OVERLAP_BELOW,
    OVERLAP_ABOVE,
    OVERLAP_GAIN_TARGET,
    d2h_claims,
    handshake_claim,
    pool_claim,
    prefetch_claims,
    readback_claim,
    reuse_claims,
    size_name,
    step_claims,
    sweep_claims,
    timeline_claims,
    torn_copies,
)
from labkit.lessons.pinned_memory_streams.figures import (
    bandwidth_figure,
    reuse_figure,
    step_figure,
)
from labkit.lessons.pinned_memory_streams.steps import (
    MODES,
    PHASES,
    compute,
    copy_compute_overlap,
    copy_compute_runner,
    gpu_stream_busy,
    host_batches,
    prefetch_rounds,
    step_times,
    weight,
)
from labkit.lessons.pinned_memory_streams.transfers import (
    SWEEP_CASES,
    arrived_batch,
    batch_mix,
    cuda_device,
    d2h_read_too_early,
    early_reuse,
    gpu_sleep,
    h2d_sweep,
    host_timer,
    make_batch,
    per_round,
    pin_payoff,
    pin_verdicts,
    spread_of,
    verdict,
)


def pin_table(sweep):
    """The per-size table of when pinning pays: with the rounds' ranges where the sweep has
    them, from medians (and saying so) where it does not."""
    if "pageable_rounds" in sweep:
        return pin_verdicts(sweep)
    print("(this sweep has no rounds: the table is from single medians, without ranges)")
    return pin_payoff(sweep)


def record() -> dict:
    """`make record`: the bandwidth sweep in rounds, both hazards, the two timelines, the
    Prefetcher's accounting over rounds and the step times with their phases."""
    from labkit.measure.profile import trace
    from labkit.tools.recorded import json_columns

    dev = cuda_device("cuda")
    out = {"h2d_sweep": json_columns(h2d_sweep([2**k for k in range(12, 29, 2)], dev)),
           "d2h_too_early": d2h_read_too_early(device=dev),
           "reuse_unsafe": early_reuse(False, device=dev),
           "reuse_safe": early_reuse(True, device=dev),
           "steps": json_columns(step_times(device=dev)),
           "prefetch_rounds": json_columns(prefetch_rounds(device=dev))}
    for name, overlap in (("serial", False), ("overlap", True)):
        run = copy_compute_runner(overlap, device=dev)
        t = trace(run, device=dev, warmup=1)
        run()
        out[f"trace_{name}"] = t.to_dict()
        out[f"timeline_{name}"] = copy_compute_overlap(t.events)
        out[f"prefetch_{name}"] = run.last["prefetcher"].stats.as_dict()
    return out


__all__ = [
    "BOUND_WITHIN",
    "MODES",
    "NO_OVERLAP_BELOW",
    "OVERLAP_ABOVE",
    "OVERLAP_GAIN_TARGET",
    "PHASES",
    "SWEEP_CASES",
    "arrived_batch",
    "bandwidth_figure",
    "batch_mix",
    "compute",
    "copy_compute_overlap",
    "copy_compute_runner",
    "cuda_device",
    "d2h_claims",
    "handshake_claim",
    "d2h_read_too_early",
    "early_reuse",
    "gpu_sleep",
    "gpu_stream_busy",
    "h2d_sweep",
    "host_batches",
    "host_timer",
    "make_batch",
    "per_round",
    "pin_payoff",
    "pin_table",
    "pin_verdicts",
    "pool_claim",
    "prefetch_claims",
    "prefetch_rounds",
    "readback_claim",
    "record",
    "reuse_claims",
    "reuse_figure",
    "size_name",
    "spread_of",
    "step_claims",
    "step_figure",
    "step_times",
    "sweep_claims",
    "timeline_claims",
    "torn_copies",
    "verdict",
    "weight",
]
