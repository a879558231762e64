"""`make record` for notebook 09 on a host with two GPUs, and which fields a recording needs for
each group of the notebook's claims."""
from __future__ import annotations

import torch

from labkit.lessons.multi_gpu_overlap.experiment import (
    DECODE_SHAPES,
    DECODE_TOKENS,
    GPU_FFN_SIZES,
    GPU_SHAPES,
    TPExperiment,
)
from labkit.lessons.multi_gpu_overlap.ranks import run_experiment


def record() -> dict:
    """`make record` on a host with 2 GPUs: for each prefill-sized ffn and each decode-sized
    token count, the rounds and the traces."""
    from labkit.tools.recorded import NeedsMoreGPUs

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        raise NeedsMoreGPUs(f"multi_gpu_overlap needs 2 GPUs (one rank per GPU, NCCL); this machine "
                            f"has {gpus}. Run `python -m labkit.tools.record multi_gpu_overlap` on a 2-GPU host.")
    runs = [run_experiment(TPExperiment(ffn=ffn, **GPU_SHAPES), world_size=2, backend="nccl")
            for ffn in GPU_FFN_SIZES]
    decode = [run_experiment(TPExperiment(tokens=t, **DECODE_SHAPES), world_size=2,
                             backend="nccl") for t in DECODE_TOKENS]
    return {"runs": [r.to_dict() for r in runs], "decode_runs": [r.to_dict() for r in decode],
            "gpus": [torch.cuda.get_device_name(i) for i in range(2)]}


# Fields a recording needs for each group of claims, and what each gives the notebook.
RECORDED_FIELDS = {"rounds": "interleaved rounds (gains with their ranges, metrics against "
                             "their bounds)",
                   "decode_runs": "decode-sized token counts (where overlap cannot help)"}


def missing_fields(data: dict) -> list[str]:
    """The :data:`RECORDED_FIELDS` that a recording's data lacks."""
    missing = []
    if not all("rounds" in rank for run in data.get("runs", []) for rank in run["ranks"]):
        missing.append("rounds")
    if not data.get("decode_runs"):
        missing.append("decode_runs")
    return missing
