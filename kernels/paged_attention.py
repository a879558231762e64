"""Paged attention in Triton: each sequence's new tokens attend over a KV cache held in blocks.

What you will learn: how a block table turns attention into gathers, and why decode is a
bandwidth problem. The cache is ``[num_blocks, block_size, num_kv_heads, head_dim]``; token j
of sequence b lives in physical block ``block_tables[b, j // block_size]`` at row
``j % block_size``. One program owns one KV head of one sequence (and one tile of its new
tokens), so each K/V tile is loaded ONCE for the whole group of query heads that share it (GQA,
MQA): its rows are (token, query head in the group) pairs. Decode (1 new token), speculative
verification (a few) and chunked prefill (a chunk) are the same kernel with different tile
heights, and mix freely in one batch.

Decode reads every cached byte once and does ~2 FLOPs per byte: its speed is HBM bandwidth.
With few sequences x KV heads the GPU's SMs sit idle, so the keys are split across programs
(flash-decoding) and the partial softmaxes are merged (``paged_attention_split.py``).

fp8 (e4m3) caches hold K and V with one float32 scale per KV head: the kernel folds ``k_scale``
into the score scale and multiplies the output by ``v_scale``, so the tiles are never rescaled.
Their tiles are widened to float16, not to the query's bfloat16: e4m3 -> f16 is one hardware
conversion on recent GPUs, e4m3 -> bf16 a chain of them that costs more than the bytes saved.
The query is multiplied by the softmax scale first, so it fits float16's range. fp8 tiles are
half the bytes, so each tile's memory latency weighs twice as much: the kernel loads the block
ids of the next tile one iteration ahead (``PREFETCH``), which frees the K/V loads of a
dependence inside the iteration and lets Triton pipeline them. bf16 decode uses it too, on
32-key tiles for heads 128 wide (``paged_attention_tiles.py`` gives the measured gains);
prefill chunks, whose tiles are taller, do without.

Half the bytes is not half the work. Compiled for sm90 (Triton 3.6), one 64-key iteration of
the fp8 decode loop is ~2,560 warp instructions, about what the bf16 loop spends on the same
64 keys (twice the bytes): every element is widened to float16 for the tensor cores, and V,
whose values sit key-major in the cache while P @ V sums over keys, is transposed on chip by
byte-wide shared-memory loads (16-bit tiles get one transposing ldmatrix instead). So fp8
decode is bound by the SMs' issue rate and latency, not by HBM: on an H200 it reads at a
smaller share of the copy bandwidth than bf16 does (B64, ctx 4k: ``fp8`` against ``copy_gbps``
in labkit/recorded_data/attention_backends.json). Two rewrites that issue fewer instructions
lost on an H200 (B64, ctx 4k, 7 interleaved rounds): V widened to float16 in registers before
its transpose, which then goes by ldmatrix (961 instructions a warp per iteration instead of
1,281), ran 0.86x: the extra round trip through shared memory sits on the loop's critical
path; and scores as an fp8 x fp8 product (q quantised per row) ran 1.00x, with more error.
A third lost by more: V stored transposed in each block (keys contiguous, so P @ V needs no
on-chip transpose) ran 0.41x, with P and V in fp8 as well 0.41x: with 16-token blocks a head
dimension's keys are 16 bytes, half of the 32-byte sector each load fetches.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import labkit  # noqa: F401  (before triton: interpreter on where there is no GPU)
import torch
import triton
import triton.language as tl
from labkit.kernels.grid import cdiv
from labkit.kernels.pdl import launch_options, pdl_for, wait_for_kernel_ahead
from labkit import check_positive_int
from labkit.kernels.attention_checks import (check_cache, check_cu_seqlens, check_tables,
                                             check_window, resolve_max_query_len,
                                             softmax_scale)
from labkit.kernels.paged_attention_split import (choose_num_splits, keys_per_split, merge_splits,
                                                  num_sms)
from labkit.kernels.paged_attention_tiles import check_tuning, tile_plan

@triton.jit
def paged_attention_kernel(
        Q, K_cache, V_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale, Out, Lse,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
        qk_scale, sm_scale, window, num_splits,
        GROUP: tl.constexpr, GROUP_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
        WINDOW: tl.constexpr, SCALED: tl.constexpr, SPLIT: tl.constexpr,
        PREFETCH: tl.constexpr, PDL: tl.constexpr):
    wait_for_kernel_ahead(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_row0 = tl.load(cu_seqlens_q + seq).to(tl.int64)
    len_q = (tl.load(cu_seqlens_q + seq + 1) - q_row0).to(tl.int32)
    seq_len = tl.load(seq_lens + seq)
    if q_tile * BLOCK_Q >= len_q:
        return

    # Rows are (new token, query head of this kv head's group) pairs; GROUP_P pads the group to
    # a power of two, and the padding rows are masked.
    offs_r = tl.arange(0, BLOCK_Q * GROUP_P)
    token = q_tile * BLOCK_Q + offs_r // GROUP_P
    head = kv_head * GROUP + offs_r % GROUP_P
    row_ok = (token < len_q) & (offs_r % GROUP_P < GROUP)
    pos = seq_len - len_q + token  # where each new token sits in its sequence
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + (q_row0 + token)[:, None] * stride_qt + head[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if SCALED:  # fp8 tiles are widened to float16 (one conversion); q joins them, pre-scaled
        q = (q.to(tl.float32) * sm_scale).to(tl.float16)

    lo = 0
    hi = seq_len
    if CAUSAL:  # nothing after this tile's last token
        hi = tl.maximum(seq_len - len_q + tl.minimum((q_tile + 1) * BLOCK_Q, len_q), 0)
    if WINDOW:  # nothing older than the window of this tile's first token
        lo = tl.maximum(seq_len - len_q + q_tile * BLOCK_Q - window + 1, 0)
    if SPLIT:
        # This sequence's keys dealt evenly over the splits from its own length, read on the
        # device: a graph planned for the longest context still spreads a short one over every
        # split instead of leaving it all to the first.
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        lo = tl.maximum(lo, split * per_split)
        hi = tl.minimum(hi, (split + 1) * per_split)
    lo = lo // BLOCK_N * BLOCK_N
    if SCALED:  # fp8: dequantising K is one multiply on the scores (sm_scale is already in q)
        qk_scale = qk_scale / sm_scale * tl.load(k_scale + kv_head)

    table = block_tables + seq.to(tl.int64) * stride_bt
    K_head = K_cache + kv_head * stride_kh  # K and V share one layout, so one offset serves both
    V_head = V_cache + kv_head * stride_kh
    m_i = tl.full([BLOCK_Q * GROUP_P], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_DIM], tl.float32)
    if PREFETCH:  # the first tile's block ids; each iteration then loads the next tile's
        block_next = tl.load(table + (lo + offs_n) // BLOCK_SIZE, mask=lo + offs_n < hi,
                             other=0).to(tl.int64)
    for n in range(lo, hi, BLOCK_N):
        keys = n + offs_n
        in_range = keys < hi
        # The paging: logical key -> physical block -> row inside it.
        if PREFETCH:
            # Block ids one tile ahead: this tile's K/V addresses no longer wait on a load made
            # in the same iteration, so the compiler can pipeline the K/V loads across tiles.
            block = block_next
            ahead = keys + BLOCK_N
            block_next = tl.load(table + ahead // BLOCK_SIZE, mask=ahead < hi,
                                 other=0).to(tl.int64)
        else:
            block = tl.load(table + keys // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        where = block * stride_kb + (keys % BLOCK_SIZE) * stride_ks
        k = tl.load(K_head + where[None, :] + offs_d[:, None], mask=in_range[None, :], other=0.0)
        v = tl.load(V_head + where[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0)
        s = tl.dot(q, k.to(q.dtype))  # [rows, BLOCK_N]
        ok = in_range[None, :]
        if CAUSAL:
            ok = ok & (keys[None, :] <= pos[:, None])
        if WINDOW:
            ok = ok & (keys[None, :] > pos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2 domain, as in flash_attention
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
        m_i = m_new
    if SCALED:
        acc = acc * tl.load(v_scale + kv_head)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    rows = (q_row0 + token)[:, None]
    if SPLIT:  # a partial result and its log-sum-exp, merged by paged_attention_split
        o_ptrs = Out + rows * stride_ot + head[:, None] * stride_oh + split * stride_os
        tl.store(o_ptrs + offs_d[None, :], out, mask=row_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.maximum(l_i, 1e-30)))
        tl.store(Lse + (q_row0 + token) * stride_lt + head * stride_lh + split, lse, mask=row_ok)
    else:
        o_ptrs = Out + rows * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------
# Host side: the input checks (attention_checks.py), the tile plan (paged_attention_tiles.py),
# then the launch.

@functools.lru_cache(maxsize=None)
def _unused_scale(device) -> torch.Tensor:
    """What the scale pointers get when the cache is not fp8 (never read): one per device."""
    return torch.empty(1, dtype=torch.float32, device=device)


def paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, *,
                    causal: bool = True, window: int | None = None, scale: float | None = None,
                    k_scale=None, v_scale=None, num_splits: int | None = None,
                    max_query_len: int | None = None, check: bool = True,
                    tuning: dict | None = None):
    """q: [total_q, Hq, D] new tokens; k/v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: int32 [batch, max_blocks]; cu_seqlens_q: int32 [batch+1]; seq_lens: int32
    [batch] -> [total_q, Hq, D].

    ``num_splits`` forces the split-KV path (>1) or turns it off (1); None chooses by occupancy.
    ``check=False`` skips the checks that read the metadata (two host syncs); with
    ``max_query_len`` given as well the call never waits for the GPU, as an engine that built the
    metadata itself, or a CUDA Graph capture, needs. ``tuning`` overrides block_n, num_warps,
    num_stages, prefetch (block ids one tile ahead; default on for fp8 caches) and maxnreg
    (registers per thread; default: the compiler's choice).
    """
    fp8 = check_cache(q, k_cache, v_cache, k_scale, v_scale)
    check_window(causal, window)
    check_tuning(tuning)
    longest_q = check_cu_seqlens(cu_seqlens_q, q.shape[0], "cu_seqlens_q", q.device, check)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    max_seq_len = check_tables(block_tables, seq_lens, cu_seqlens_q, num_blocks, block_size,
                                q.device, check)
    if max_seq_len is None:  # unchecked: plan for the longest sequence the table can hold
        max_seq_len = block_tables.shape[1] * block_size
    max_query_len = resolve_max_query_len(max_query_len, longest_q, cu_seqlens_q, q.shape[0],
                                          "max_query_len", "new tokens")
    if num_splits is not None:  # a host int: checked on every call, before any work
        check_positive_int("num_splits", num_splits, hint="or None to choose")
    if q.shape[0] == 0 or max_query_len == 0:
        return torch.empty_like(q)
    plan = plan_paged_attention(fp8, q.shape[1], k_cache.shape, block_tables.shape[0],
                                max_seq_len, max_query_len, q.device, causal=causal,
                                window=window, scale=scale, num_splits=num_splits, tuning=tuning)
    return plan.run(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale, v_scale)


@dataclass(frozen=True)
class PagedAttentionPlan:
    """What one batch's launches share: the tile constants, the grid, the KV split. An engine
    plans once per step and runs the plan in every layer (only the caches and q change), so a
    layer pays for the launch and nothing else."""
    consts: dict
    launch: dict
    grid: tuple[int, int, int]
    num_splits: int
    # The most keys one split reads: the longest sequence's share (each sequence's own share is
    # dealt on the device from its length), which decides whether a program reads one tile.
    keys_per_split: int
    scale: float
    window: int | None
    head_dim: int
    block_size: int
    empty: bool  # no new token: nothing to launch

    def workspace(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The split path's float32 partial outputs and log-sum-exps for ``q``'s rows (None
        without a split). Layers run one after another on one stream, so an engine allocates
        this once per step and hands it to every layer's ``run``: two allocations a layer fewer
        (each is host time an eager step pays)."""
        if self.num_splits <= 1:
            return None
        rows, heads = q.shape[0], q.shape[1]
        return (torch.empty(rows, heads, self.num_splits, self.head_dim, dtype=torch.float32,
                            device=q.device),
                torch.empty(rows, heads, self.num_splits, dtype=torch.float32, device=q.device))

    def run(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, k_scale=None,
            v_scale=None, out=None, workspace=None):
        """The launch: q [total_q, Hq, D] -> ``out`` (allocated when None), [total_q, Hq, D].
        ``workspace``: from :meth:`workspace` for the same rows (allocated here when None)."""
        out = torch.empty_like(q) if out is None else out
        if self.empty or q.shape[0] == 0:
            return out
        split = self.num_splits > 1
        if split:
            partial, lse = workspace if workspace is not None else self.workspace(q)
            if partial.shape[:2] != q.shape[:2]:
                raise ValueError(f"workspace is for {tuple(partial.shape[:2])} (rows, heads), q "
                                 f"is {tuple(q.shape[:2])}: make it with plan.workspace(q)")
            dest, lse_strides = partial, (lse.stride(0), lse.stride(1))
        else:
            dest, lse, lse_strides = out, out, (0, 0)
        scaled = self.consts["SCALED"]
        dummy = _unused_scale(q.device)
        paged_attention_kernel[self.grid](
            q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens,
            k_scale if scaled else dummy, v_scale if scaled else dummy, dest, lse,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0),
            dest.stride(0), dest.stride(1), dest.stride(2) if split else 0, *lse_strides,
            self.scale * LOG2_E, self.scale, self.window or 0, self.num_splits,
            HEAD_DIM=self.head_dim, BLOCK_SIZE=self.block_size,
            WINDOW=self.window is not None, SPLIT=split, PDL=(pdl := pdl_for(q.device)),
            **self.consts, **self.launch, **launch_options(pdl))
        if split:
            merge_splits(partial, lse, out)
        return out


