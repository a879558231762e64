"""Notebook 10: multi-head latent attention (MLA) from the cache's bytes to the engine.

Four questions, each answered from values computed here:
1. What does a token cost in the cache under MHA, GQA, MQA and MLA at a real model's shape, and
   how many requests fit in a fixed amount of memory? (``scheme_table``)
2. Why may decode attend over the latent itself? Absorbing ``W_UK`` into the query and ``W_UV``
   into the output is associativity, checked on a real layer's weights (``absorption_check``),
   and what it saves per decode step (``decode_step_flops``).
3. What does that make of a decode kernel? One shared 576-wide row per token read by every head:
   FLOPs per cached byte grow with the heads (``decode_intensity``), so with enough heads MLA
   decode leaves the bandwidth roof for the compute roof.
4. Measured: ``paged_mla_attention`` replayed from CUDA Graphs at DeepSeek-V3's widths against the
   copy bandwidth and a bf16 matmul timed in the same rounds (``measure_decode``, also
   ``benchmarks/mla_decode.py`` and the ``mla/decode`` recording).
"""
from __future__ import annotations

import math

import pandas as pd
import torch

from labkit import check_positive_int
from labkit.lessons.paged_kv_cache.attention_memory import (DEEPSEEK_V3, GIB, AttentionDims,
                                                            cached_values_per_token_layer)
from labkit.teaching import claim

RANK, ROPE, BLOCK = 512, 64, 64  # DeepSeek-V3's latent (kv_lora_rank + rope) and cache block
SCALE = (128 + 64) ** -0.5       # its softmax scale: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)


# --- 1. bytes per token ----------------------------------------------------------------------

