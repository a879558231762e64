"""How well a step hid its communication, against the bounds the model sets those metrics."""
from __future__ import annotations

from labkit.measure.rounds import Spread

# No step can beat max(compute, comm), nor a k-chunk pipeline max + min / k; so efficiency,
# of_pipeline and hidden_fraction are at most 1 whatever the hardware. (hidden_fraction below 0
# is possible: overlapped, the two slowed each other more than overlap hid.)
BOUNDS = {"efficiency": 1.0, "of_pipeline": 1.0, "hidden_fraction": 1.0}
# With one chunk, or compute far above comm, a bound is met with equality: timings of the same
# work then land on both sides of it. Past it by more than this, in every round, is not noise.
BOUND_TOLERANCE = 0.03


def overlap_metrics(serial_us: float, overlapped_us: float, compute_us: float,
                    comm_us: float, num_chunks: int = 1) -> dict:
    """How well the overlapped step hides communication.

    ``efficiency = max(compute, comm) / overlapped``: 1.0 when the step takes only as long as
    the longer of the two (the shorter one entirely hidden); ``speedup = serial / overlapped``;
    ``ceiling = serial / max(compute, comm)``, the most any overlap could gain;
    ``hidden_fraction``: how much of the shorter one disappeared from the step.

    A pipeline of ``num_chunks`` equal chunks cannot reach ``max(compute, comm)``: the first
    chunk's compute runs before any all-reduce can start, the last chunk's all-reduce after all
    compute. ``pipeline_us = max + min / num_chunks`` is that bound (one chunk: the serial sum),
    and ``of_pipeline = pipeline_us / overlapped`` how close the step came to it. The bounds
    hold only when compute and comm are what they cost inside a step (:class:`SequentialStep`).
    """
    times = {"serial_us": serial_us, "overlapped_us": overlapped_us, "compute_us": compute_us,
                 "comm_us": comm_us}
    bad = {k: v for k, v in times.items() if not v > 0}
    if bad:
        raise ValueError(f"times must be positive microseconds, got {bad}")
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be an integer >= 1, got {num_chunks!r}")
    ideal, shorter = max(compute_us, comm_us), min(compute_us, comm_us)
    pipeline = ideal + shorter / num_chunks
    return {**times, "ideal_us": ideal, "pipeline_us": pipeline,
            "efficiency": ideal / overlapped_us, "of_pipeline": pipeline / overlapped_us,
            "speedup": serial_us / overlapped_us, "ceiling": serial_us / ideal,
            "hidden_fraction": (compute_us + comm_us - overlapped_us) / shorter}


def out_of_model(spreads: dict[str, Spread]) -> list[str]:
    """The bounded metrics (:data:`BOUNDS`) that passed their bound by more than
    :data:`BOUND_TOLERANCE` in every round: a bug in the metric or in the model, never a result.
    A range that only straddles the bound is noise. hidden_fraction <= 1 is the inequality of
    efficiency <= 1 (overlapped >= max(compute, comm)) divided by the shorter side, which
    magnifies a step's noise: it is judged on the step's scale, with efficiency."""
    past = [name for name in ("efficiency", "of_pipeline")
            if name in spreads and spreads[name].above(BOUNDS[name] * (1 + BOUND_TOLERANCE))]
    return past + (["hidden_fraction"] if "efficiency" in past and "hidden_fraction" in spreads
                   else [])


def gain_verdict(gain: Spread) -> str:
    """What a speed-up's range allows one to say: a gain only when every round gained."""
    if gain.above(1.0):
        return "a gain, every round faster than the serial step"
    if gain.below(1.0):
        return "slower than the serial step in every round"
    return "within noise: the range includes no change"