LOG2_E = math.log2(math.e)


def plan_paged_attention(fp8: bool, num_q_heads: int, cache_shape, batch: int, max_seq_len: int,
                         max_query_len: int, device, *, causal: bool = True,
                         window: int | None = None, scale: float | None = None,
                         num_splits: int | None = None, tuning: dict | None = None
                         ) -> PagedAttentionPlan:
    """The plan for a batch of ``batch`` sequences, the longest ``max_seq_len`` tokens with
    ``max_query_len`` new ones, over caches of ``cache_shape`` (num_blocks, block_size, Hkv,
    D). ``paged_attention`` checks its inputs and then plans; a caller that plans itself (once
    per engine step) has checked them already."""
    _, block_size, num_kv_heads, head_dim = cache_shape
    consts, launch = tile_plan(fp8, head_dim, num_q_heads // num_kv_heads, max_query_len,
                               causal, tuning)
    q_tiles = cdiv(max_query_len, consts["BLOCK_Q"])
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads * q_tiles, max_seq_len,
                                       num_sms(torch.device(device)))
    check_positive_int("num_splits", num_splits, hint="or None to choose")
    block_n = consts["BLOCK_N"]
    share = keys_per_split(max_seq_len, num_splits, block_n)
    if share <= block_n:  # one key tile a program: the four-warp tile (tile_plan)
        consts, launch = tile_plan(fp8, head_dim, num_q_heads // num_kv_heads, max_query_len,
                                   causal, tuning, one_tile=True)
    return PagedAttentionPlan(consts, launch, (batch, num_kv_heads, q_tiles * num_splits),
                              num_splits, share, softmax_scale(scale, head_dim), window,
                              head_dim, block_size, empty=batch == 0 or max_query_len == 0)

