"""The attention backends labkit can run, each with a declaration of what it supports.

A backend is not just an algorithm: it must match the model (heads, head_dim, window), the
cache (dtype, scale granularity, block layout), the requests (mixed prefill/decode), the graph
capture that is wanted and the hardware. Every backend states all of that here, once, and for
what it cannot do, whose limit that is (``limits``: labkit's wrapper or kernel, or the library
or hardware under it). ``selection.py`` checks a spec against it and ``matrix.py`` prints it.

Every backend runs the same two calls, with the signatures of ``labkit.attention``:
``flash(q, k, v, cu_seqlens_q, cu_seqlens_k, ...)`` and
``paged(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, ...)``. A backend that serves
MLA also has ``mla(q_latent, q_rope, latent_cache, block_tables, cu_seqlens_q, seq_lens, *,
scale, ...)``, ``paged_mla_attention``'s signature: attention over one shared latent row.

The two PyTorch peers run a step as one batched call (``peers.py``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from labkit.attention.peers import flex_flash, flex_paged, sdpa_flash, sdpa_paged
from labkit.attention.reference import (flash_attention_ref, paged_attention_ref,
                                        paged_mla_attention_ref)

GRAPH_SUPPORT = ("always", "uniform_decode", "never")
ATTENTION_KINDS = ("MHA", "GQA", "MQA", "MLA")
ANY = None  # a field left ANY accepts every value
# Whose limit a "no" is: labkit's code could lift the first two, not the last two.
LIMITED_BY = ("labkit's wrapper", "labkit's kernel", "the library", "the hardware")


@dataclass(frozen=True)
class Limit:
    """Why a backend cannot do something (a check of the matrix), and whose limit it is."""
    by: str   # one of LIMITED_BY
    why: str

    def __post_init__(self):
        if self.by not in LIMITED_BY:
            raise ValueError(f"a limit's party must be one of {LIMITED_BY}, got {self.by!r}")
        if not isinstance(self.why, str) or not self.why.strip():
            raise ValueError("a limit needs its reason (why)")

    @property
    def labkits(self) -> bool:
        """labkit's own code sets this limit: a better wrapper or kernel would lift it."""
        return self.by in LIMITED_BY[:2]


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
    # matrix check (its "check" label, e.g. "CUDA Graph capture") -> whose limit it is, and why
    limits: dict[str, Limit] = field(default_factory=dict, hash=False)
    mla: Callable | None = None  # attention over a latent cache, where "MLA" is supported

    def __post_init__(self):
        if self.cuda_graphs not in GRAPH_SUPPORT:
            raise ValueError(f"cuda_graphs must be one of {GRAPH_SUPPORT}, got {self.cuda_graphs}")
        unknown = set(self.attention_kinds) - set(ATTENTION_KINDS)
        if unknown:
            raise ValueError(f"unknown attention kinds {unknown}; known: {ATTENTION_KINDS}")
        if ("MLA" in self.attention_kinds) != (self.mla is not None):
            raise ValueError(f"{self.name!r}: a backend that lists MLA needs its mla call, and "
                             "only such a backend has one")
        wrong = [k for k, v in self.limits.items() if not isinstance(v, Limit)]
        if wrong:
            raise TypeError(f"limits {wrong} of {self.name!r} must be Limit(by, why)")

    def limit(self, check: str) -> Limit | None:
        return self.limits.get(check)


# --- triton: ours ----------------------------------------------------------------------------

def _triton_flash(*args, **kwargs):
    from labkit.kernels.flash_attention import flash_attention
    return flash_attention(*args, **kwargs)


def _triton_paged(*args, **kwargs):
    from labkit.kernels.paged_attention import paged_attention
    return paged_attention(*args, **kwargs)


def _triton_mla(*args, **kwargs):
    from labkit.kernels.paged_mla_attention import paged_mla_attention
    return paged_mla_attention(*args, **kwargs)


# --- reference: float64 loops, the definition ------------------------------------------------

def _ref_flash(q, *args, **kwargs):
    return flash_attention_ref(q, *args, **kwargs).to(q.dtype)


