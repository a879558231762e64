"""Exercise 06.2: merge the partial results of split-KV (flash-decoding) attention.

A long context is cut into ``num_splits`` key ranges so that more programs run at once. Split s
returns ``partial[s]``, the softmax-weighted mean of its values over its own keys (a
[HEAD_DIM] vector), and ``lse[s]``, the log2 of the sum of 2^score over those keys. A split
that saw no key has ``lse[s] = -inf`` (and a partial of zeros). The exact answer over all keys:

    m      = max over s of lse[s]                 (use 0 when every split is empty)
    w[s]   = 2^(lse[s] - m)                       (a split's share of the total weight)
    out    = sum_s w[s] * partial[s] / sum_s w[s] (zeros when sum_s w[s] == 0)

One program merges one (token, head). The splits are loaded as one block of SPLITS_P lanes,
the next power of two above num_splits: lanes s >= num_splits do not exist, so mask them
(with lse = -inf they weigh nothing). Check it from a notebook with ``check("06.2")``, or from a shell with
``python -m labkit.teaching.check 06.2``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

import labkit  # noqa: F401  (interpreter on where there is no GPU)


@triton.jit
def merge_splits_kernel(Partial, Lse, Out, num_splits, stride_pt, stride_ph, stride_ps,
                        stride_lt, stride_lh, stride_ot, stride_oh,
                        HEAD_DIM: tl.constexpr, SPLITS_P: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.arange(0, HEAD_DIM)
    lse_ptrs = Lse + token * stride_lt + head * stride_lh + offs_s                  # [SPLITS_P]
    partial_ptrs = (Partial + token * stride_pt + head * stride_ph
                    + offs_s[:, None] * stride_ps + offs_d[None, :])                # [SPLITS_P, D]

    # BEGIN SOLUTION exercise 06.2: masked loads of lse and partial, weights, out = weighted mean
    real = offs_s < num_splits
    lse = tl.load(lse_ptrs, mask=real, other=float("-inf"))
    m = tl.max(lse, 0)
    weight = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    partial = tl.load(partial_ptrs, mask=real[:, None], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * partial, 0) / tl.where(total == 0.0, 1.0, total)
    # STUB
    # out = tl.zeros([HEAD_DIM], tl.float32)  # replace: the weighted mean of the splits
    # END SOLUTION

    tl.store(Out + token * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def merge_splits(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """partial: float32 [tokens, H, S, D]; lse: float32 [tokens, H, S] -> [tokens, H, D]."""
    tokens, num_heads, num_splits, head_dim = partial.shape
    out = torch.empty(tokens, num_heads, head_dim, dtype=partial.dtype, device=partial.device)
    if tokens == 0:
        return out
    merge_splits_kernel[(tokens, num_heads)](
        partial, lse, out, num_splits, partial.stride(0), partial.stride(1), partial.stride(2),
        lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS_P=triton.next_power_of_2(num_splits))
    return out