if __name__ == "__main__":
    from labkit.attention.reference import paged_attention_ref
    from labkit.measure.bench import gbps, measure

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    block_size, lens_q, seq_lens = 16, [1, 4, 0, 19], [70, 33, 5, 40]  # decode, verify, idle, chunk
    table = torch.randperm(40, device=dev)[:20].reshape(4, 5).int()
    k_cache, v_cache = (torch.randn(40, block_size, 2, 64, device=dev, dtype=dtype)
                        for _ in range(2))
    q = torch.randn(sum(lens_q), 8, 64, device=dev, dtype=dtype)
    cu = torch.tensor([0, 1, 5, 5, 24], dtype=torch.int32, device=dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    for splits in (1, 3):
        err = (paged_attention(q, k_cache, v_cache, table, cu, lens, num_splits=splits).double()
               - paged_attention_ref(q, k_cache, v_cache, table, cu, lens)).abs().max().item()
        print(f"mixed batch {lens_q} new tokens over {seq_lens}, {splits} split(s): "
              f"max abs error vs float64 {err:.2e}")
        assert err < (2e-2 if dtype == torch.bfloat16 else 1e-5), "paged_attention is wrong"
    if dev == "cuda":
        B, ctx = 64, 4096
        table = torch.randperm(B * ctx // 16, device=dev).reshape(B, -1).int()
        k_cache, v_cache = (torch.randn(B * ctx // 16, 16, 8, 128, device=dev, dtype=dtype)
                            for _ in range(2))
        q = torch.randn(B, 32, 128, device=dev, dtype=dtype)
        cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        t = measure(lambda: paged_attention(q, k_cache, v_cache, table, cu, lens,
                                            max_query_len=1, check=False), device=dev)
        print(f"decode B{B} GQA 32/8 ctx {ctx}: {t}, "
              f"{gbps(2 * k_cache.numel() * k_cache.element_size(), t):.0f} GB/s of KV")
