"""Which engine steps replay CUDA Graphs, and capturing them for a runner.

``cudagraph_mode`` says which steps replay graphs (``CUDAGRAPH_MODES``):

* ``"full_decode_only"``: decode-only steps replay a full CUDA Graph of the whole forward from a
  :class:`~labkit.graphs.GraphPool`, padded to their batch bucket: every row there is one token,
  so the shapes depend only on the batch. Padding rows carry -1 everywhere: slot -1 is never
  written (``store_kv``), and their outputs are dropped. Every other step runs eagerly.
* ``"piecewise"``: every step of at most the largest token bucket replays piecewise graphs
  (``labkit.engine.pieces``): the work between attentions captured per token count (on a GPU
  the K/V store too), attention run eagerly between the pieces with the step's real metadata,
  planned once for the step, so any mix of prefill chunks and decodes replays. Attention is
  never captured, so any backend serves.
* ``"full_and_piecewise"``: full graphs for decode-only steps, piecewise for the rest: the
  default on CUDA, as vLLM V1's.
* ``"none"``: every step eager (``enforce_eager=True``).

With speculative decoding, the two full modes also capture a full graph per (request bucket,
k + 1) for steps whose every row verifies k drafts (``labkit.engine.verify_graphs``); other
verify steps run as the mode runs any step that is not uniform decode.

On CPU the default is ``"none"``; ``"piecewise"`` captures with labkit's CPU stand-in
(``labkit.graphs.emulated_cuda``): no faster, but frozen the same way, so a piece that read a
value back to the host or a buffer it does not own fails on a laptop as on a GPU.

Both kinds of graph have their memory predicted before capture (one eager run inside a private
pool) and measured after (``graph_memory``).
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from labkit.engine.model import LlamaModel
from labkit.engine.mla_pieces import MLAPiecewiseForward
from labkit.engine.pieces import PiecewiseForward
from labkit.graphs import GraphPool
from labkit.graphs.emulated_cuda import cuda_for
from labkit.graphs.piecewise import PiecewiseGraphs
from labkit.kvcache import PagedKVCache

log = logging.getLogger("labkit.engine")

PAD = -1  # graph padding rows: slot -1 is skipped by store_kv; ids and lengths are clamped to 0

CUDAGRAPH_MODES = ("none", "full_decode_only", "piecewise", "full_and_piecewise")
# The default on CUDA, as vLLM V1's: full graphs for uniform decode, piecewise for the rest.
DEFAULT_CUDA_GRAPH_MODE = "full_and_piecewise"


def resolve_cudagraph_mode(cudagraph_mode: str | None, enforce_eager: bool,
                           device: torch.device) -> str:
    """The mode a runner on ``device`` uses: ``cudagraph_mode``, or the device's default
    (``DEFAULT_CUDA_GRAPH_MODE`` on CUDA, ``"none"`` elsewhere); ``enforce_eager`` means
    ``"none"``."""
    if cudagraph_mode is not None and cudagraph_mode not in CUDAGRAPH_MODES:
        raise ValueError(f"cudagraph_mode must be one of {list(CUDAGRAPH_MODES)} or None (the "
                         f"device's default), got {cudagraph_mode!r}")
    if enforce_eager:
        if cudagraph_mode not in (None, "none"):
            raise ValueError(f"enforce_eager=True means cudagraph_mode='none'; got "
                             f"cudagraph_mode={cudagraph_mode!r} too: pass one of them")
        return "none"
    if cudagraph_mode is None:
        return DEFAULT_CUDA_GRAPH_MODE if device.type == "cuda" else "none"
    if cudagraph_mode.startswith("full") and device.type != "cuda":
        raise ValueError(f"cudagraph_mode={cudagraph_mode!r} captures whole decode steps, "
                         f"attention included, which needs a CUDA device (labkit's CPU stand-in "
                         f"records torch ops, and on {device.type} the capturable attention "
                         "kernels run in Triton's interpreter): on CPU use 'piecewise' or "
                         "'none'")
    return cudagraph_mode


@torch.inference_mode()
def capture_decode_graphs(decode_forward: Callable, buckets: Sequence[int],
                          context_buckets: Sequence[int] | None, max_blocks_per_seq: int,
                          device: torch.device) -> GraphPool:
    """Full graphs of ``decode_forward(ids, positions, slots, block_tables, seq_lens)`` per
    batch bucket (and context bucket), captured from all-padding rows, so warm-up and capture
    write no slot of the cache; on a GPU the pool's memory is predicted first."""
    graphs = GraphPool(decode_forward, buckets, pad_value=PAD, context_buckets=context_buckets)
    row = torch.full((1,), PAD, dtype=torch.int32, device=device)
    table = torch.full((1, max_blocks_per_seq), PAD, dtype=torch.int32, device=device)
    example = (row, row.clone(), row.clone(), table, row.clone())
    if device.type == "cuda":
        graphs.predict_memory(*example)
    graphs.capture(*example)
    log.info(f"captured {len(graphs.keys())} decode graphs (batch buckets {list(buckets)}, "
             f"context buckets {context_buckets or 'none'}) in "
             f"{graphs.stats.capture_ms:.0f} ms")
    return graphs


