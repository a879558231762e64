"""``compile=True``'s piecewise CUDA graphs: the compiled forward (``labkit.engine.compiled``)
run once per token bucket with a recorder in place, each compiled piece captured as one graph
into a shared pool (its layer's K/V store inside it, reading the slots from a static buffer) and
each attention call between them written down with the tensors it reads and writes; a step
loads its tokens and slots, then replays them in order with attention eager on its real rows
(the module docstring of ``compiled`` says why this is sound)."""
from __future__ import annotations

import time

import torch

from labkit.engine.model import AttentionFn
from labkit.engine.pieces import StaticTokens

RECORDING: list["_Recorder"] = []  # set while CompiledPiecewise captures a bucket


def _unowned(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a tensor that does not keep it allocated: a graph's output, which the
    graph rewrites at every replay, while the pool may hand the memory to a later capture."""
    storage = torch._C._construct_storage_from_data_pointer(
        t.untyped_storage().data_ptr(), t.device, t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        storage, t.storage_offset(), t.shape, t.stride())


class _Rerun:
    """Off a GPU, a "graph" of one compiled piece: replay runs it again on the inputs it was
    captured with and writes into the outputs it returned then (kept alive here), so the
    replay sequence, the static inputs and the recorded attention tensors are exercised as on a
    GPU; the kernels are not frozen (Inductor's CPU kernels are C++, which labkit's stand-in
    cannot record)."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args
        self.outputs = fn(*args)

    def replay(self) -> None:
        kept, fresh = self.outputs, self.fn(*self.args)
        if isinstance(kept, torch.Tensor):
            kept, fresh = (kept,), (fresh,)
        for old, new in zip(kept, fresh):
            if isinstance(old, torch.Tensor):
                old.copy_(new)


class _Recorder:
    """One bucket's capture: the graph of each compiled piece, in order, into ``pool``, and the
    attention calls between them with the tensors each reads and writes."""

    def __init__(self, pool, on_gpu: bool):
        self.pool, self.on_gpu = pool, on_gpu
        self.graphs: list = []
        self.calls: list[tuple] = []

    def capture(self, fn, args):
        if not self.on_gpu:
            graph = _Rerun(fn, args)
            self.graphs.append(graph)
            return graph.outputs
        fn(*args)  # warm-up: lazy initialisation and Triton's autotuning outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = fn(*args)
        self.graphs.append(graph)
        return outputs

    def attention(self, layer, q, k, v, out=None):
        keep = (lambda t: t) if not self.on_gpu else _unowned
        self.calls.append((layer, keep(q), keep(k), None if v is None else keep(v), keep(out)))


class CompiledPiecewise(StaticTokens):
    """Piecewise graphs of the compiled forward, one set per token bucket (see the module
    docstring): ``run(n, attention)`` replays the bucket that holds ``n`` tokens, the step's
    tokens and slots loaded first with ``load`` (padding rows: token 0, slot -1, so they store
    nothing), and returns the final hidden states of its ``n`` rows. ``attention`` must not
    store: the pieces did. ``stats`` is ``PiecewiseStats``, as the engine's own piecewise
    graphs keep it."""

    def __init__(self, forward, buckets, device: torch.device):
        from labkit.graphs.buckets import check_buckets
        from labkit.graphs.piecewise import PiecewiseStats

        self.forward, self.device = forward, device
        self.buckets = tuple(check_buckets("buckets", buckets, "token counts"))
        # One row more than the largest bucket: every bucket's inputs are then views shorter
        # than their buffer (Dynamo guards on a view's base; a view the size of its base at
        # one bucket and shorter at the next would recompile).
        super().__init__(self.buckets[-1] + 1, device, slot_dtype=torch.int32)
        self.stats = PiecewiseStats()
        self._captured: dict[int, tuple[list, list, torch.Tensor]] = {}
        self._mempool = None

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def static_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.positions,
                                                           self.slots))

    def _pool_bytes(self) -> int:
        from labkit.graphs.pool import segment_bytes
        return segment_bytes(self._mempool) if self.on_gpu else 0

    @torch.inference_mode()
    def capture(self):
        """Every bucket, largest first, into one pool; returns ``stats``. The forward runs
        once first at the largest bucket, outside any capture, so Dynamo and Inductor compile
        there (a bucket Dynamo specialises, 1, compiles in its own capture)."""
        from labkit.graphs.piecewise import PieceStats

        if self._captured:
            raise RuntimeError("these piecewise graphs are captured already")
        self._mempool = torch.cuda.graph_pool_handle() if self.on_gpu else None
        top = self.buckets[-1]  # compiled here, so the compile is not counted as capture
        self.slots.fill_(-1)  # every capture's rows are padding: nothing is stored
        self.forward(self.ids[:top], self.positions[:top], self.slots[:top],
                     lambda *args, out=None: None)
        for bucket in sorted(self.buckets, reverse=True):
            self.ids[:bucket].zero_()
            self.positions[:bucket].zero_()
            if self.on_gpu:
                torch.cuda.synchronize()
            pool0, t0 = self._pool_bytes(), time.perf_counter()
            recorder = _Recorder(self._mempool, self.on_gpu)
            RECORDING.append(recorder)
            try:
                hidden = self.forward(self.ids[:bucket], self.positions[:bucket],
                                      self.slots[:bucket], recorder.attention)
            finally:
                RECORDING.pop()
            if len(recorder.graphs) != len(recorder.calls) + 1:
                raise RuntimeError(f"captured {len(recorder.graphs)} pieces around "
                                   f"{len(recorder.calls)} attention calls: the compiled graph "
                                   "was not cut at every attention")
            if self.on_gpu:
                torch.cuda.synchronize()
                hidden = _unowned(hidden)
            self._captured[bucket] = (recorder.graphs, recorder.calls, hidden)
            self.stats.buckets[bucket] = PieceStats(
                bucket, (time.perf_counter() - t0) * 1e3, self._pool_bytes() - pool0)
            self.stats.num_pieces = len(recorder.graphs)
        self.stats.buckets = dict(sorted(self.stats.buckets.items()))
        return self.stats

    def bucket_for(self, num_tokens: int) -> int | None:
        """The captured bucket a step of ``num_tokens`` replays at; None: larger than all."""
        from labkit.graphs.buckets import bucket_for, check_size
        return bucket_for(check_size("num_tokens", num_tokens), self.buckets, default=None)

    @torch.inference_mode()
    def run(self, num_tokens: int, attention: AttentionFn) -> torch.Tensor:
        """Replays the bucket of ``num_tokens`` (loaded with ``load``), ``attention`` eager
        between the pieces on the first ``num_tokens`` rows -> hidden [num_tokens, hidden]."""
        bucket = self.bucket_for(num_tokens)
        if bucket is None or bucket not in self._captured:
            raise ValueError(f"num_tokens={num_tokens} has no captured bucket (largest "
                             f"{self.buckets[-1]}; capture() first): run that step eagerly")
        graphs, calls, hidden = self._captured[bucket]
        n = num_tokens
        for i, graph in enumerate(graphs):
            graph.replay()
            if i < len(calls):
                layer, q, k, v, out = calls[i]
                attention(layer, q[:n], k[:n], None if v is None else v[:n], out=out[:n])
        self.stats.buckets[bucket].count(n)
        return hidden[:n]
