"""Notebook 09: a tensor-parallel MLP's all-reduce, serial against overlapped with the next
chunk's compute, timed on every rank in interleaved rounds and read off both ranks' timelines.

One concept a module:

* ``experiment``: :class:`TPExperiment`, one layer size timed for several chunk counts, and the
  sizes `make record` runs on two GPUs;
* ``ranks``: what every rank runs (:func:`experiment_rank`, spawned by :func:`run_experiment`
  through :func:`labkit.distributed.run_ranks`), and :class:`SequentialStep`, which times the
  bounds' two terms inside a step;
* ``traces``: both ranks' traces on one timeline, and what one rank's trace says about overlap
  (:func:`comm_overlap`);
* ``result``: :class:`TPResult`, what the ranks measured, per round and over the rounds;
* ``metrics``: how well a step hid its communication (:func:`overlap_metrics`) and which
  metrics passed the bound the model sets them (:func:`out_of_model`);
* ``recording``: :func:`record` for `make record`, and the fields a recording needs;
* ``claims``: what the notebook concludes.

The bounds' two terms, compute and communication, are timed inside a step that runs both, one
after the other (the chunked matmuls, then their all-reduces, a clock mark between the two), in
the same rounds as the steps they bound. Timed alone, each back to back for many repetitions, a
part can cost more than it does inside a step (a serial step shorter than compute alone + comm
alone), and bounded metrics built on such parts pass 1.
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
    TPExperiment,
)
from labkit.lessons.multi_gpu_overlap.metrics import (  # noqa: F401
    BOUND_TOLERANCE,
    BOUNDS,
    gain_verdict,
    out_of_model,
    overlap_metrics,
)
from labkit.lessons.multi_gpu_overlap.ranks import (  # noqa: F401
    SequentialStep,
    experiment_rank,
    run_experiment,
)
from labkit.lessons.multi_gpu_overlap.recording import (  # noqa: F401
    RECORDED_FIELDS,
    missing_fields,
    record,
)
from labkit.lessons.multi_gpu_overlap.result import METRICS, TPResult, sweep_summary  # noqa: F401
from labkit.lessons.multi_gpu_overlap.traces import (  # noqa: F401
    comm_overlap,
    merge_rank_traces,
)
