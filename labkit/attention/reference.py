"""Plain torch attention: the definitions every kernel in labkit is checked against.

They loop over sequences and compute in float64 (or ``compute_dtype``), and return that dtype,
so a test measures the kernel's error and not the reference's own rounding.

Masking, shared by every backend (``len_q`` new queries at the end of ``len_k`` keys):
query ``i`` sits at position ``pos = len_k - len_q + i`` (the causal mask is aligned to the end);
with ``causal`` it sees keys ``j <= pos``; with ``window=W`` it also needs ``j > pos - W``, so it
sees at most the W most recent keys, itself included. A query that sees no key returns zeros.
"""
from __future__ import annotations

import math

import torch


def visible_mask(len_q: int, len_k: int, *, causal: bool, window: int | None,
                 device=None) -> torch.Tensor:
    """[len_q, len_k] bool: which keys each query may attend to."""
    pos = torch.arange(len_q, device=device)[:, None] + (len_k - len_q)
    j = torch.arange(len_k, device=device)[None, :]
    mask = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if causal:
        mask &= j <= pos
    if window is not None:
        mask &= j > pos - window
    return mask


def attention_one_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                           window: int | None, scale: float) -> torch.Tensor:
    """q: [len_q, Hq, D]; k, v: [len_k, Hkv, D] (same dtype) -> [len_q, Hq, D]."""
    len_q, num_q_heads, _ = q.shape
    len_k, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    mask = visible_mask(len_q, len_k, causal=causal, window=window, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no visible key -> 0
    return torch.einsum("hqk,khd->qhd", probs, v)


def _default_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def flash_attention_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal: bool = True,
                        window: int | None = None, scale: float | None = None,
                        compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Packed variable-length attention, one sequence at a time.

    q: [total_q, Hq, D]; k, v: [total_k, Hkv, D]; cu_seqlens_*: [batch + 1] -> [total_q, Hq, D].
    """
    scale = _default_scale(q.shape[-1], scale)
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        out[qs] = attention_one_sequence(
            q[qs].to(compute_dtype), k[ks].to(compute_dtype), v[ks].to(compute_dtype),
            causal=causal, window=window, scale=scale)
    return out


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
              scale: torch.Tensor | None = None,
              compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The first ``seq_len`` tokens of one sequence, contiguous: [seq_len, Hkv, D].

    cache: [num_blocks, block_size, Hkv, D]; block_table: [max_blocks] physical block ids.
    ``scale`` ([Hkv], float32) dequantises an fp8 cache.
    """
    block_size = cache.shape[1]
    used = block_table[: -(-seq_len // block_size)].long()
    kv = cache[used].reshape(-1, *cache.shape[2:])[:seq_len].to(compute_dtype)
    if scale is not None:
        kv = kv * scale.to(compute_dtype)[None, :, None]
    return kv


def paged_attention_ref(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *,
                        causal: bool = True, window: int | None = None,
                        scale: float | None = None, k_scale=None, v_scale=None,
                        compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Attention of each sequence's new tokens over its paged KV cache.

    q: [total_q, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [batch, max_blocks]; cu_seqlens_q: [batch + 1]; seq_lens: [batch] tokens in
    the cache (the new ones included) -> [total_q, Hq, D].
    """
    scale = _default_scale(q.shape[-1], scale)
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    cq, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        qs = slice(cq[b], cq[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len, k_scale, compute_dtype)
        v = gather_kv(v_cache, block_tables[b], seq_len, v_scale, compute_dtype)
        out[qs] = attention_one_sequence(q[qs].to(compute_dtype), k, v, causal=causal,
                                         window=window, scale=scale)
    return out


def paged_mla_attention_ref(q_latent, q_rope, latent_cache, block_tables, cu_seqlens_q,
                            seq_lens, *, scale: float, causal: bool = True,
                            compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """MLA's absorbed attention over a paged latent cache, one sequence at a time.

    q_latent: [total_q, H, R]; q_rope: [total_q, H, P]; latent_cache: [num_blocks, block_size,
    R + P], each row c_kv (R values) then k_pe (P values); block_tables, cu_seqlens_q, seq_lens
    as for ``paged_attention_ref`` -> [total_q, H, R]. Every head scores
    ``q_latent . c_kv + q_rope . k_pe`` and averages ``c_kv`` itself: one shared latent, no
    per-head keys or values.
    """
    rank = q_latent.shape[-1]
    out = torch.zeros(q_latent.shape, dtype=compute_dtype, device=q_latent.device)
    cq, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for b, seq_len in enumerate(lens):
        if cq[b + 1] == cq[b]:
            continue
        qs = slice(cq[b], cq[b + 1])
        latent = gather_kv(latent_cache[:, :, None, :], block_tables[b], seq_len, None,
                           compute_dtype)[:, 0]  # [seq_len, R + P]
        c_kv, k_pe = latent[:, :rank], latent[:, rank:]
        ql, qr = q_latent[qs].to(compute_dtype), q_rope[qs].to(compute_dtype)
        scores = (torch.einsum("qhr,kr->hqk", ql, c_kv)
                  + torch.einsum("qhp,kp->hqk", qr, k_pe)) * scale
        mask = visible_mask(ql.shape[0], seq_len, causal=causal, window=None, device=ql.device)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0)
        out[qs] = torch.einsum("hqk,kr->qhr", probs, c_kv)
    return out
