"""Paged MLA attention in Triton: every query head reads one shared latent per cached token.

What you will learn: why DeepSeek's multi-head latent attention (MLA) is MQA-like once its
up-projections are absorbed, and what that makes of a decode kernel. Per token and layer the
cache holds one row of ``kv_lora_rank + qk_rope_head_dim`` values (512 + 64 = 576 in
DeepSeek-V2/V3): the compressed ``c_kv``, then the rotary key ``k_pe``, shared by all heads.
Head h's key is ``[W_UK_h c_kv ; k_pe]`` and its value ``W_UV_h c_kv``. Multiplying ``W_UK_h``
into the query once (``q_latent_h = q_nope_h W_UK_h``, done by the caller) and ``W_UV_h`` into
the output afterwards leaves attention over the latent itself:

    score_h(i, j) = (q_latent_h[i] . c_kv[j] + q_rope_h[i] . k_pe[j]) * scale
    out_h[i]      = sum_j softmax_j(score_h(i, :)) c_kv[j]            ([kv_lora_rank] wide)

So the cache is a single "KV head" 576 wide, read by every query head, and the value is the
key's first ``kv_lora_rank`` columns. A program owns one sequence, a group of ``HEADS`` query
heads and a tile of new tokens; its rows are (token, head) pairs, as in ``paged_attention``'s
GQA groups. Each latent tile is loaded once for the whole group and used twice: as keys (with
``k_pe``) and as values. Decode reads every cached byte once per head group, so the larger the
group the closer it runs to the copy bandwidth, until the accumulator (rows x kv_lora_rank
float32) no longer fits in registers. Long contexts with few sequences are split across
programs and merged exactly as ``paged_attention`` does (``paged_attention_split.py``); each
sequence's keys are dealt over the splits from its own length, read on the device. On Hopper the
kernel launches as a programmatic dependent (``pdl.py``), so the merge behind it starts as it
drains.

Which side of the matrix multiply the rows sit on matters on Hopper. Its warpgroup MMA
(wgmma) takes at least 64 rows on the M side; with 16 heads a program has 16 rows, so
``S = Q C_kv^T`` runs on the older per-warp MMA, each warp holding the whole query. With
``KEYS_ON_M`` the kernel computes the same tile transposed, ``S^T = C_kv Q^T`` and
``O^T = C_kv^T P^T``: the 64-key tile and the 512-wide rank are the M side, the rows the N side
(16 is enough there), and the softmax runs down the columns. ``plan_mla`` picks it for decode
programs of fewer than 64 rows, where it measured faster on an H200
(``benchmarks/mla_decode.py``); with 64 heads a program the rows fill M and the plain
orientation stays.

How the tiles arrive matters less. With blocks of 64 tokens a 64-key tile is one contiguous
72 KiB run of the cache, which the Tensor Memory Accelerator (TMA) can copy by descriptor
instead of the threads computing an address per 16 bytes. A keys-on-M variant loading c_kv in
two 256-wide boxes and k_pe in one (TMA boxes are at most 256 wide) ran 0.997x (0.99-1.01) at
batch 64 with 16 heads and 1.03x (1.03-1.05) at batch 1 over 32k tokens on an H200 (5
interleaved rounds): address generation is not what holds this loop back, so the pointer
loads stay.

Masking is ``paged_attention``'s: a sequence's new tokens are the last ``len_q`` of its
``seq_lens`` tokens, and with ``causal`` token i sees keys up to its own position.
The reference is ``paged_mla_attention_ref`` in ``labkit/attention/reference.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import labkit  # noqa: F401  (before triton: interpreter on where there is no GPU)
import torch
import triton
import triton.language as tl
from labkit import check_positive_int
from labkit.device import interpreter_on
from labkit.kernels.attention_checks import (check_cu_seqlens, check_flag, check_mla_inputs,
                                             check_tables, resolve_max_query_len, softmax_scale)
from labkit.kernels.grid import cdiv, next_power_of_2
from labkit.kernels.paged_attention_split import (MAX_SPLITS, WAVES, choose_num_splits,
                                                   keys_per_split, merge_splits, num_sms)
from labkit.kernels.pdl import launch_options, pdl_for, wait_for_kernel_ahead

LOG2_E = 1.4426950408889634
SHARED_MEMORY_BYTES = 227 * 1024  # the most one block may have on an H100 or H200
MLA_MAX_SPLITS = 128  # batch 1 at 32k with 16 heads: 128 splits of 256 keys beat 64 on an H200


@triton.jit
def paged_mla_kernel(
        QL, QR, Cache, block_tables, cu_seqlens_q, seq_lens, Out, Lse,
        stride_qlt, stride_qlh, stride_qrt, stride_qrh, stride_cb, stride_cs, stride_bt,
        stride_ot, stride_oh, stride_os, stride_lt, stride_lh,
        num_heads, qk_scale, num_splits,
        HEADS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, RANK: tl.constexpr,
        ROPE: tl.constexpr, BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
        SPLIT: tl.constexpr, PRECISION: tl.constexpr, KEYS_ON_M: tl.constexpr,
        PAGE_TILE: tl.constexpr, PDL: tl.constexpr):
    wait_for_kernel_ahead(PDL)
    seq = tl.program_id(0)
    head_group = tl.program_id(1)
    q_tile = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_row0 = tl.load(cu_seqlens_q + seq).to(tl.int64)
    len_q = (tl.load(cu_seqlens_q + seq + 1) - q_row0).to(tl.int32)
    seq_len = tl.load(seq_lens + seq)
    if q_tile * BLOCK_Q >= len_q:
        return

    # Rows are (new token, query head of this group) pairs; heads past num_heads are masked.
    offs_r = tl.arange(0, BLOCK_Q * HEADS)
    token = q_tile * BLOCK_Q + offs_r // HEADS
    head = head_group * HEADS + offs_r % HEADS
    row_ok = (token < len_q) & (head < num_heads)
    pos = seq_len - len_q + token  # where each new token sits in its sequence
    offs_n = tl.arange(0, BLOCK_N)
    offs_c = tl.arange(0, RANK)
    offs_p = tl.arange(0, ROPE)
    q_rows = (q_row0 + token)[:, None]
    q_lat = tl.load(QL + q_rows * stride_qlt + head[:, None] * stride_qlh + offs_c[None, :],
                    mask=row_ok[:, None], other=0.0)
    q_pe = tl.load(QR + q_rows * stride_qrt + head[:, None] * stride_qrh + offs_p[None, :],
                   mask=row_ok[:, None], other=0.0)

    lo = 0
    hi = seq_len
    if CAUSAL:  # nothing after this tile's last token
        hi = tl.maximum(seq_len - len_q + tl.minimum((q_tile + 1) * BLOCK_Q, len_q), 0)
    if SPLIT:  # this sequence's keys dealt over the splits from its own length, on the device
        per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        lo = tl.maximum(lo, split * per_split)
        hi = tl.minimum(hi, (split + 1) * per_split)

    table = block_tables + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_Q * HEADS], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * HEADS], tl.float32)
    if KEYS_ON_M:  # the tiles below are transposed: [keys, rows] scores, [RANK, rows] output
        q_lat, q_pe = tl.trans(q_lat), tl.trans(q_pe)
        acc = tl.zeros([RANK, BLOCK_Q * HEADS], tl.float32)
    else:
        acc = tl.zeros([BLOCK_Q * HEADS, RANK], tl.float32)
    for n in range(lo, hi, BLOCK_N):
        keys = n + offs_n
        in_range = keys < hi
        if PAGE_TILE:  # the tile lies inside one cache block: one table read for all its keys
            block = tl.load(table + n // BLOCK_SIZE).to(tl.int64)
            latent = Cache + block * stride_cb + ((n % BLOCK_SIZE) + offs_n)[:, None] * stride_cs
        else:
            block = tl.load(table + keys // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
            latent = Cache + (block * stride_cb + (keys % BLOCK_SIZE) * stride_cs)[:, None]
        c_kv = tl.load(latent + offs_c[None, :], mask=in_range[:, None], other=0.0)  # [N, RANK]
        k_pe = tl.load(latent + RANK + offs_p[None, :], mask=in_range[:, None], other=0.0)
        # one tile, two uses: c_kv is the key's latent part here and the value below
        if KEYS_ON_M:  # S^T = C_kv Q^T: the key tile is the MMA's M side, the rows its N
            s = tl.dot(c_kv, q_lat, input_precision=PRECISION) + \
                tl.dot(k_pe, q_pe, input_precision=PRECISION)  # [N, rows]
            ok = in_range[:, None]
            if CAUSAL:
                ok = ok & (keys[:, None] <= pos[None, :])
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0) * qk_scale)
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s * qk_scale - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            acc = tl.dot(tl.trans(c_kv), p.to(c_kv.dtype), acc * alpha[None, :],
                         input_precision=PRECISION)  # O^T = C_kv^T P^T: [RANK, rows]
        else:
            s = tl.dot(q_lat, tl.trans(c_kv), input_precision=PRECISION) + \
                tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)  # [rows, N]
            ok = in_range[None, :]
            if CAUSAL:
                ok = ok & (keys[None, :] <= pos[:, None])
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # log2 domain, as flash_attention
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(c_kv.dtype), c_kv, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new

    if KEYS_ON_M:
        acc = tl.trans(acc)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    rows = (q_row0 + token)[:, None]
    if SPLIT:  # a partial result and its log-sum-exp, merged by paged_attention_split
        o_ptrs = Out + rows * stride_ot + head[:, None] * stride_oh + split * stride_os
        tl.store(o_ptrs + offs_c[None, :], out, mask=row_ok[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.maximum(l_i, 1e-30)))
        tl.store(Lse + (q_row0 + token) * stride_lt + head * stride_lh + split, lse, mask=row_ok)
    else:
        o_ptrs = Out + rows * stride_ot + head[:, None] * stride_oh + offs_c[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


# ---------------------------------------------------------------------------------------------
# Host side: the tile plan and the launch (the input checks: attention_checks.check_mla_inputs).

@dataclass(frozen=True)
class MLAPlan:
    """What one batch's launches share (tile constants, grid, KV split): an engine plans once per
    step and runs the plan in every layer."""
    consts: dict
    launch: dict
    grid: tuple[int, int, int]
    num_splits: int
    # The most keys one split reads (the longest sequence's share); each sequence's own share is
    # dealt on the device from its length, so a graph planned for the longest context still
    # spreads a short one over every split.
    keys_per_split: int
    scale: float
    block_size: int

    @property
    def page_tile(self) -> bool:
        """Whether each key tile reads its block id once: tiles inside one block, keys on M (with
        rows on M the per-key ids measured faster on an H200: batch 64 at 4k, 128 heads, 316
        against 384 us)."""
        return self.consts["KEYS_ON_M"] and self.block_size % self.consts["BLOCK_N"] == 0

    def run(self, q_latent, q_rope, latent_cache, block_tables, cu_seqlens_q, seq_lens,
            out=None):
        """The launch: -> ``out`` [total_q, num_heads, kv_lora_rank] (allocated when None)."""
        out = torch.empty_like(q_latent) if out is None else out
        total_q, num_heads, rank = q_latent.shape
        if total_q == 0 or self.grid[0] == 0:
            return out
        split = self.num_splits > 1
        if split:
            dest = torch.empty(total_q, num_heads, self.num_splits, rank, dtype=torch.float32,
                               device=q_latent.device)
            lse = torch.empty(total_q, num_heads, self.num_splits, dtype=torch.float32,
                              device=q_latent.device)
            lse_strides = (lse.stride(0), lse.stride(1))
        else:
            dest, lse, lse_strides = out, out, (0, 0)
        paged_mla_kernel[self.grid](
            q_latent, q_rope, latent_cache, block_tables, cu_seqlens_q, seq_lens, dest, lse,
            q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
            latent_cache.stride(0), latent_cache.stride(1), block_tables.stride(0),
            dest.stride(0), dest.stride(1), dest.stride(2) if split else 0, *lse_strides,
            num_heads, self.scale * LOG2_E, self.num_splits,
            RANK=rank, ROPE=q_rope.shape[2], BLOCK_SIZE=self.block_size, SPLIT=split,
            PAGE_TILE=self.page_tile, PDL=(pdl := pdl_for(q_latent.device)), **self.consts,
            **self.launch, **launch_options(pdl))
        if split:
            merge_splits(dest, lse, out)
        return out


def shared_memory_bytes(rows: int, block_n: int, width: int, element_size: int) -> int:
    """The shared memory a program of ``rows`` (token, head) rows over ``block_n``-key tiles of
    ``width``-wide latent rows asks for, at most: its query tile, two latent tiles (the one in
    use and the next one loading), its probabilities, and 1 KiB of bookkeeping. What Triton 3.6
    allocates for sm_90 (an H200) is at or below this for every plan ``plan_mla`` makes at
    DeepSeek's widths, bf16 or float32 (measured by compiling each one)."""
    return element_size * (width * (rows + 2 * block_n) + rows * block_n) + 1024