def scheme_table(dims: AttentionDims = DEEPSEEK_V3, gqa_kv_heads: int = 8,
                 bytes_per_value: int = 2, cache_gib: float = 64.0, context: int = 4096
                 ) -> pd.DataFrame:
    """MHA, GQA, MQA and MLA at ``dims``: values per token and layer, KiB per token (all
    layers), requests of ``context`` tokens that ``cache_gib`` holds, bytes over MLA's, and a
    decode's FLOPs per cached byte (``decode_intensity``)."""
    check_positive_int("context", context)
    if not cache_gib > 0:
        raise ValueError(f"cache_gib must be > 0, got {cache_gib!r}")
    rows = []
    for label, scheme, kv_heads in (
            (f"MHA ({dims.num_attention_heads} KV heads)", "MHA", None),
            (f"GQA ({gqa_kv_heads} KV heads)", "GQA", gqa_kv_heads),
            ("MQA (1 KV head)", "GQA", 1),
            (f"MLA (latent {dims.kv_lora_rank} + rope {dims.qk_rope_head_dim})", "MLA", None)):
        values = cached_values_per_token_layer(dims, scheme, kv_heads)
        per_token = values * dims.num_hidden_layers * bytes_per_value
        rows.append({"scheme": label, "values per token and layer": values,
                     "KiB per token": per_token / 1024,
                     "requests that fit": int(cache_gib * GIB // (per_token * context)),
                     "FLOPs per cached byte (decode)": decode_intensity(
                         dims, "MLA" if scheme == "MLA" else "MHA", bytes_per_value,
                         kv_heads=kv_heads or dims.num_attention_heads)})
    table = pd.DataFrame(rows)
    table["bytes vs MLA"] = table["KiB per token"] / table["KiB per token"].iloc[-1]
    return table


def decode_intensity(dims: AttentionDims, scheme: str, bytes_per_value: int = 2, *,
                     kv_heads: int | None = None, heads: int | None = None) -> float:
    """FLOPs a decode step does per byte of cache it reads (one new token per sequence).

    Per cached token every query head does a dot with its key and a multiply-add of its value:
    ``2 * heads * (k + v)`` FLOPs, where MHA/GQA/MQA ("MHA" here, with ``kv_heads``) read
    ``kv_heads * (k + v)`` values and absorbed MLA reads one row of ``rank + rope`` that serves
    as key (``rank + rope`` wide) and value (``rank``)."""
    heads = heads or dims.num_attention_heads
    if scheme == "MLA":
        row = dims.kv_lora_rank + dims.qk_rope_head_dim
        return 2 * heads * (row + dims.kv_lora_rank) / (row * bytes_per_value)
    kv_heads = kv_heads or heads
    return 2 * heads / (kv_heads * bytes_per_value)


def mla_flops(batch: int, heads: int, ctx: int, rank: int = RANK, rope: int = ROPE) -> int:
    """FLOPs of one absorbed MLA decode call: per head and cached token a ``rank + rope`` dot
    for the score and a ``rank``-wide multiply-add into the output (softmax not counted)."""
    return 2 * batch * heads * ctx * ((rank + rope) + rank)


def roof_us(nbytes: int, flops: int, copy_gbps: float, matmul_tflops: float) -> float:
    """The shortest time the two roofs allow: every byte at copy speed, or every FLOP at matmul
    speed, whichever takes longer."""
    return max(nbytes / (copy_gbps * 1e3), flops / (matmul_tflops * 1e6))


def bytes_claims(table: pd.DataFrame, cache_gib: float, context: int) -> list:
    gqa, mla = table.iloc[1], table.iloc[-1]
    return [
        claim("Per token MLA caches {mla:.1f} KiB across the layers against {gqa:.1f} KiB for "
              "GQA with 8 KV heads: {ratio:.1f}x fewer bytes, so {gib:g} GiB holds {n_mla} "
              "requests of {ctx} tokens instead of {n_gqa}.",
              mla["KiB per token"] < gqa["KiB per token"] and
              mla["requests that fit"] > gqa["requests that fit"],
              mla=mla["KiB per token"], gqa=gqa["KiB per token"],
              ratio=gqa["KiB per token"] / mla["KiB per token"], gib=cache_gib,
              n_mla=mla["requests that fit"], ctx=context, n_gqa=gqa["requests that fit"]),
        claim("MQA, one KV head of {k} + {v} values, caches {mqa:.2f}x MLA's bytes: fewer, but "
              "every head then reads the same key and value, where MLA's heads each up-project "
              "their own from the {rank}-wide latent (W_UK and W_UV per head).",
              table.iloc[2]["KiB per token"] < mla["KiB per token"] < gqa["KiB per token"],
              k=DEEPSEEK_V3.k_head_dim, v=DEEPSEEK_V3.v_head_dim,
              mqa=table.iloc[2]["bytes vs MLA"], rank=DEEPSEEK_V3.kv_lora_rank),
    ]


def intensity_claim(table: pd.DataFrame, ridge: float, recorded=None):
    """Where each scheme's decode sits against the ridge (matmul FLOP/s over copy bytes/s)."""
    mla = float(table.iloc[-1]["FLOPs per cached byte (decode)"])
    gqa = float(table.iloc[1]["FLOPs per cached byte (decode)"])
    return claim("At 128 heads an MLA decode does {mla:.0f} FLOPs per cached byte, above the "
                 "ridge of {ridge:.0f} (bf16 matmul over copy bandwidth): compute, not memory, "
                 "bounds it, where GQA's {gqa:.0f} sits far below the ridge.",
                 gqa < ridge < mla, mla=mla, ridge=ridge, gqa=gqa, recorded=recorded)


# --- 2. absorption -----------------------------------------------------------------------------

def absorption_check(attention, tokens: int = 7, seed: int = 0) -> dict:
    """Attention of ``tokens`` queries over as many cached latents, computed both ways with the
    layer's own ``W_UK``/``W_UV`` (``MLAAttention.up_projections``), in float64.

    decompressed: per head k = [W_UK c_kv ; k_pe], v = W_UV c_kv, then softmax(q.k) v;
    absorbed: q_latent = W_UK^T q_nope, softmax(q_latent.c_kv + q_pe.k_pe) c_kv, then W_UV.
    Returns the largest difference of the scores and of the outputs, and the tensors' shapes."""
    w_uk, w_uv = (w.detach().double() for w in attention.up_projections())
    heads, nope, rank = w_uk.shape
    rope = attention.config.qk_rope_head_dim
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(tokens, heads, nope, generator=g, dtype=torch.float64)
    q_pe = torch.randn(tokens, heads, rope, generator=g, dtype=torch.float64)
    c_kv = torch.randn(tokens, rank, generator=g, dtype=torch.float64)
    k_pe = torch.randn(tokens, rope, generator=g, dtype=torch.float64)
    mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    scale = attention.scale

    k_nope = torch.einsum("hnr,sr->shn", w_uk, c_kv)               # [S, H, nope] per head
    v = torch.einsum("hvr,sr->shv", w_uv, c_kv)                     # [S, H, v]
    s_dec = (torch.einsum("thn,shn->hts", q_nope, k_nope)
             + torch.einsum("thp,sp->hts", q_pe, k_pe)) * scale
    p_dec = torch.softmax(s_dec.masked_fill(~mask, float("-inf")), -1)
    out_dec = torch.einsum("hts,shv->thv", p_dec, v)

    q_latent = torch.einsum("thn,hnr->thr", q_nope, w_uk)           # W_UK folded into q
    s_abs = (torch.einsum("thr,sr->hts", q_latent, c_kv)
             + torch.einsum("thp,sp->hts", q_pe, k_pe)) * scale
    p_abs = torch.softmax(s_abs.masked_fill(~mask, float("-inf")), -1)
    out_abs = torch.einsum("thr,hvr->thv", torch.einsum("hts,sr->thr", p_abs, c_kv), w_uv)
    return {"score_diff": float((s_dec - s_abs).abs().max()),
            "output_diff": float((out_dec - out_abs).abs().max()),
            "output_scale": float(out_dec.abs().max()), "heads": heads, "nope": nope,
            "rank": rank, "rope": rope, "tokens": tokens}


def decode_step_flops(dims: AttentionDims = DEEPSEEK_V3, context: int = 4096) -> pd.DataFrame:
    """Per layer and decode step of one sequence at ``context`` tokens: the FLOPs of each way to
    attend. Decompressing re-derives every cached token's per-head keys and values from its latent
    (``context x heads x (nope + v) x rank`` multiply-adds) before attending over them; absorbing
    folds W_UK into the one new query and W_UV into its output and attends over the latent."""
    h, n, v, r, p = (dims.num_attention_heads, dims.qk_nope_head_dim, dims.v_head_dim,
                     dims.kv_lora_rank, dims.qk_rope_head_dim)
    decompress = 2 * context * h * (n + v) * r
    attend_heads = 2 * context * h * ((n + p) + v)
    fold = 2 * h * (n + v) * r  # W_UK into the query, W_UV into the output: one token's worth
    attend_latent = mla_flops(1, h, context, r, p)
    return pd.DataFrame([
        {"path": "decompressed", "up-projections": decompress, "attention": attend_heads,
         "total GFLOP": (decompress + attend_heads) / 1e9},
        {"path": "absorbed", "up-projections": fold, "attention": attend_latent,
         "total GFLOP": (fold + attend_latent) / 1e9}]).set_index("path")


def absorption_claims(check: dict, flops: pd.DataFrame, context: int) -> list:
    ratio = flops.loc["decompressed", "total GFLOP"] / flops.loc["absorbed", "total GFLOP"]
    return [
        claim("Folding W_UK into the query gives the same scores as up-projecting every key "
              "(largest difference {s:.1e}) and applying W_UV after attention the same outputs "
              "({o:.1e}, on outputs up to {scale:.1f}): associativity, in float64.",
              check["score_diff"] < 1e-10 and check["output_diff"] < 1e-10 * max(
                  1.0, check["output_scale"]), s=check["score_diff"],
              o=check["output_diff"], scale=check["output_scale"]),
        claim("For one decode step at {ctx} tokens of context, a DeepSeek-V3 layer that "
              "decompressed its cache would do {ratio:.0f}x the FLOPs of the absorbed path: it "
              "re-derives every cached token's keys and values for all heads.",
              ratio > 10, ctx=context, ratio=ratio),
    ]


# --- 4. measured decode ------------------------------------------------------------------------

def replayed(fn):
    """A replay of ``fn`` captured; it holds ``fn`` (the graph holds no reference to the tensors
    it reads and writes, so without it they would be freed and the replay read others' memory)."""
    from labkit.graphs import capture_graph
    graph, _ = capture_graph(fn)

    def replay():
        graph.replay()
    replay.captured = fn
    return replay


def decode_inputs(batch: int, heads: int, ctx: int, seed=0, device="cuda") -> tuple:
    """One decode step's tensors at DeepSeek-V3's widths, bf16: (q_latent, q_rope, latent_cache,
    block_tables, cu_seqlens_q, seq_lens, out), every sequence ``ctx`` tokens long over blocks of
    64 scattered across the cache."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = math.ceil(ctx / BLOCK)
    table = torch.randperm(batch * per_seq, generator=g).reshape(batch, per_seq).int().to(device)
    cache = torch.randn(table.numel(), BLOCK, RANK + ROPE, device=device, dtype=torch.bfloat16)
    q_latent = torch.randn(batch, heads, RANK, device=device, dtype=torch.bfloat16)
    q_rope = torch.randn(batch, heads, ROPE, device=device, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q_latent, q_rope, cache, table, cu, lens, torch.empty_like(q_latent)


def latent_decode(batch: int, heads: int, ctx: int, num_splits: int | None = None, seed=0,
                  device="cuda"):
    """(a replay of one paged_mla_attention decode call on ``decode_inputs``, the bytes of
    latent cache it reads)."""
    from labkit.attention import paged_mla_attention
    *args, out = decode_inputs(batch, heads, ctx, seed, device)
    call = lambda: paged_mla_attention(*args, scale=SCALE, check=False, max_query_len=1,
                                       num_splits=num_splits, out=out)
    return replayed(call), batch * ctx * (RANK + ROPE) * 2


def gqa_decode(batch: int, ctx: int, seed=0, device="cuda"):
    """The same decode for a GQA model (32 query / 8 KV heads of 128, blocks of 16)."""
    from labkit.attention import paged_attention
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = math.ceil(ctx / 16)
    table = torch.randperm(batch * per_seq, generator=g).reshape(batch, per_seq).int().to(device)
    k, v = (torch.randn(table.numel(), 16, 8, 128, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    q = torch.randn(batch, 32, 128, device=device, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=device)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    call = lambda: paged_attention(q, k, v, table, cu, lens, check=False, max_query_len=1)
    return replayed(call), 2 * batch * ctx * 8 * 128 * 2


def timed(cases: dict, nbytes: dict, rounds: int = 5, device="cuda") -> dict:
    """Each case's microseconds and GB/s over interleaved rounds: medians with their ranges."""
    from labkit.measure.rounds import Spread, interleaved
    timings = interleaved(cases, rounds=rounds, device=device, warmup=3, repeats=20)
    out = {}
    for name in cases:
        us = timings.us(name)
        gbps = Spread.of([nbytes[name] / (t * 1e-6) / 1e9 for t in us.values])
        out[name] = {"us": us.median, "us_range": [us.low, us.high],
                     "gbps": gbps.median, "gbps_range": [gbps.low, gbps.high],
                     "gbps_rounds": list(gbps.values)}
    return out


def roofs(rounds: int = 5, device="cuda") -> dict:
    """The two ceilings, timed here: a 2 GiB device copy (read + write counted) and a bf16
    8192^3 matmul. Returns copy GB/s (median and range), matmul TFLOP/s, and the ridge."""
    from labkit.measure.rounds import interleaved
    n = 2 * 2**30
    src = torch.empty(n // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    copy = timed({"copy": lambda: dst.copy_(src)}, {"copy": 2 * n}, rounds, device)["copy"]
    del src, dst
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    mm = interleaved({"mm": lambda: a @ b}, rounds=rounds, device=device, warmup=3, repeats=20)
    matmul_tflops = 2 * 8192 ** 3 / (mm.us("mm").median * 1e6)
    return {"copy_gbps": copy["gbps"], "copy": copy, "matmul_tflops": matmul_tflops,
            "ridge": matmul_tflops * 1e3 / copy["gbps"]}


def rate(results: dict, shapes: dict, roof: dict) -> dict:
    """Adds to each timed case its share of the copy bandwidth per round (median and range)
    and, for MLA cases (``shapes``: name -> (batch, heads, ctx)), TFLOP/s, FLOPs per byte and
    the share of the tighter roof."""
    from labkit.measure.rounds import Spread
    for name, r in results.items():
        share = Spread.of([g / roof["copy_gbps"] for g in r["gbps_rounds"]])
        r["copy_share"], r["copy_share_range"] = share.median, [share.low, share.high]
        if name in shapes:
            flops = mla_flops(*shapes[name])
            nbytes = r["gbps"] * 1e3 * r["us"]
            r["tflops"] = flops / (r["us"] * 1e6)
            r["flops_per_byte"] = flops / nbytes
            r["roof_us"] = roof_us(nbytes, flops, roof["copy_gbps"], roof["matmul_tflops"])
            r["roof_share"] = r["roof_us"] / r["us"]
    return results


def measure_decode(rounds: int = 5, batch: int = 64, ctx: int = 4096, heads=(16, 128),
                   device="cuda") -> dict:
    """MLA decode at ``heads`` and GQA decode at ``batch`` x ``ctx``, in the same interleaved
    rounds, rated against roofs timed just before."""
    from labkit.device import free_memory
    roof = roofs(rounds, device)
    cases, nbytes, shapes = {}, {}, {}
    for h in heads:
        name = f"MLA {h} heads"
        cases[name], nbytes[name] = latent_decode(batch, h, ctx, device=device)
        shapes[name] = (batch, h, ctx)
    cases["GQA 32/8 heads of 128"], nbytes["GQA 32/8 heads of 128"] = gqa_decode(
        batch, ctx, device=device)
    results = rate(timed(cases, nbytes, rounds, device), shapes, roof)
    del cases
    free_memory(device)
    return {**roof, "rounds": rounds, "batch": batch, "ctx": ctx, "cases": results}


def decode_table(measured: dict) -> pd.DataFrame:
    """One row per case: time, GB/s and share of copy with ranges, TFLOP/s, share of roof."""
    rows = []
    for name, r in measured["cases"].items():
        rows.append({"case": name, "us": r["us"],
                     "us range": f"{r['us_range'][0]:.1f}-{r['us_range'][1]:.1f}",
                     "GB/s": r["gbps"], "of copy": r["copy_share"],
                     "of copy range": "{:.0%}-{:.0%}".format(*r["copy_share_range"]),
                     "TFLOP/s": r.get("tflops", math.nan),
                     "FLOPs per byte": r.get("flops_per_byte", math.nan),
                     "of the tighter roof": r.get("roof_share", math.nan)})
    return pd.DataFrame(rows).set_index("case")


def decode_claims(measured: dict, recorded=None) -> list:
    """What the measured decode shows: 16 heads under the ridge and bound by bytes, 128 heads
    over it and bound by FLOPs, and the whole range of rounds behind each statement."""
    cases, ridge = measured["cases"], measured["ridge"]
    low, high = cases["MLA 16 heads"], cases["MLA 128 heads"]
    where = recorded.label if recorded is not None else "measured here"
    return [
        claim("MLA decode at 16 heads does {i:.0f} FLOPs per byte, under the ridge of {ridge:.0f}:"
              " it read the latent cache at {lo:.0%}-{hi:.0%} of the copy bandwidth over the "
              "rounds ({where}).", low["flops_per_byte"] < ridge, i=low["flops_per_byte"],
              ridge=ridge, lo=low["copy_share_range"][0], hi=low["copy_share_range"][1],
              where=where, recorded=recorded),
        claim("At 128 heads the same cache costs {i:.0f} FLOPs per byte, over the ridge: the "
              "tensor cores bound it, so it reads only {lo:.0%}-{hi:.0%} of copy bandwidth while "
              "doing {tf:.0f} TFLOP/s, {roof:.0%} of the time the tighter roof allows.",
              high["flops_per_byte"] > ridge and high["copy_share_range"][1]
              < low["copy_share_range"][0], i=high["flops_per_byte"],
              lo=high["copy_share_range"][0], hi=high["copy_share_range"][1], tf=high["tflops"],
              roof=high["roof_share"], recorded=recorded),
    ]


# --- 5. the engine -----------------------------------------------------------------------------

def tiny_mla_config():
    """A DeepSeek-shaped model a CPU runs in seconds: 2 dense layers, 4 heads, latent 32 + rope
    16 (kv_lora_rank + qk_rope_head_dim), v_head_dim 20, no query compression."""
    from labkit.engine import ModelConfig
    return ModelConfig.tiny(num_key_value_heads=4, vocab_size=128, intermediate_size=96,
                            kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=16,
                            v_head_dim=20)


def engine_tokens(model, prompts: list[list[int]], max_tokens: int, **options) -> tuple:
    """(each prompt's greedy tokens from LLM(model, **options), the engine's selection log)."""
    from labkit.engine import LLM, SamplingParams
    llm = LLM(model, **options)
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens))
    return [o.token_ids for o in outs], llm.selection_log, llm.runner.cache.shape


