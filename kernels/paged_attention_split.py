"""Split-KV decoding (flash-decoding): how many splits, and the kernel that merges them.

When batch x kv_heads x query tiles is smaller than the number of SMs, most of the GPU would
wait while a few programs walk long contexts. Splitting each context into ``num_splits`` key
ranges gives every SM work; each split returns its normalised partial output ``o_s`` and the
log-sum-exp of its scores ``lse_s`` (base 2). The exact softmax over all keys is then

    out = sum_s 2^(lse_s - m) * o_s / sum_s 2^(lse_s - m),   m = max_s lse_s,

because each ``o_s`` is its own softmax-weighted mean and ``2^lse_s`` its share of the total
weight. A split that saw no key has ``lse_s = -inf`` and weight 0.

The merge is a kernel of its own, launched behind the attention kernel. The other way round,
the last program of each (sequence, KV head) to finish merges its group itself (each program
takes a ticket from an atomic counter after storing its partial; the one that draws the last
ticket reads the others' partials from L2), lost everywhere it was raced on an H200 (GQA 32/8,
bf16 decode, 7 interleaved rounds, replayed): 0.86x at batch 1 over 32k keys, 0.73x at batch 1
over 1k, 0.94x for bench_1b's whole decode step at batch 1. The merging program works alone
at the end of the kernel, behind a GPU-wide memory fence, where the merge kernel spreads the
same reads over dozens of programs that start as the attention kernel drains (``pdl.py``).
"""
from __future__ import annotations

import functools

import labkit  # noqa: F401  (before triton: interpreter on where there is no GPU)
import torch
import triton
import triton.language as tl
from labkit.kernels.grid import cdiv, next_power_of_2
from labkit.kernels.pdl import launch_options, pdl_for, wait_for_kernel_ahead

MIN_KEYS_PER_SPLIT = 64  # one or two key tiles. Few programs over a short context are bound by
# the latency of their serial tiles, not by the split's partial write and merge. GQA 32/8 decode
# on an H200 against one split per 256 keys (7 rounds, 64-key tiles then, merge included, HBM):
# batch 1 at 1,024 keys 7.7 us in 16 splits against 12.4 in 4 (1.61x), at 4,096 1.16x, batch 8
# at 1,024 1.10x; where both rules give the same plan, the same time.
MAX_SPLITS = 64
# Output columns and warps per merge program: (64, 1) for rows up to 128 wide, (128, 4) for
# wider ones (MLA's 512-wide latent). A merge is a few microseconds at the end of a split step,
# bound by latency: on an H200 (7 interleaved rounds, attention and merge replayed) many light
# programs beat fewer heavy ones for heads of 64 and 128: GQA 32/8 D128 at 32k tokens 1.02x
# (B1) and 1.01x (B2), bench_1b's step 1.02x at B8 and 1.01x at B1 with 4k tokens (at B1 with
# 1k, 0.999x: 0.998-1.0); MLA's rows lost with them at B1 32k over 16 heads (0.98x).
NARROW_MERGE = (64, 1)
WIDE_MERGE = (128, 4)