def _ref_paged(q, *args, **kwargs):
    return paged_attention_ref(q, *args, **kwargs).to(q.dtype)


def _ref_mla(q_latent, *args, scale, causal=True, check=True, max_query_len=None, out=None):
    """The float64 definition behind ``mla``'s signature (``check`` and ``max_query_len`` are
    the kernel's launch options: nothing to skip or plan here)."""
    result = paged_mla_attention_ref(q_latent, *args, scale=scale, causal=causal)
    return result.to(q_latent.dtype) if out is None else out.copy_(result)


HALF_AND_FLOAT = (torch.float16, torch.bfloat16, torch.float32)
POW2_HEAD_DIMS = (16, 32, 64, 128, 256)
BLOCK_SIZES = (16, 32, 64, 128, 256)

# Limits the wrappers of sdpa, flex and reference share.
_NO_LATENT = Limit("labkit's wrapper", "it takes K and V of one width; an absorbed MLA cache "
                                       "has K 576 wide (512 latent + 64 RoPE) and V 512 (the "
                                       "latent's first columns), and no MLA path is written")
_NO_FP8_GATHER = Limit("labkit's wrapper", "its gather does not dequantise: a dequantising "
                                           "gather would write the cache out again in 16 bits, "
                                           "giving back the bytes fp8 saves")
_HOST_LENGTHS = ("it sizes the padded gather on the host from the batch's lengths (passed in "
                 "as host_lengths, or read back once per call: one sync)")

BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend(
        name="triton", summary="labkit's Triton kernels: FlashAttention tiling, paged decode "
        "with split-KV", flash=_triton_flash, paged=_triton_paged,
        dtypes=HALF_AND_FLOAT, head_dims=POW2_HEAD_DIMS,
        kv_cache_dtypes=("auto", "fp8_e4m3"), kv_scales=("per_kv_head",),
        block_sizes=BLOCK_SIZES, paged_reads="block table in the kernel",
        sliding_window=True, attention_kinds=("MHA", "GQA", "MQA", "MLA"), mixed_batches=True,
        cuda_graphs="uniform_decode", devices=("cuda", "cpu"), mla=_triton_mla,
        min_compute_capability=(8, 0), fp8_min_compute_capability=(8, 9),
        notes="capture with check=False and max_query_len (no host sync); the launch grid "
              "depends on the longest query, so only uniform decode batches replay safely; on "
              "CPU it runs in Triton's interpreter (slow); MLA through paged_mla_attention, a "
              "kernel of its own (K is the 576-wide latent row, V its first 512 columns)",
        limits={
            "CUDA Graph capture": Limit(
                "labkit's kernel", "the launch grid is sized by max_query_len, fixed at "
                "capture: only batches of one token per row replay safely"),
            "fp8 cache needs": Limit(
                "labkit's kernel", "the kernel widens e4m3 with Triton's float8e4nv cast, "
                "which Triton lowers only on sm 8.9+; a bit-level conversion (as some engines "
                "use on sm 8.0) would lift it: older GPUs can hold and read fp8 bytes"),
            "compute capability": Limit(
                "labkit's kernel", "declared for sm 8.0+ (bfloat16 tensor-core dots); older "
                "GPUs are not tried"),
        }),
    Backend(
        name="flex", summary="PyTorch FlexAttention (compiled on GPU with dynamic shapes) over "
        "the padded batch, one block mask per batch shape",
        flash=flex_flash, paged=flex_paged,
        dtypes=HALF_AND_FLOAT, head_dims=POW2_HEAD_DIMS,
        kv_cache_dtypes=("auto",), kv_scales=(), block_sizes=ANY,
        paged_reads="gathers blocks into padded KV first", sliding_window=True,
        attention_kinds=("MHA", "GQA", "MQA"), mixed_batches=True, cuda_graphs="never",
        devices=("cuda", "cpu"), min_compute_capability=(8, 0),
        notes="one call per layer: queries padded to [B, Hq, Lq, D], keys gathered to "
              "[B, Hkv, Lk, D] (at decode only a window's last keys), enable_gqa; compiled "
              "once with dynamic=True, so new lengths reuse the kernel; the block mask is "
              "built once per batch shape (lengths, causal, window) and cached, so the layers "
              "of one step share it; a new shape still costs one create_block_mask (dense "
              "over [B, Lq, Lk] on the device); queries are padded as for sdpa",
        limits={
            "MLA": _NO_LATENT,
            "KV cache dtypes": _NO_FP8_GATHER,
            "paged KV": Limit(
                "labkit's wrapper", "FlexAttention can read pages in place through a block "
                "mask remapped to physical blocks (torch's experimental PagedAttention, which "
                "wants the mask's KV block size equal to the page size); the wrapper gathers"),
            "CUDA Graph capture": Limit(
                "labkit's wrapper", f"{_HOST_LENGTHS} and builds a block mask for each new "
                "batch shape; flex_attention itself can be captured with a fixed block mask"),
            "compute capability": Limit("labkit's wrapper", "declared for sm 8.0+; older GPUs "
                                                            "are not tried"),
        }),
    Backend(
        name="sdpa", summary="torch scaled_dot_product_attention, one batched call per layer",
        flash=sdpa_flash, paged=sdpa_paged,
        dtypes=HALF_AND_FLOAT, head_dims=tuple(range(8, 257, 8)),
        kv_cache_dtypes=("auto",), kv_scales=(), block_sizes=ANY,
        paged_reads="gathers blocks into padded KV first", sliding_window=True,
        attention_kinds=("MHA", "GQA", "MQA"), mixed_batches=True, cuda_graphs="never",
        devices=("cuda", "cpu"),
        notes="one call per layer (sdpa_call says which): decode with equal lengths "
              "passes enable_gqa and no mask, which the flash kernel inside SDPA can serve; "
              "decode with unequal lengths, the common case, folds each KV head's query heads "
              "into its queries and passes a boolean padding mask, which rules out SDPA's "
              "flash kernel; varlen prefill pads to "
              "[B, Hq, Lq, D] with one boolean mask (causal end-aligned + window + "
              "padding) and enable_gqa. Any boolean mask rules out the flash kernel on CUDA; "
              "in torch 2.11 a mask with enable_gqa also rules out the memory-efficient "
              "kernel (it takes no GQA there), leaving cuDNN or the math kernel. Padding "
              "costs work: a mixed batch pads every sequence's queries to the longest, so "
              "the decodes beside a prefill chunk each compute Lq rows",
        limits={
            "MLA": _NO_LATENT,
            "KV cache dtypes": _NO_FP8_GATHER,
            "paged KV": Limit(
                "the library", "F.scaled_dot_product_attention takes dense [B, H, L, D] "
                "tensors and no block table; PyTorch's separate varlen_attn (CUDA, flash) "
                "takes cu_seqlens, and in newer releases a block table: this backend is "
                "SDPA, so it gathers"),
            "CUDA Graph capture": Limit(
                "labkit's wrapper", f"{_HOST_LENGTHS} and chooses mask or none there; SDPA's "
                "kernels themselves can be captured at fixed shapes"),
        }),
    Backend(
        name="reference", summary="plain torch in float64: the definition, slow",
        flash=_ref_flash, paged=_ref_paged,
        dtypes=HALF_AND_FLOAT, head_dims=ANY,
        kv_cache_dtypes=("auto", "fp8_e4m3"), kv_scales=("per_kv_head",), block_sizes=ANY,
        paged_reads="gathers blocks into contiguous KV first", sliding_window=True,
        attention_kinds=("MHA", "GQA", "MQA", "MLA"), mixed_batches=True, cuda_graphs="never",
        devices=("cuda", "cpu"), mla=_ref_mla,
        limits={
            "CUDA Graph capture": Limit("labkit's wrapper", "it loops over the sequences on "
                                                            "the host: the definition, not a "
                                                            "fast path"),
        }),
)}

# Auto selection tries these in order: ours first (paged reads, fp8, one launch per batch), then
# the fused peers, then the reference, which accepts nearly everything but is slow.
PRIORITY: tuple[str, ...] = ("triton", "flex", "sdpa", "reference")