@torch.inference_mode()
def capture_piecewise_graphs(model: LlamaModel, fused_ops: bool, buckets: Sequence[int],
                             cache: PagedKVCache) -> tuple[PiecewiseForward, PiecewiseGraphs]:
    """The model's pieces (``PiecewiseForward``) over static buffers of ``max(buckets)`` rows,
    captured per token bucket, their memory predicted first."""
    device = model.embed_tokens.device
    if device.type != "cuda" and fused_ops:
        raise ValueError("on CPU, piecewise graphs are captured by labkit's stand-in, which "
                         "records torch ops and cannot see the fused Triton kernels: pass "
                         "fused_ops=False with cudagraph_mode='piecewise'")
    # On a GPU each piece stores its layer's new K/V itself (a kernel per token, padding slots
    # -1 skipped), so only attention runs between the graphs. On CPU the stand-in cannot
    # record the store kernel: attention stores them.
    keep = cache if device.type == "cuda" else None
    if model.config.is_mla:  # its own cut: the absorbed path's query, latent rows and output
        pieces = MLAPiecewiseForward(model, max(buckets), cache=keep)
    else:
        pieces = PiecewiseForward(model, model.ops(fused_ops), max(buckets), cache=keep)
    piecewise = PiecewiseGraphs(pieces.pieces(), buckets, cuda=cuda_for(device))
    predicted = piecewise.predict_memory()
    stats = piecewise.capture()
    log.info(f"captured {stats.num_graphs} piecewise graphs ({stats.num_pieces} pieces x "
             f"{len(stats.buckets)} token buckets up to {max(buckets)}) in "
             f"{stats.capture_ms:.0f} ms; pool {stats.pool_bytes / 2**20:.1f} MiB (predicted "
             f"{predicted / 2**20:.1f}) + static {pieces.static_bytes / 2**20:.1f} MiB")
    return pieces, piecewise


def capture_compiled_piecewise(compiled, buckets: Sequence[int], device: torch.device):
    """``compile=True``'s piecewise graphs (``compiled_pieces.CompiledPiecewise``): the
    compiled pieces captured per token bucket. Off a GPU each piece re-runs at replay instead
    (Inductor's CPU kernels cannot be recorded), which checks the replay's order and buffers.
    No prediction is made: Inductor's kernels run only once Dynamo has traced."""
    from labkit.engine.compiled_pieces import CompiledPiecewise

    piecewise = CompiledPiecewise(compiled, buckets, device)
    stats = piecewise.capture()
    log.info(f"captured {stats.num_graphs} compiled piecewise graphs ({stats.num_pieces} "
             f"pieces x {len(stats.buckets)} token buckets up to {max(buckets)}) in "
             f"{stats.capture_ms:.0f} ms (after one compiling run); pool "
             f"{stats.pool_bytes / 2**20:.1f} MiB")
    return piecewise


def graph_memory(graphs: GraphPool | None, piecewise: PiecewiseGraphs | None,
                 pieces: PiecewiseForward | None, verify: GraphPool | None = None) -> list[dict]:
    """Per kind of graph captured ("full" decode graphs, "piecewise", "full verify"): the graph
    count, capture ms, and device memory predicted before capture against what the capture
    took (pool and static buffers, bytes; the prediction None where none was made).
    ``pieces``: what holds the piecewise graphs' static buffers (``PiecewiseForward``, or
    ``CompiledPiecewise`` itself). ``verify``: the pool of the verify graphs
    (``VerifyGraphs.pool``)."""
    def full(kind: str, pool: GraphPool) -> dict:
        st = pool.stats
        return {"graphs": kind, "count": len(pool.keys()), "capture_ms": st.capture_ms,
                "predicted_bytes": st.predicted_bytes, "measured_bytes": st.captured_bytes}

    rows = []
    if graphs is not None:
        rows.append(full("full", graphs))
    if piecewise is not None:
        st, static = piecewise.stats, pieces.static_bytes
        rows.append({"graphs": "piecewise", "count": st.num_graphs, "capture_ms": st.capture_ms,
                     "predicted_bytes": None if st.predicted_bytes is None
                     else st.predicted_bytes + static,
                     "measured_bytes": st.pool_bytes + static})
    if verify is not None:
        rows.append(full("full verify", verify))
    return rows
