"""Tensor parallelism: a Megatron-style MLP over ranks, its all-reduce overlapped with compute.

The MLP is ``y = gelu(x @ W1) @ W2`` with ``x: [tokens, hidden]``, ``W1: [hidden, ffn]``,
``W2: [ffn, hidden]``. Rank r keeps the columns ``s_r`` of W1 (column-parallel: split by output
features) and the same rows of W2 (row-parallel: split by input features). gelu acts element by
element, so ``gelu(x @ W1[:, s_r])`` needs nothing from the other ranks; but
``gelu(x @ W1[:, s_r]) @ W2[s_r, :]`` is only a partial sum ``[tokens, hidden]``: the output is
the sum over ranks, one all-reduce, and nothing after the layer can start before it is done.

``forward_serial`` computes, then all-reduces. ``forward_overlapped`` splits the tokens into
chunks, launches each chunk's all-reduce asynchronously as soon as its partial exists and goes
on with the next chunk's compute, waiting on the work handles only at the end: the
communication of chunk i hides behind the compute of chunk i+1. Processes: labkit.tp_runner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

if TYPE_CHECKING:
    from labkit.tp_runner import TPResult

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TPConfig:
    hidden: int
    ffn: int
    world_size: int = 2
    seed: int = 0

    def __post_init__(self):
        for name in ("hidden", "ffn", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        ws, rest = self.world_size, self.ffn % self.world_size
        if rest:
            near = [n for n in (self.ffn - rest, self.ffn - rest + ws) if n > 0]
            raise ValueError(
                f"ffn={self.ffn} cannot be split evenly over world_size={ws} ranks: each rank "
                f"keeps ffn/world_size columns of W1 and rows of W2. Use ffn="
                f"{' or '.join(map(str, near))}, or a world_size that divides {self.ffn}.")

    @property
    def ffn_per_rank(self) -> int:
        return self.ffn // self.world_size

    def shard(self, rank: int) -> slice:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in 0..{self.world_size - 1}, got {rank}")
        return slice(rank * self.ffn_per_rank, (rank + 1) * self.ffn_per_rank)

def full_weights(cfg: TPConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``W1: [hidden, ffn]``, ``W2: [ffn, hidden]`` in float32 on the CPU, the same on every rank
    (one seeded generator), scaled by 1/sqrt(fan_in) so activations stay of order one."""
    gen = torch.Generator().manual_seed(cfg.seed)
    w1 = torch.randn(cfg.hidden, cfg.ffn, generator=gen) / math.sqrt(cfg.hidden)
    w2 = torch.randn(cfg.ffn, cfg.hidden, generator=gen) / math.sqrt(cfg.ffn)
    return w1, w2


def make_input(tokens: int, hidden: int, seed: int = 1, dtype=torch.float32,
               device="cpu") -> torch.Tensor:
    """``x: [tokens, hidden]``, identical on every rank (activations are replicated in TP)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)


def mlp_reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The whole layer on one device with the full weights: what every rank must end up with."""
    return F.gelu(x @ w1) @ w2


def token_chunks(tokens: int, num_chunks: int) -> list[slice]:
    """Row ranges of ``num_chunks`` near-equal chunks (the first ``tokens % num_chunks`` one
    longer). Row slices of a contiguous tensor are contiguous: collectives can use them in place."""
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be an integer >= 1 (1 is the serial schedule), "
                         f"got {num_chunks!r}")
    if tokens and num_chunks > tokens:
        raise ValueError(f"cannot split {tokens} tokens into {num_chunks} chunks (each needs a "
                         f"token); use num_chunks <= {tokens}")
    base, extra = divmod(tokens, num_chunks)
    bounds = [0]
    for i in range(num_chunks):
        bounds.append(bounds[-1] + base + (i < extra))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


class _Done:
    """The work handle of a collective over one rank: nothing to wait for."""

    def wait(self):
        return True


