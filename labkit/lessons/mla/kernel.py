"""paged_mla_attention checked on a mixed batch and its tile loop as the file has it (notebook
10, section 3), and the two ways to prefill that benchmarks/mla_prefill.py times: the engine's
own (``labkit.engine.mla_prefill``), which sends a prefill down the faster one."""
from __future__ import annotations

import math

import torch

from labkit.lessons.mla.shapes import BLOCK, RANK, ROPE, SCALE
from labkit.teaching import claim


def kernel_check(device: torch.device, seed: int = 0) -> dict:
    """paged_mla_attention on one batch mixing a decode, 3 verify tokens, an idle sequence and a
    21-token chunk, against ``paged_mla_attention_ref`` (float64): DeepSeek's widths in bf16 on
    a GPU, small widths in float32 under the interpreter."""
    from labkit.attention import paged_mla_attention, paged_mla_attention_ref
    gpu = device.type == "cuda"
    rank, rope, heads, block, dtype, tol = ((RANK, ROPE, 16, BLOCK, torch.bfloat16, 1e-2) if gpu
                                            else (32, 16, 4, 16, torch.float32, 1e-4))
    lens_q, seq_lens = [1, 3, 0, 21], [70, 33, 5, 40]
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks = max(math.ceil(n / block) for n in seq_lens)
    cache = torch.randn(len(seq_lens) * blocks + 2, block, rank + rope, generator=g)
    table = torch.randperm(cache.shape[0], generator=g)[: len(seq_lens) * blocks]
    ql = torch.randn(sum(lens_q), heads, rank, generator=g)
    qr = torch.randn(sum(lens_q), heads, rope, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    args = [t.to(device, dtype) for t in (ql, qr, cache)] + [
        table.reshape(len(seq_lens), blocks).int().to(device), cu.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device)]
    out = paged_mla_attention(*args, scale=SCALE).double()
    ref = paged_mla_attention_ref(*args, scale=SCALE)
    err = float((out - ref).abs().max() / ref.abs().max())
    return {"rel_err": err, "tol": tol, "dtype": str(dtype).replace("torch.", ""),
            "rank": rank, "rope": rope, "heads": heads, "lens_q": lens_q, "seq_lens": seq_lens}


def kernel_claim(check: dict):
    return claim("paged_mla_attention matches its float64 definition on one batch holding a "
                 "decode, {verify} verify tokens, an idle sequence and a {chunk}-token chunk: "
                 "relative error {err:.1e}, under {tol:.0e} ({dtype}, latent {rank} + rope "
                 "{rope}, {heads} heads).", check["rel_err"] < check["tol"],
                 verify=check["lens_q"][1], chunk=check["lens_q"][3], err=check["rel_err"],
                 tol=check["tol"], dtype=check["dtype"], rank=check["rank"], rope=check["rope"],
                 heads=check["heads"])


def kernel_loop_source() -> str:
    """The tile loop of ``paged_mla_kernel``, as the kernel file has it."""
    import inspect
    from labkit.kernels.paged_mla_attention import paged_mla_kernel
    lines = inspect.getsource(paged_mla_kernel.fn).splitlines()
    first = next(i for i, line in enumerate(lines) if "for n in range(lo, hi, BLOCK_N)" in line)
    last = next(i for i in range(first, len(lines)) if "m_i = m_new" in lines[i])
    return "\n".join(line[4:] for line in lines[first:last + 1])


def prefill_paths(attention, q_nope, q_pe, latent_cache, block_tables, seq_len: int):
    """Two ways to attend one sequence's ``seq_len``-token prefill (causal) over its paged latent
    rows, each ending in the per-head outputs [T, H, v_head_dim] that ``o_proj`` takes, each the
    engine's own code for its rows (``labkit.engine.mla_prefill``):

    - ``absorbed``: W_UK folded into the query, ``paged_mla_attention`` over the latent rows
      (every (query, key) pair costs rank + rope for the score and rank for the value), then W_UV;
    - ``decompressed``: the rows gathered and up-projected into per-head keys (nope + rope) and
      values (v_head_dim), then ``flash_attention`` (per pair nope + rope and v_head_dim, padded
      to the power of two the kernel takes: 192 and 128 become 256 at DeepSeek's shape).

    Returns {name: a function of no arguments -> [T, H, v_head_dim]}."""
    from labkit.attention import paged_mla_attention
    from labkit.engine.mla_prefill import (absorbed_attention, context_slots,
                                           decompressed_attention)
    dev = q_nope.device
    q = torch.cat([q_nope, q_pe], dim=-1)
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device=dev)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=dev)
    slots, cu_k = context_slots(block_tables, [0], [seq_len], latent_cache.shape[1])

    def absorbed():
        return absorbed_attention(attention, paged_mla_attention, q, latent_cache, block_tables,
                                  cu, lens, seq_len)

    def decompressed():
        k, v = attention.decompress(
            latent_cache.view(-1, latent_cache.shape[-1]).index_select(0, slots))
        return decompressed_attention(attention, q, k, v, cu, cu_k, seq_len, flash=True)
    return {"absorbed": absorbed, "decompressed": decompressed}


def prefill_flops(config, seq_len: int) -> dict:
    """Multiply-add FLOPs of each prefill path for one causal sequence (about half the pairs),
    counted at the widths each path's attention really runs (the decompressed path padded)."""
    from labkit.kernels.grid import next_power_of_2
    h, t = config.num_attention_heads, seq_len
    pairs = t * (t + 1) // 2
    rank, rope, nope, v = (config.kv_lora_rank, config.qk_rope_head_dim,
                           config.qk_nope_head_dim, config.v_head_dim)
    width = next_power_of_2(max(nope + rope, v))
    projections = 2 * t * h * (nope + v) * rank  # W_UK and W_UV, once per token either way
    return {"absorbed": projections + 2 * h * pairs * (rank + rope + rank),
            "decompressed": projections + 2 * h * pairs * (2 * width)}
