"""Run one function on every rank of a small process group: spawned here, or under torchrun.

    results = run_ranks(fn, *args, world_size=2)     # fn(ctx: RankContext, *args) -> picklable

Collectives need one process per rank. Started plainly (a script, a notebook, a test), this
spawns ``world_size`` processes with ``torch.multiprocessing`` (spawn: a fresh interpreter, so it
works from Jupyter as long as ``fn`` is a module-level function), rendezvous on 127.0.0.1 at a
free port, and returns each rank's result in rank order. Started by ``torchrun``, this process
is already one rank: it joins the group torchrun describes, runs ``fn`` and gathers every rank's
result. Backend ``nccl`` with one GPU per rank (NVLink multicast off), ``gloo`` on the CPU.
"""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from labkit import check_positive_int


BACKENDS = ("auto", "nccl", "gloo")


@dataclass(frozen=True)
class RankContext:
    rank: int
    world_size: int
    backend: str
    device: torch.device


def launched_by_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"))


def pick_backend(backend: str = "auto", world_size: int = 2) -> str:
    """``auto``: NCCL when there is a GPU for every rank, else gloo on the CPU."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise RuntimeError(f"backend='nccl' needs one GPU per rank: {world_size} ranks asked for, "
                           f"{gpus} GPU(s) visible. Use backend='gloo' (CPU) or run on a host "
                           f"with {world_size} GPUs.")
    return backend


def _join_group(backend: str, rank: int, local_rank: int, world_size: int,
                timeout_s: float) -> RankContext:
    kwargs = {}
    if backend == "nccl":
        # NVLink multicast stays off (on shared hosts it can take the GPUs out of service):
        # the lab measures NCCL's ordinary ring/tree all-reduce.
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    else:
        device = torch.device("cpu")
        # Ranks share the machine's cores: without this each would start one thread per core.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return RankContext(rank, world_size, backend, device)


def _spawned_rank(rank: int, world_size: int, port: int, backend: str, fn: Callable,
                  args: tuple, results, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    try:
        ctx = _join_group(backend, rank, rank, world_size, timeout_s)
        message = (rank, True, fn(ctx, *args))
        dist.destroy_process_group()
    except BaseException:
        message = (rank, False, traceback.format_exc())
    try:  # plain pickle: tensors travel by value, not as shared memory this process would own
        results.put(pickle.dumps(message))
    except Exception:
        results.put(pickle.dumps((rank, False, traceback.format_exc())))
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is delivered; skip interpreter teardown, where process-group and profiler
    # threads can abort at random (and which costs seconds per rank).
    os._exit(0 if message[1] else 1)


def _spawn(fn: Callable, args: tuple, world_size: int, backend: str, timeout_s: float) -> list:
    ctx = torch.multiprocessing.get_context("spawn")
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        results, port = ctx.Queue(), s.getsockname()[1]
    procs = [ctx.Process(target=_spawned_rank, name=f"labkit-rank{r}",
                         args=(r, world_size, port, backend, fn, args, results, timeout_s))
             for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world_size:
            lost = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in got]
            try:  # a rank that has exited flushed its message first: give it a last look
                rank, ok, payload = pickle.loads(results.get(timeout=2.0 if lost else 0.5))
            except queue.Empty:
                if lost:
                    raise RuntimeError(
                        f"rank {lost[0]} of {world_size} exited with code {procs[lost[0]].exitcode}"
                        " before returning a result (-9 is usually the out-of-memory killer)"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(got))
                    raise TimeoutError(f"no result from ranks {missing} in {timeout_s:.0f} s: "
                                       "pass a larger timeout_s or use smaller sizes") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world_size} failed:\n{payload}")
            got[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=10 if len(got) == world_size else 0)
            if p.is_alive():  # a rank stuck in a collective its failed peer never joined
                p.terminate()
                p.join(timeout=10)
    return [got[r] for r in range(world_size)]


def _run_here(fn: Callable, args: tuple, world_size: int, backend: str, timeout_s: float) -> list:
    launched = int(os.environ["WORLD_SIZE"])
    if launched != world_size:
        raise RuntimeError(f"torchrun started {launched} ranks but {world_size} were asked for: "
                           f"start it with --nproc-per-node {world_size}")
    ctx = _join_group(backend, int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]),
                      world_size, timeout_s)
    try:
        result = fn(ctx, *args)
        gathered: list = [None] * world_size
        dist.all_gather_object(gathered, result)
    finally:
        dist.destroy_process_group()
    return gathered


def run_ranks(fn: Callable, *args, world_size: int = 2, backend: str = "auto",
              timeout_s: float = 600.0) -> list:
    """``fn(ctx, *args)`` on every rank; every rank's result, in rank order.

    ``fn`` must be a module-level function (spawned processes import it by name) and its
    result picklable (tensors come back by value). A rank that raises fails the whole call
    with that rank's traceback.
    """
    check_positive_int("world_size", world_size, hint="ranks to run")
    if launched_by_torchrun():
        return _run_here(fn, args, world_size,
                         pick_backend(backend, int(os.environ["WORLD_SIZE"])), timeout_s)
    return _spawn(fn, args, world_size, pick_backend(backend, world_size), timeout_s)