class TensorParallelMLP:
    """One rank's shard: ``w1: [hidden, ffn/ws]`` (column-parallel), ``w2: [ffn/ws, hidden]``
    (row-parallel). With world_size 1 it is the whole layer and needs no process group."""

    def __init__(self, cfg: TPConfig, rank: int, *, device="cpu", dtype=torch.float32,
                 group=None, weights: tuple[torch.Tensor, torch.Tensor] | None = None):
        shard = cfg.shard(rank)
        if cfg.world_size > 1 and dist.is_initialized():
            joined = dist.get_world_size(group)
            if joined != cfg.world_size:
                raise ValueError(f"the config says world_size={cfg.world_size} but the process "
                                 f"group has {joined} ranks: set world_size={joined}")
        w1, w2 = weights if weights is not None else full_weights(cfg)
        self.cfg, self.rank, self.group = cfg, rank, group
        self.w1 = w1[:, shard].to(device=device, dtype=dtype).contiguous()
        self.w2 = w2[shard, :].to(device=device, dtype=dtype).contiguous()

    def _check(self, x: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.cfg.hidden:
            raise ValueError(f"x must be [tokens, hidden={self.cfg.hidden}], got {tuple(x.shape)}")
        if x.dtype != self.w1.dtype or x.device != self.w1.device:
            raise ValueError(f"x is {x.dtype} on {x.device} but the weights are {self.w1.dtype} "
                             f"on {self.w1.device}: move x with .to(device, dtype)")

    def _all_reduce(self, t: torch.Tensor, async_op: bool):
        if self.cfg.world_size == 1:
            return _Done()
        if not dist.is_initialized():
            raise RuntimeError(f"world_size={self.cfg.world_size} needs a process group: run "
                               "inside labkit.tp_runner.run_ranks (or torchrun)")
        return dist.all_reduce(t, group=self.group, async_op=async_op)

    def partial(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's share of the output, ``[tokens, hidden]``: summed over ranks it is y."""
        return torch.matmul(F.gelu(x @ self.w1), self.w2, out=out)

    def forward_serial(self, x: torch.Tensor) -> torch.Tensor:
        """``x: [tokens, hidden]`` -> ``y: [tokens, hidden]`` (every rank): compute, all-reduce."""
        self._check(x)
        y = self.partial(x)
        self._all_reduce(y, async_op=False)
        return y

    def forward_overlapped(self, x: torch.Tensor, num_chunks: int, *,
                           communicate: bool = True) -> torch.Tensor:
        """Same in and out as :meth:`forward_serial`, the tokens in ``num_chunks`` chunks.
        ``communicate=False``: the chunked compute without its all-reduces (for timing)."""
        self._check(x)
        y = x.new_empty(x.shape[0], self.cfg.hidden)
        works = []
        for rows in token_chunks(x.shape[0], num_chunks):
            self.partial(x[rows], out=y[rows])
            if communicate:
                # Launched, not awaited: the next chunk's matmuls run while this one is reduced.
                works.append(self._all_reduce(y[rows], async_op=True))
        for work in works:  # the caller reads y next: every chunk must be summed by then
            work.wait()
        return y

    def communicate_only(self, buf: torch.Tensor, num_chunks: int) -> torch.Tensor:
        """The overlapped schedule's all-reduces, same sizes, without compute (for timing).
        Pass zeros: a sum of zeros stays zero however often it is repeated."""
        works = [self._all_reduce(buf[rows], async_op=True)
                 for rows in token_chunks(buf.shape[0], num_chunks)]
        for work in works:
            work.wait()
        return buf


def overlap_metrics(serial_us: float, overlapped_us: float, compute_us: float,
                    comm_us: float, num_chunks: int = 1) -> dict:
    """How well the overlapped step hides communication.

    ``efficiency = max(compute, comm) / overlapped``: 1.0 when the step takes only as long as
    the longer of the two (the shorter one entirely hidden); ``speedup = serial / overlapped``;
    ``hidden_fraction``: how much of the shorter one disappeared from the step.

    A pipeline of ``num_chunks`` equal chunks cannot reach ``max(compute, comm)``: the first
    chunk's compute runs before any all-reduce can start, the last chunk's all-reduce after all
    compute. ``pipeline_us = max + min / num_chunks`` is that bound (one chunk: the serial sum),
    and ``of_pipeline = pipeline_us / overlapped`` how close the step came to it.
    """
    times = dict(serial_us=serial_us, overlapped_us=overlapped_us, compute_us=compute_us,
                 comm_us=comm_us)
    bad = {k: v for k, v in times.items() if not v > 0}
    if bad:
        raise ValueError(f"times must be positive microseconds, got {bad}")
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be an integer >= 1, got {num_chunks!r}")
    ideal, shorter = max(compute_us, comm_us), min(compute_us, comm_us)
    pipeline = ideal + shorter / num_chunks
    return {**times, "ideal_us": ideal, "pipeline_us": pipeline,
            "efficiency": ideal / overlapped_us, "of_pipeline": pipeline / overlapped_us,
            "speedup": serial_us / overlapped_us,
            "hidden_fraction": (compute_us + comm_us - overlapped_us) / shorter}


@dataclass(frozen=True)
class TPExperiment:
    """One layer size, timed serial and overlapped for each chunk count, and traced once."""
    tokens: int
    hidden: int
    ffn: int
    dtype: str = "float32"
    chunk_counts: tuple[int, ...] = (1, 2, 4, 8)
    trace_chunks: int = 4
    warmup: int = 2
    repeats: int = 10
    seed: int = 0

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.tokens, int) or self.tokens < 1 or not self.chunk_counts:
            raise ValueError(f"need tokens >= 1 and at least one chunk count, got tokens="
                             f"{self.tokens!r}, chunk_counts={self.chunk_counts!r}")
        for k in (*self.chunk_counts, self.trace_chunks):
            token_chunks(self.tokens, k)
        if self.repeats < 1 or self.warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={self.repeats}, "
                             f"warmup={self.warmup}")

    def layer_config(self, world_size: int) -> TPConfig:
        return TPConfig(self.hidden, self.ffn, world_size, self.seed)