def engine_claim(engine: list, reference: list, label: str):
    same = sum(a == b for a, b in zip(engine, reference))
    return claim("The engine ({label}) generated the same greedy tokens as the model's "
                 "decompressed forward recomputed at every step for {same} of {n} prompts.",
                 same == len(reference) > 0, label=label, same=same, n=len(reference))


# --- figures and the kernel check --------------------------------------------------------------

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


def intensity_figure(ridge: float, where: str, dims: AttentionDims = DEEPSEEK_V3):
    """FLOPs per cached byte of a decode step: each scheme at the model's 128 heads, and MLA at
    fewer heads, against the ridge (log scale)."""
    import plotly.graph_objects as go
    h = dims.num_attention_heads
    bars = {f"MHA {h}/{h}": decode_intensity(dims, "MHA", kv_heads=h),
            f"GQA {h}/8": decode_intensity(dims, "MHA", kv_heads=8),
            f"MQA {h}/1": decode_intensity(dims, "MHA", kv_heads=1)}
    for heads in (16, 32, 64, 128):
        bars[f"MLA {heads} heads"] = decode_intensity(dims, "MLA", heads=heads)
    fig = go.Figure(go.Bar(x=list(bars), y=list(bars.values()),
                           marker_color=["#888"] * 3 + ["#c44"] * 4,
                           text=[f"{v:.0f}" for v in bars.values()], textposition="outside"))
    fig.add_hline(y=ridge, line_dash="dash",
                  annotation_text=f"ridge {ridge:.0f} FLOPs/byte ({where})")
    fig.update_layout(title="A decode step's FLOPs per byte of KV cache read (bf16)",
                      yaxis_type="log", yaxis_title="FLOPs per cached byte", height=420)
    return fig