def plan_mla(num_heads: int, rank: int, cache_shape, batch: int, max_seq_len: int,
             max_query_len: int, device, *, scale: float, causal: bool = True,
             num_splits: int | None = None, dtype: torch.dtype = torch.bfloat16,
             keys_on_m: bool | None = None) -> MLAPlan:
    """The tile plan for ``batch`` sequences, the longest ``max_seq_len`` tokens with
    ``max_query_len`` new ones. A program's rows are (token, head) pairs, at least the 16 that
    tl.dot needs; its accumulator is rows x kv_lora_rank float32, so rows cost registers.

    The decode choices come from ``benchmarks/mla_decode.py --sweep`` on an H200 (DeepSeek-V3's
    512 + 64 latent, bf16): with many heads, 64 per program and 8 warps, so each latent tile
    serves more heads before it leaves (batch 64 at 4k with 128 heads: 2.8x faster than 32 per
    program with 32-key tiles), unless too few programs would run, where 32 per program with
    more splits wins; programs that heavy want about one per SM, not ``WAVES``. Decode programs
    of fewer than 64 rows run ``KEYS_ON_M`` (``keys_on_m`` forces either orientation) over
    64-key tiles with 4 warps and 2 stages, split to about one program per SM, up to
    ``MLA_MAX_SPLITS``: measured against the plain orientation's best plans on an H200, batch
    64 at 4k with 16 heads 1.07x and batch 1 at 32k 1.46x (16 heads) and 1.27x (128 heads, 32
    per program). With 64 heads a program the plain orientation stays (keys on M measured
    0.77x there).

    Those tiles are bf16's. ``dtype`` (the cache's) with wider elements halves the key tile
    until ``shared_memory_bytes`` fits a block's ``SHARED_MEMORY_BYTES``; a float32 plan's dots
    are IEEE float32, not TF32, so its scores are the ones torch computes."""
    interp = interpreter_on()
    sms = num_sms(torch.device(device))
    decode = max_query_len <= 1 and not interp
    if decode:
        heads = 64 if num_heads >= 64 and batch * cdiv(num_heads, 64) >= sms // 2 else \
            (32 if num_heads >= 32 else 16)
        block_q = 1
    else:  # chunks and verify tokens: rows shared by tokens and heads, 32 at most
        row_cap = 16 if interp else (32 if rank <= 512 else 16)
        heads = min(next_power_of_2(num_heads), row_cap)
        block_q = min(next_power_of_2(max(max_query_len, 1)), max(1, row_cap // heads))
        if block_q == 1:  # the rows are the group's heads, padded to the 16 tl.dot wants
            heads = max(heads, 16)
        block_q = max(block_q, 16 // heads)
    rows = block_q * heads
    head_groups = cdiv(num_heads, heads)
    q_tiles = cdiv(max(max_query_len, 1), block_q)
    programs = batch * head_groups * q_tiles
    if keys_on_m is None:
        keys_on_m = max_query_len <= 1 and rows < 64
    check_flag("keys_on_m", keys_on_m)
    if num_splits is None:
        heavy = decode and (rows >= 32 or keys_on_m)
        num_splits = choose_num_splits(programs, max_seq_len, sms, waves=1 if heavy else WAVES,
                                       max_splits=MLA_MAX_SPLITS if keys_on_m else MAX_SPLITS)
    check_positive_int("num_splits", num_splits, hint="or None to choose")
    if interp:
        block_n, launch = 16, {"num_warps": 4, "num_stages": 2}
    elif decode and keys_on_m:
        block_n, launch = 64, {"num_warps": 4, "num_stages": 2}
    elif rows >= 32 or (decode and programs * num_splits <= sms):
        block_n, launch = 64, {"num_warps": 8, "num_stages": 3 if rows >= 64 else 2}
    else:
        block_n, launch = 32, {"num_warps": 4, "num_stages": 2}
    element_size = torch.empty((), dtype=dtype).element_size()
    while not interp and block_n > 16 and shared_memory_bytes(
            rows, block_n, cache_shape[2], element_size) > SHARED_MEMORY_BYTES:
        block_n //= 2
    share = keys_per_split(max_seq_len, num_splits, block_n)
    consts = {"HEADS": heads, "BLOCK_Q": block_q, "BLOCK_N": block_n, "CAUSAL": bool(causal),
              "PRECISION": "ieee" if dtype == torch.float32 else "tf32",  # 16-bit: unused
              "KEYS_ON_M": bool(keys_on_m)}
    grid = (batch if max_query_len > 0 else 0, head_groups, q_tiles * num_splits)
    return MLAPlan(consts, launch, grid, num_splits, share, scale, cache_shape[1])


def paged_mla_attention(q_latent, q_rope, latent_cache, block_tables, cu_seqlens_q, seq_lens,
                        *, scale: float, causal: bool = True, check: bool = True,
                        num_splits: int | None = None, max_query_len: int | None = None,
                        out=None):
    """q_latent: [total_q, num_heads, kv_lora_rank] (q_nope already multiplied by W_UK);
    q_rope: [total_q, num_heads, qk_rope_head_dim]; latent_cache: [num_blocks, block_size,
    kv_lora_rank + qk_rope_head_dim] (c_kv then k_pe); block_tables: int32 [batch, max_blocks];
    cu_seqlens_q: int32 [batch + 1]; seq_lens: int32 [batch] -> [total_q, num_heads,
    kv_lora_rank], still to be multiplied by W_UV.

    ``scale`` is the model's softmax scale (DeepSeek: 1/sqrt(qk_nope_head_dim +
    qk_rope_head_dim), not anything of the latent's width), so it has no default.
    ``num_splits`` forces the split-KV path (>1) or turns it off (1); None chooses by occupancy.
    ``check=False`` skips the checks that read the metadata (host syncs); with ``max_query_len``
    given as well the call never waits for the GPU, as CUDA Graph capture needs. ``out``
    receives the result (a static buffer under capture).
    """
    rank, _ = check_mla_inputs(q_latent, q_rope, latent_cache, out)
    check_flag("causal", causal)
    check_flag("check", check)
    if scale is None:
        raise ValueError("scale must be given: MLA's softmax scale comes from the model "
                         "(1/sqrt(qk_nope_head_dim + qk_rope_head_dim)), not from the latent")
    scale = softmax_scale(scale, rank)
    total_q = q_latent.shape[0]
    longest_q = check_cu_seqlens(cu_seqlens_q, total_q, "cu_seqlens_q", q_latent.device, check)
    num_blocks, block_size, _ = latent_cache.shape
    max_seq_len = check_tables(block_tables, seq_lens, cu_seqlens_q, num_blocks, block_size,
                               q_latent.device, check)
    if max_seq_len is None:  # unchecked: plan for the longest sequence the table can hold
        max_seq_len = block_tables.shape[1] * block_size
    max_query_len = resolve_max_query_len(max_query_len, longest_q, cu_seqlens_q, total_q,
                                          "max_query_len", "new tokens")
    if num_splits is not None:
        check_positive_int("num_splits", num_splits, hint="or None to choose")
    if out is None:
        out = torch.empty_like(q_latent)
    if total_q == 0 or max_query_len == 0:
        return out
    plan = plan_mla(q_latent.shape[1], rank, latent_cache.shape, block_tables.shape[0],
                    max_seq_len, max_query_len, q_latent.device, scale=scale, causal=causal,
                    num_splits=num_splits, dtype=q_latent.dtype)
    return plan.run(q_latent, q_rope, latent_cache, block_tables, cu_seqlens_q, seq_lens, out)


if __name__ == "__main__":
    from labkit.attention.reference import paged_mla_attention_ref
    from labkit.measure.bench import gbps, measure

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    rank, rope, heads, block_size = (512, 64, 16, 64) if dev == "cuda" else (32, 16, 4, 16)
    lens_q, seq_lens = [1, 3, 0, 21], [70, 33, 5, 40]  # decode, verify, idle, chunk
    g = torch.Generator(device="cpu").manual_seed(0)
    cache = torch.randn(24, block_size, rank + rope, generator=g).to(dev, dtype)
    table = torch.randperm(24, generator=g)[:20].reshape(4, 5).int().to(dev)
    ql = torch.randn(sum(lens_q), heads, rank, generator=g).to(dev, dtype)
    qr = torch.randn(sum(lens_q), heads, rope, generator=g).to(dev, dtype)
    cu = torch.tensor([0, 1, 4, 4, 25], dtype=torch.int32, device=dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    scale = (128 + 64) ** -0.5
    ref = paged_mla_attention_ref(ql, qr, cache, table, cu, lens, scale=scale)
    for splits in (1, 3):
        out = paged_mla_attention(ql, qr, cache, table, cu, lens, scale=scale, num_splits=splits)
        err = (out.double() - ref).abs().max().item()
        print(f"mixed batch {lens_q} new tokens over {seq_lens}, {splits} split(s): "
              f"max abs error vs float64 {err:.2e}")
        assert err < (3e-2 if dtype == torch.bfloat16 else 1e-4), "paged_mla_attention is wrong"
    if dev == "cuda":
        B, ctx = 64, 4096
        cache = torch.randn(B * ctx // block_size, block_size, rank + rope, device=dev,
                            dtype=dtype)
        table = torch.randperm(B * ctx // block_size, device=dev).reshape(B, -1).int()
        ql = torch.randn(B, heads, rank, device=dev, dtype=dtype)
        qr = torch.randn(B, heads, rope, device=dev, dtype=dtype)
        cu = torch.arange(B + 1, dtype=torch.int32, device=dev)
        lens = torch.full((B,), ctx, dtype=torch.int32, device=dev)
        t = measure(lambda: paged_mla_attention(ql, qr, cache, table, cu, lens, scale=scale,
                                                max_query_len=1, check=False), device=dev)
        print(f"MLA decode B{B} {heads} heads ctx {ctx}: {t}, "
              f"{gbps(cache.numel() * cache.element_size(), t):.0f} GB/s of latent cache")
