"""The attention backends labkit can run, each with a declaration of what it supports.

A backend is not just an algorithm: it must match the model (heads, head_dim, window), the
cache (dtype, scale granularity, block layout), the requests (mixed prefill/decode), the graph
capture that is wanted and the hardware. Every backend states all of that here, once;
``selection.py`` checks a spec against it and ``matrix.py`` prints it as a table.

Every backend runs the same two calls, with the signatures of ``labkit.attention``:
``flash(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)`` and
``paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, ...)``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from labkit.attention.reference import (flash_attention_ref, gather_kv, paged_attention_ref,
                                        visible_mask)

GRAPH_SUPPORT = ("always", "uniform_decode", "never")
ATTENTION_KINDS = ("MHA", "GQA", "MQA", "MLA")
ANY = None  # a field left ANY accepts every value


@dataclass(frozen=True)
class Backend:
    name: str
    summary: str
    flash: Callable
    paged: Callable
    dtypes: tuple[torch.dtype, ...]
    head_dims: tuple[int, ...] | None
    kv_cache_dtypes: tuple[str, ...]  # "auto" = the query's dtype; "fp8_e4m3"
    kv_scales: tuple[str, ...]  # scale granularities understood for quantised caches
    block_sizes: tuple[int, ...] | None
    paged_reads: str  # how the block table is used
    sliding_window: bool
    attention_kinds: tuple[str, ...]
    mixed_batches: bool
    cuda_graphs: str  # always / uniform_decode / never
    devices: tuple[str, ...]
    min_compute_capability: tuple[int, int] | None = None
    fp8_min_compute_capability: tuple[int, int] | None = None
    notes: str = ""

    def __post_init__(self):
        if self.cuda_graphs not in GRAPH_SUPPORT:
            raise ValueError(f"cuda_graphs must be one of {GRAPH_SUPPORT}, got {self.cuda_graphs}")
        unknown = set(self.attention_kinds) - set(ATTENTION_KINDS)
        if unknown:
            raise ValueError(f"unknown attention kinds {unknown}; known: {ATTENTION_KINDS}")


# --- triton: ours ----------------------------------------------------------------------------

def _triton_flash(*args, **kwargs):
    from labkit.kernels.flash_attention import flash_attention
    return flash_attention(*args, **kwargs)


def _triton_paged(*args, **kwargs):
    from labkit.kernels.paged_attention import paged_attention
    return paged_attention(*args, **kwargs)


# --- sdpa: PyTorch's scaled_dot_product_attention, one sequence at a time ---------------------

def _sdpa_one(q, k, v, *, causal, window, scale):
    """q: [len_q, Hq, D], k/v: [len_k, Hkv, D] -> [len_q, Hq, D] through F.sdpa."""
    len_q, len_k = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))  # [1, H, L, D]
    if group > 1:
        k4, v4 = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1)
    mask, is_causal = None, False
    if causal and window is None and len_q == len_k:
        is_causal = True  # SDPA's own causal flag aligns top-left: right only when lengths match
    elif causal or window is not None:
        mask = visible_mask(len_q, len_k, causal=causal, window=window, device=q.device)
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=is_causal,
                                         scale=scale)
    return out[0].transpose(0, 1).nan_to_num(0.0)  # a query that sees nothing gives zeros


def _sdpa_flash(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, window=None, scale=None):
    out = torch.zeros_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        if cq[b + 1] > cq[b]:
            out[cq[b]:cq[b + 1]] = _sdpa_one(q[cq[b]:cq[b + 1]], k[ck[b]:ck[b + 1]],
                                             v[ck[b]:ck[b + 1]], causal=causal, window=window,
                                             scale=scale)
    return out


def _sdpa_paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, causal=True,
                window=None, scale=None, k_scale=None, v_scale=None):
    if k_scale is not None or v_scale is not None:
        raise ValueError("the sdpa backend has no fp8 cache support")
    out = torch.zeros_like(q)
    cq = cu_seqlens_q.tolist()
    for b, n in enumerate(seq_lens.tolist()):
        if cq[b + 1] > cq[b]:  # gathering the blocks into contiguous KV is the price of SDPA
            k = gather_kv(k_cache, block_tables[b], n, compute_dtype=q.dtype)
            v = gather_kv(v_cache, block_tables[b], n, compute_dtype=q.dtype)
            out[cq[b]:cq[b + 1]] = _sdpa_one(q[cq[b]:cq[b + 1]], k, v, causal=causal,
                                             window=window, scale=scale)
    return out


# --- flex: FlexAttention with a document mask over the packed batch ---------------------------

_compiled_flex = {}  # device type -> flex_attention, compiled once on a GPU


def _flex_fn(device: torch.device):
    from torch.nn.attention.flex_attention import flex_attention
    if device.type != "cuda":
        return flex_attention  # eager: unfused, but the same semantics
    if "cuda" not in _compiled_flex:
        _compiled_flex["cuda"] = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex["cuda"]


def flex_block_mask(cu_seqlens_q, cu_seqlens_k, *, causal, window):
    """Each packed query sees only keys of its own sequence, end-aligned causal, windowed."""
    from torch.nn.attention.flex_attention import create_block_mask
    dev = cu_seqlens_q.device
    lens_q, lens_k = cu_seqlens_q.diff().long(), cu_seqlens_k.diff().long()
    batch = torch.arange(lens_q.numel(), device=dev)
    doc_q, doc_k = batch.repeat_interleave(lens_q), batch.repeat_interleave(lens_k)
    q_pos = (torch.arange(doc_q.numel(), device=dev) - cu_seqlens_q[doc_q]
             + (lens_k - lens_q)[doc_q])
    k_pos = torch.arange(doc_k.numel(), device=dev) - cu_seqlens_k[doc_k]

    def mask_mod(b, h, qi, ki):
        ok = doc_q[qi] == doc_k[ki]
        if causal:
            ok = ok & (k_pos[ki] <= q_pos[qi])
        if window is not None:
            ok = ok & (k_pos[ki] > q_pos[qi] - window)
        return ok

    return create_block_mask(mask_mod, None, None, doc_q.numel(), doc_k.numel(), device=dev)


def _flex_flash(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=True, window=None, scale=None,
                block_mask=None):
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q)
    block_mask = block_mask or flex_block_mask(cu_seqlens_q, cu_seqlens_k, causal=causal,
                                               window=window)
    q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "called without torch.compile" on CPU: known, fine
        out = _flex_fn(q.device)(q4, k4, v4, block_mask=block_mask, scale=scale,
                                 enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1).contiguous()


def _flex_paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *, causal=True,
                window=None, scale=None, k_scale=None, v_scale=None):
    if k_scale is not None or v_scale is not None:
        raise ValueError("the flex backend has no fp8 cache support")
    lens = seq_lens.tolist()
    k = torch.cat([gather_kv(k_cache, block_tables[b], n, compute_dtype=q.dtype)
                   for b, n in enumerate(lens)])
    v = torch.cat([gather_kv(v_cache, block_tables[b], n, compute_dtype=q.dtype)
                   for b, n in enumerate(lens)])
    cu_k = torch.zeros(len(lens) + 1, dtype=torch.int32, device=q.device)
    cu_k[1:] = seq_lens.cumsum(0)
    return _flex_flash(q, k, v, cu_seqlens_q, cu_k, causal=causal, window=window, scale=scale)


# --- reference: float64 loops, the definition ------------------------------------------------

def _ref_flash(q, *args, **kwargs):
    return flash_attention_ref(q, *args, **kwargs).to(q.dtype)


def _ref_paged(q, *args, **kwargs):
    return paged_attention_ref(q, *args, **kwargs).to(q.dtype)


HALF_AND_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
POW2_HEAD_DIMS = (16, 32, 64, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128, 256)

BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend(
        name="triton", summary="labkit's Triton kernels: FlashAttention tiling, paged decode "
        "with split-KV", flash=_triton_flash, paged=_triton_paged,
        dtypes=HALF_AND_FLOAT, head_dims=POW2_HEAD_DIMS,
        kv_cache_dtypes=("auto", "fp8_e4m3"), kv_scales=("per_kv_head",),
        block_sizes=BLOCK_SIZES, paged_reads="block table in the kernel",
        sliding_window=True, attention_kinds=("MHA", "GQA", "MQA"), mixed_batches=True,
        cuda_graphs="uniform_decode", devices=("cuda", "cpu"),
        min_compute_capability=(8, 0), fp8_min_compute_capability=(8, 9),
        notes="capture with check=False and max_query_len (no host sync); the launch grid "
              "depends on the longest query, so only uniform decode batches replay safely; on "
              "CPU it runs in Triton's interpreter (slow)"),
    Backend(
        name="flex", summary="PyTorch FlexAttention (compiled on GPU) with a document mask",
        flash=_flex_flash, paged=_flex_paged,
        dtypes=HALF_AND_FLOAT, head_dims=POW2_HEAD_DIMS,
        kv_cache_dtypes=("auto",), kv_scales=(), block_sizes=ANY,
        paged_reads="gathers blocks into contiguous KV first", sliding_window=True,
        attention_kinds=("MHA", "GQA", "MQA"), mixed_batches=True, cuda_graphs="never",
        devices=("cuda", "cpu"), min_compute_capability=(8, 0),
        notes="the block mask is built on the host for every batch"),
    Backend(
        name="sdpa", summary="torch scaled_dot_product_attention, one sequence at a time",
        flash=_sdpa_flash, paged=_sdpa_paged,
        dtypes=HALF_AND_FLOAT, head_dims=tuple(range(8, 257, 8)),
        kv_cache_dtypes=("auto",), kv_scales=(), block_sizes=ANY,
        paged_reads="gathers blocks into contiguous KV first", sliding_window=True,
        attention_kinds=("MHA", "GQA", "MQA"), mixed_batches=True, cuda_graphs="never",
        devices=("cuda", "cpu"),
        notes="a window or unequal lengths need an explicit mask, which rules out the flash "
              "kernel inside SDPA; a Python loop over sequences syncs with the host"),
    Backend(
        name="reference", summary="plain torch in float64: the definition, slow",
        flash=_ref_flash, paged=_ref_paged,
        dtypes=HALF_AND_FLOAT, head_dims=ANY,
        kv_cache_dtypes=("auto", "fp8_e4m3"), kv_scales=("per_kv_head",), block_sizes=ANY,
        paged_reads="gathers blocks into contiguous KV first", sliding_window=True,
        attention_kinds=("MHA", "GQA", "MQA"), mixed_batches=True, cuda_graphs="never",
        devices=("cuda", "cpu")),
)}

# Auto selection tries these in order: ours first (paged reads, fp8, one launch per batch), then
# the fused peers, then the reference, which accepts nearly everything but is slow.
PRIORITY: tuple[str, ...] = ("triton", "flex", "sdpa", "reference")