def roofline_figure(measured: dict, where: str):
    """Each measured decode on the roofline: TFLOP/s against FLOPs per byte, under the two
    roofs timed in the same run."""
    import numpy as np
    import plotly.graph_objects as go
    copy, peak = measured["copy_gbps"], measured["matmul_tflops"]
    x = np.logspace(0, 3.5, 60)
    fig = go.Figure(go.Scatter(x=x, y=np.minimum(copy * x / 1e3, peak), mode="lines",
                               name="roof: min(copy x intensity, matmul)",
                               line=dict(color="#444")))
    for name, r in measured["cases"].items():
        if "flops_per_byte" in r:
            fig.add_trace(go.Scatter(x=[r["flops_per_byte"]], y=[r["tflops"]],
                                     mode="markers+text", text=[name], name=name,
                                     textposition="top center", marker=dict(size=12)))
        else:  # GQA: 2 * 32 / 8 FLOPs per byte for 32 query heads over 8 KV heads in bf16
            fig.add_trace(go.Scatter(x=[4.0], y=[4.0 * r["gbps"] / 1e3], mode="markers+text",
                                     text=[name], name=name, textposition="bottom center",
                                     marker=dict(size=12)))
    fig.update_layout(title=f"MLA and GQA decode on the roofline ({where})", height=460,
                      xaxis_type="log", yaxis_type="log", xaxis_title="FLOPs per byte",
                      yaxis_title="TFLOP/s", showlegend=False)
    return fig


