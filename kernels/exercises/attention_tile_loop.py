"""Exercise 06.1: the masked tile loop of a FlashAttention-style kernel.

One program owns BLOCK_M queries of one head. Its query tile ``q`` and three running values
stay on chip: ``acc`` (the unnormalised output), ``m_i`` (the largest scaled score seen so far
per query, base 2) and ``l_i`` (the sum of 2^(score - m_i)). Your loop streams the keys and
values past them, BLOCK_N at a time:

    for each key tile starting at n (0, BLOCK_N, 2*BLOCK_N, ... < len_k):
        load the K tile [HEAD_DIM, BLOCK_N] and the V tile [BLOCK_N, HEAD_DIM]: keys past len_k
            do not exist, so mask those loads (the last tile is usually partial)
        s = q @ k                                   # [BLOCK_M, BLOCK_N] raw scores
        keys a query may not see get -inf: past len_k, and with CAUSAL, keys after its
            position pos (key j is visible when j <= pos)
        m_new = max(m_i, row max of s * qk_scale)
        alpha = 2^(m_i - m_new)                     # rescales what was summed before
        p = 2^(s * qk_scale - m_new)                # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + row sum of p
        acc = acc * alpha + p @ v
        m_i = m_new

``qk_scale`` is 1/sqrt(HEAD_DIM) * log2(e), so exp2 gives the usual softmax. Check your loop
from a notebook with ``check("06.1")``, or in a shell with ``python -m labkit.teaching.check
06.1``: it runs the kernel in Triton's interpreter on awkward lengths and reports any load or
store outside the tensors, with its program id.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

import labkit  # noqa: F401  (interpreter on where there is no GPU)


@triton.jit
def attention_tile_loop_kernel(Q, K, V, Out, len_q, len_k, stride_qt, stride_qh, stride_kt,
                               stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, qk_scale,
                               CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)   # this program's queries
    offs_n = tl.arange(0, BLOCK_N)                    # key offsets inside one key tile
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + head * stride_qh + offs_m[:, None] * stride_qt + offs_d[None, :],
                mask=(offs_m < len_q)[:, None], other=0.0)
    pos = len_k - len_q + offs_m    # each query's position among the keys (end-aligned)
    K += head * stride_kh
    V += head * stride_vh
    m_i = tl.full([BLOCK_M], -1e30, tl.float32)  # finite: a fully masked tile gives p = 0, not NaN
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # BEGIN SOLUTION exercise 06.1: the loop over key tiles (mask, online softmax, accumulate)
    for n in range(0, len_k, BLOCK_N):
        keys = n + offs_n
        in_seq = keys < len_k
        k = tl.load(K + keys[None, :] * stride_kt + offs_d[:, None],  # [HEAD_DIM, BLOCK_N]
                    mask=in_seq[None, :], other=0.0)
        v = tl.load(V + keys[:, None] * stride_vt + offs_d[None, :],  # [BLOCK_N, HEAD_DIM]
                    mask=in_seq[:, None], other=0.0)
        s = tl.dot(q, k)
        visible = in_seq[None, :]
        if CAUSAL:
            visible = visible & (keys[None, :] <= pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # STUB
    # # Your loop over the key tiles goes here (see the docstring at the top of this file).
    # END SOLUTION

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]   # a query that saw no key gives zeros
    tl.store(Out + head * stride_oh + offs_m[:, None] * stride_ot + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=(offs_m < len_q)[:, None])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              block_m: int = 16, block_n: int = 16) -> torch.Tensor:
    """q: [len_q, H, D]; k, v: [len_k, H, D] -> [len_q, H, D]. One sequence, no GQA."""
    len_q, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if len_q == 0:
        return out
    grid = (triton.cdiv(len_q, block_m), num_heads)
    attention_tile_loop_kernel[grid](
        q, k, v, out, len_q, k.shape[0], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        1.0 / math.sqrt(head_dim) * math.log2(math.e),
        CAUSAL=causal, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n)
    return out