WAVES = 4  # programs per SM wanted. A program streams its keys alone; with too few of them the
# memory system idles while each ramps up: ``long_context`` in
# labkit/recorded_data/attention_backends.json has small batches split and unsplit on an H200.


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """The SMs a split plan fills: the GPU's count, or 4 under the interpreter (small enough
    that the tests' small batches take the split path)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def choose_num_splits(programs: int, max_seq_len: int, num_sms: int, waves: int = WAVES,
                      max_splits: int = MAX_SPLITS) -> int:
    """Splits per (sequence, kv head, query tile) so that about ``waves`` programs per SM run,
    ``max_splits`` at most. Rounded to nearest, not up: one split too many costs more than a
    slightly short wave."""
    wanted = int(waves * num_sms / max(programs, 1) + 0.5)
    if wanted <= 1:
        return 1
    useful = cdiv(max_seq_len, MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, useful, max_splits))


def keys_per_split(seq_len: int, num_splits: int, block_n: int) -> int:
    """The keys each split of a ``seq_len``-key sequence reads: an even share, rounded up to
    whole ``block_n``-key tiles (the last split takes what is left). The kernels deal each
    sequence's own share on the device by the same rule; a plan keeps the longest sequence's."""
    return cdiv(cdiv(max(seq_len, 1), num_splits), block_n) * block_n


@triton.jit
def _merge_splits_kernel(Partial, Lse, Out, num_splits,
                         stride_pt, stride_ph, stride_ps, stride_lt, stride_lh, stride_ot,
                         stride_oh, BLOCK_D: tl.constexpr, SPLITS_P: tl.constexpr,
                         PDL: tl.constexpr):
    wait_for_kernel_ahead(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_P)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    real = offs_s < num_splits
    lse = tl.load(Lse + token * stride_lt + head * stride_lh + offs_s, mask=real,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    weight = tl.math.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty splits weigh 0
    partial = tl.load(Partial + token * stride_pt + head * stride_ph
                      + offs_s[:, None] * stride_ps + offs_d[None, :],
                      mask=real[:, None], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(weight[:, None] * partial, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + token * stride_ot + head * stride_oh + offs_d, out.to(Out.dtype.element_ty))


def merge_splits(partial: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """partial: float32 [total_q, Hq, S, D]; lse: float32 [total_q, Hq, S]
    -> out: [total_q, Hq, D] (written in place and returned)."""
    total_q, num_heads, num_splits, head_dim = partial.shape
    if total_q == 0:
        return out
    # A program holds SPLITS_P x BLOCK_D partials in registers; MLA's 512-wide rows over 64
    # splits would be 128 KiB, so rows are merged in slices of block_d columns.
    block_d, warps = NARROW_MERGE if head_dim <= 128 else WIDE_MERGE
    block_d = min(head_dim, block_d)
    _merge_splits_kernel[(total_q, num_heads, head_dim // block_d)](
        partial, lse, out, num_splits,
        partial.stride(0), partial.stride(1), partial.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_D=block_d, SPLITS_P=next_power_of_2(num_splits), num_warps=warps,
        PDL=(pdl := pdl_for(out.device)), **launch_options(pdl))
    return out


def merge_splits_ref(partial: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """The same merge in torch (float64), for the tests."""
    lse = lse.double()
    m = lse.amax(-1, keepdim=True).nan_to_num(neginf=0.0)
    weight = torch.exp2(lse - m)
    total = weight.sum(-1, keepdim=True)
    out = (weight[..., None] * partial.double()).sum(-2)
    return out / torch.where(total == 0, torch.ones_like(total), total)


if __name__ == "__main__":
    from labkit.device import interpreter_on
    from labkit.measure.bench import measure

    device = labkit.select_device("auto")
    tokens, heads, splits, head_dim = (5, 4, 3, 64) if interpreter_on() else (64, 32, 16, 128)
    g = torch.Generator(device="cpu").manual_seed(0)
    partial = torch.randn(tokens, heads, splits, head_dim, generator=g).to(device)
    lse = torch.randn(tokens, heads, splits, generator=g).to(device)
    lse[0, 0, :] = float("-inf")  # a token whose every split saw no key
    out = merge_splits(partial, lse, torch.empty(tokens, heads, head_dim, device=device))
    torch.testing.assert_close(out.double(), merge_splits_ref(partial, lse), rtol=1e-5, atol=1e-5)
    print(f"merge_splits matches the reference on {tokens} tokens x {heads} heads, {splits} splits")
    t = measure(lambda: merge_splits(partial, lse, out), device=device, warmup=2,
                repeats=5 if interpreter_on() else 50)
    print(f"merge_splits {t}" + ("  (interpreted: says nothing of a GPU)" if interpreter_on() else ""))
    print("choose_num_splits, batch 1, 8 KV heads, 132 SMs:",
          {n: choose_num_splits(8, n, 132) for n in (1024, 8192, 32768)})
