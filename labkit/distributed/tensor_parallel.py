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
communication of chunk i hides behind the compute of chunk i+1. Processes: labkit.distributed.rank_runner.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labkit import check_positive_int

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TPConfig:
    hidden: int
    ffn: int
    world_size: int = 2
    seed: int = 0

    def __post_init__(self):
        for name in ("hidden", "ffn", "world_size"):
            check_positive_int(name, getattr(self, name))
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
                               "inside labkit.distributed.rank_runner.run_ranks (or torchrun)")
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
