"""What notebook 09 measures: one tensor-parallel MLP size (:class:`TPExperiment`), timed
serial, overlapped and sequential for several chunk counts in shuffled rounds and traced once,
and the sizes `make record` runs on two GPUs (prefill-sized widths, decode-sized token counts).
"""
from __future__ import annotations

from dataclasses import dataclass

from labkit import check_positive_int
from labkit.distributed.tensor_parallel import DTYPES, TPConfig, token_chunks


@dataclass(frozen=True)
class TPExperiment:
    """One layer size, timed serial, overlapped and sequential for each chunk count in
    ``rounds`` shuffled rounds, and traced once."""
    tokens: int
    hidden: int
    ffn: int
    dtype: str = "float32"
    chunk_counts: tuple[int, ...] = (1, 2, 4, 8)
    trace_chunks: int = 4
    warmup: int = 2
    repeats: int = 10
    seed: int = 0
    rounds: int = 3

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        check_positive_int("tokens", self.tokens)
        if not self.chunk_counts:
            raise ValueError("chunk_counts needs at least one chunk count (1 is the serial "
                             "schedule)")
        for k in (*self.chunk_counts, self.trace_chunks):
            token_chunks(self.tokens, k)
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={self.repeats}, "
                             f"warmup={self.warmup}")
        if not isinstance(self.rounds, int) or self.rounds < 3:
            raise ValueError(f"rounds must be an integer >= 3 (a range over fewer says little), "
                             f"got {self.rounds!r}")

    def layer_config(self, world_size: int) -> TPConfig:
        return TPConfig(self.hidden, self.ffn, world_size, self.seed)


# Compute grows with ffn, the all-reduce ([tokens, hidden]) does not: one of these sizes puts the
# two close together on 2 GPUs over NVLink, 28672 is a Llama-70B-sized MLP. 8192 tokens is a
# prefill; decode steps carry one token per sequence, so 8 and 64 tokens are decode batches.
GPU_SHAPES = {"tokens": 8192, "hidden": 8192, "dtype": "bfloat16",
              "chunk_counts": (1, 2, 4, 8, 16), "trace_chunks": 4, "warmup": 5, "repeats": 20,
              "rounds": 5}
GPU_FFN_SIZES = (2048, 8192, 28672)
DECODE_SHAPES = {"hidden": 8192, "ffn": 28672, "dtype": "bfloat16", "chunk_counts": (1, 2, 4, 8),
                 "trace_chunks": 4, "warmup": 10, "repeats": 50, "rounds": 5}
DECODE_TOKENS = (8, 64)
