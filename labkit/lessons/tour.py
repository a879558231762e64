"""Notebook 00: this machine's fingerprint and the map of the sequence."""
from __future__ import annotations

import pandas as pd
import torch

from labkit.device import fingerprint
from labkit.tools import NOTEBOOK_DIR

# (stem, what the learner sees, what needs a GPU, what the CPU shows instead)
SEQUENCE = [
    ("00_tour", "this machine, the map, a first live measurement", "-", "everything runs live"),
    ("01_launch_overhead", "CPU launch gaps on the timeline; CUDA Graph replay removes them",
     "graph replay, GPU timeline", "Python dispatch vs torch.compile, recorded GPU sweep"),
    ("02_cuda_graphs", "capture/replay, static buffers, copy_ vs rebinding, bucket pool",
     "graph replay, capture errors", "the same pitfalls live via a stand-in, recorded GPU figures"),
    ("03_torch_compile", "Dynamo -> FX -> Inductor, graph breaks, guards, recompiles, modes",
     "reduce-overhead mode", "Inductor's C++ path, live"),
    ("04_pinned_memory_streams", "pageable vs pinned H2D, streams, events, overlap",
     "streams, pinned DMA", "recorded figures, synchronous API"),
    ("05_paged_kv_cache", "block tables, fragmentation, prefix caching, eviction, copy-on-write",
     "-", "everything runs live"),
    ("06_attention_backends", "IO tiling, paged decode in Triton, backend selection, roofline",
     "kernel speed", "Triton interpreter for correctness, recorded speeds"),
    ("07_prefill_vs_decode", "compute- vs memory-bound, TTFT/TPOT, chunked prefill",
     "roofline points", "tiny model live, recorded GPU points"),
    ("08_putting_it_together", "continuous batching engine; backend x eager/graph experiment",
     "graphs, speed", "tiny model live, recorded GPU table"),
    ("09_multi_gpu_overlap", "tensor-parallel layer: all-reduce overlapped with compute",
     "two GPUs, NCCL", "2-process gloo on CPU, recorded 2-GPU timeline"),
]


def fingerprint_table() -> pd.DataFrame:
    fp = fingerprint()
    return pd.DataFrame({"value": [str(v) for v in fp.values()]}, index=list(fp))


def sequence_table(device: torch.device) -> pd.DataFrame:
    """The notebooks, whether they are here yet, and what runs live on this device."""
    on_gpu = device.type == "cuda"
    rows = []
    for stem, sees, gpu_part, cpu_part in SEQUENCE:
        rows.append({
            "notebook": stem,
            "what you see": sees,
            "here": "yes" if (NOTEBOOK_DIR / f"{stem}.ipynb").exists() else "not yet written",
            "on this machine": "all live on the GPU" if on_gpu else cpu_part,
            "needs a GPU for": gpu_part,
        })
    return pd.DataFrame(rows)