# --- prefill: absorbed kernel or decompressed keys and values -------------------------------

def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """x [..., d] zero-padded to ``width`` columns: zeros add nothing to a dot product, and the
    output's extra columns are dropped after."""
    return torch.nn.functional.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x


def prefill_paths(attention, q_nope, q_pe, latent_cache, block_tables, seq_len: int):
    """Two ways to attend one sequence's ``seq_len``-token prefill (causal) over its paged latent
    rows, each ending in the per-head outputs [T, H, v_head_dim] that ``o_proj`` takes:

    - ``absorbed``: W_UK folded into the query, ``paged_mla_attention`` over the latent rows
      (every (query, key) pair costs rank + rope for the score and rank for the value), then W_UV;
    - ``decompressed``: the rows gathered and up-projected into per-head keys (nope + rope) and
      values (v_head_dim), then ``flash_attention`` (per pair nope + rope and v_head_dim, padded
      to the power of two the kernel takes: 192 and 128 become 256 at DeepSeek's shape).

    Returns {name: a function of no arguments -> [T, H, v_head_dim]}."""
    from labkit.attention import flash_attention, paged_mla_attention
    from labkit.kernels.grid import next_power_of_2
    w_uk, w_uv = attention.up_projections()
    c = attention.config
    rank, dev = c.kv_lora_rank, q_nope.device
    cu = torch.tensor([0, seq_len], dtype=torch.int32, device=dev)
    lens = torch.tensor([seq_len], dtype=torch.int32, device=dev)
    block = latent_cache.shape[1]
    positions = torch.arange(seq_len, device=dev)
    slots = block_tables[0, positions // block].long() * block + positions % block

    def absorbed():
        q = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        out = paged_mla_attention(q, q_pe, latent_cache, block_tables, cu, lens,
                                  scale=attention.scale, check=False, max_query_len=seq_len)
        return torch.einsum("thr,hvr->thv", out, w_uv)

    width = next_power_of_2(max(c.qk_head_dim, c.v_head_dim))

    def decompressed():
        rows = latent_cache.view(-1, latent_cache.shape[-1]).index_select(0, slots)
        c_kv, k_pe = rows[:, :rank], rows[:, rank:]
        k = torch.cat([torch.einsum("hnr,sr->shn", w_uk, c_kv),
                       k_pe[:, None, :].expand(-1, q_nope.shape[1], -1)], dim=-1)
        v = torch.einsum("hvr,sr->shv", w_uv, c_kv)
        q = torch.cat([q_nope, q_pe], dim=-1)
        out = flash_attention(_padded(q, width), _padded(k, width), _padded(v, width), cu, cu,
                              causal=True, scale=attention.scale, check=False,
                              max_seqlen_q=seq_len)
        return out[..., :c.v_head_dim]
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