def _relative_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def experiment_rank(ctx, exp: TPExperiment) -> dict:
    """On one rank (inside ``run_ranks``): outputs against the single-device reference, each
    schedule timed (median after warm-up), then one serial and one overlapped step traced."""
    from labkit import bench
    from labkit.profile import trace

    cfg, dtype = exp.layer_config(ctx.world_size), DTYPES[exp.dtype]
    w1, w2 = full_weights(cfg)
    layer = TensorParallelMLP(cfg, ctx.rank, device=ctx.device, dtype=dtype, weights=(w1, w2))
    x = make_input(exp.tokens, exp.hidden, exp.seed + 1, dtype, ctx.device)
    # The reference sees the same rounded weights: what is left is the layer's own rounding.
    ref = mlp_reference(x.float(), *(w.to(ctx.device, dtype).float() for w in (w1, w2)))
    errors = {"serial": _relative_error(layer.forward_serial(x), ref)}
    for k in exp.chunk_counts:
        errors[f"overlapped, {k} chunks"] = _relative_error(layer.forward_overlapped(x, k), ref)
    del w1, w2, ref
    zeros = torch.zeros_like(x)

    def timed(fn) -> float:
        dist.barrier()  # both ranks start each measurement together
        return bench.measure(fn, device=ctx.device, warmup=exp.warmup,
                             repeats=exp.repeats).median_us

    serial_us = timed(lambda: layer.forward_serial(x))
    rows = [{"num_chunks": k, "serial_us": serial_us,
             "overlapped_us": timed(lambda: layer.forward_overlapped(x, k)),
             "compute_us": timed(lambda: layer.forward_overlapped(x, k, communicate=False)),
             "comm_us": timed(lambda: layer.communicate_only(zeros, k))}
            for k in exp.chunk_counts]
    traces = {}
    for mode, fn in (("serial", lambda: layer.forward_serial(x)),
                     ("overlapped", lambda: layer.forward_overlapped(x, exp.trace_chunks))):
        dist.barrier()
        traces[mode] = trace(fn, device=ctx.device, warmup=1).to_dict()
    return {"rank": ctx.rank, "device": str(ctx.device), "rows": rows, "errors": errors,
            "traces": traces}


def run_experiment(exp: TPExperiment, world_size: int = 2, backend: str = "auto",
                   timeout_s: float = 600.0) -> "TPResult":
    """Spawn ``world_size`` ranks (or join torchrun's) and run :func:`experiment_rank` on each."""
    from labkit.tp_runner import TPResult, pick_backend, run_ranks

    exp.layer_config(world_size)  # a bad size fails here, not in every child
    backend = pick_backend(backend, world_size)
    ranks = run_ranks(experiment_rank, exp, world_size=world_size, backend=backend,
                      timeout_s=timeout_s)
    return TPResult(exp, backend, ranks)


# Compute grows with ffn, the all-reduce ([tokens, hidden]) does not: one of these sizes puts the
# two close together on 2 GPUs over NVLink, 28672 is a Llama-70B-sized MLP.
GPU_SHAPES = dict(tokens=8192, hidden=8192, dtype="bfloat16", chunk_counts=(1, 2, 4, 8, 16),
                  trace_chunks=4, warmup=5, repeats=30)
GPU_FFN_SIZES = (2048, 8192, 28672)


def record() -> dict:
    """`make record` on a host with 2 GPUs: the sweep and the traces for each ffn size."""
    from labkit.recorded import NeedsMoreGPUs

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        raise NeedsMoreGPUs(f"tp_overlap needs 2 GPUs (one rank per GPU, NCCL); this machine "
                            f"has {gpus}. Run `python -m labkit.record tp_overlap` on a 2-GPU host.")
    runs = [run_experiment(TPExperiment(ffn=ffn, **GPU_SHAPES), world_size=2, backend="nccl")
            for ffn in GPU_FFN_SIZES]
    return {"runs": [r.to_dict() for r in runs],
            "gpus": [torch.cuda.get_device_name(i) for i in range(2)]}
