"""Notebook 09: a tensor-parallel MLP's all-reduce, serial against overlapped with the next
chunk's compute, timed on every rank in interleaved rounds and read off both ranks' timelines.

:class:`TPExperiment` is one layer size timed for several chunk counts; :func:`run_experiment`
runs it on every rank (:func:`labkit.distributed.run_ranks`); :class:`TPResult` gathers what the
ranks measured: per round the slowest rank's times, each rank's errors, and every rank's trace
on one timeline (``experiment``). :func:`overlap_metrics` says how well a step hid its
communication and :func:`out_of_model` which of those metrics passed the bound the model sets
them (``metrics``). ``claims`` says what the notebook concludes from them.

The bound's two terms, compute and communication, are timed inside a step that runs both, one
after the other (:class:`SequentialStep`: the chunked matmuls, then their all-reduces, a clock
mark between the two), in the same rounds as the steps they bound. Timed alone, each back to
back for many repetitions, a part can cost more than it does inside a step (a serial step
shorter than compute alone + comm alone), and bounded metrics built on such parts pass 1.
"""
from labkit.lessons.multi_gpu_overlap.claims import (  # noqa: F401
    LATENCY_FACTOR,
    SIDE_BY_SIDE,
    correctness_claim,
    decode_claims,
    gpu_trace_claims,
    rounds_claims,
    schedule_claims,
    split_claim,
    where_of,
    width_claims,
)
from labkit.lessons.multi_gpu_overlap.experiment import (  # noqa: F401
    DECODE_SHAPES,
    DECODE_TOKENS,
    GPU_FFN_SIZES,
    GPU_SHAPES,
    METRICS,
    RECORDED_FIELDS,
    SequentialStep,
    TPExperiment,
    TPResult,
    comm_overlap,
    experiment_rank,
    merge_rank_traces,
    missing_fields,
    record,
    run_experiment,
    sweep_summary,
)
from labkit.lessons.multi_gpu_overlap.metrics import (  # noqa: F401
    BOUND_TOLERANCE,
    BOUNDS,
    gain_verdict,
    out_of_model,
    overlap_metrics,
)
