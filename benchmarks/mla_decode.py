"""MLA decode on a GPU: paged_mla_attention over a latent cache against the copy bandwidth.

    python benchmarks/mla_decode.py --out results/      # prints, writes mla_decode.json

DeepSeek-V3's latent (kv_lora_rank 512 + rope 64: 576 values per token and layer), bf16, blocks
of 64 tokens, each call replayed from a CUDA Graph as an engine's decode step replays it:

1. batch 64 at 4,096 tokens, 16 and 128 query heads: GB/s of latent cache read, each byte
   counted once, as a share of the device-copy bandwidth measured in the same run (target 75%);
2. batch 1 at 32,768 tokens, 16 and 128 heads: the split-KV plan (auto) against no split
   (target 70% for the split path);
3. beside them, GQA decode (paged_attention, 32 query / 8 KV heads of 128) at batch 64 and
   4,096 tokens: per token it reads 2,048 values where MLA reads 576.

Every cache here is larger than the H200's 60 MB L2, so each call reads it from HBM; no flush
is needed. The cases of a section are timed in the same interleaved rounds; each figure is the
median with its range, and a target is met only when the whole range clears it.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

import labkit  # noqa: F401  (device set-up before anything imports triton)
from labkit.attention import paged_attention, paged_mla_attention
from labkit.device import describe, fingerprint, free_memory
from labkit.graphs import capture_graph
from labkit.measure.rounds import Spread, interleaved

DEV = "cuda"
ROUNDS = 5
RANK, ROPE, BLOCK = 512, 64, 64
SCALE = (128 + 64) ** -0.5  # DeepSeek-V3: 1/sqrt(qk_nope_head_dim + qk_rope_head_dim)
TARGETS = {"batch 64": 0.75, "batch 1": 0.70}


def _replayed(fn):
    graph, _ = capture_graph(fn)
    return graph.replay


def _table(batch: int, ctx: int, g: torch.Generator) -> torch.Tensor:
    per_seq = math.ceil(ctx / BLOCK)
    return torch.randperm(batch * per_seq, generator=g).reshape(batch, per_seq).int().to(DEV)


def latent_decode(batch: int, heads: int, ctx: int, num_splits: int | None = None, seed=0):
    """(a replay of one decode call, bytes of latent cache it reads)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    table = _table(batch, ctx, g)
    cache = torch.randn(table.numel(), BLOCK, RANK + ROPE, device=DEV, dtype=torch.bfloat16)
    q_latent = torch.randn(batch, heads, RANK, device=DEV, dtype=torch.bfloat16)
    q_rope = torch.randn(batch, heads, ROPE, device=DEV, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    out = torch.empty_like(q_latent)
    call = lambda: paged_mla_attention(q_latent, q_rope, cache, table, cu, lens, scale=SCALE,
                                       check=False, max_query_len=1, num_splits=num_splits,
                                       out=out)
    return _replayed(call), batch * ctx * (RANK + ROPE) * 2


def gqa_decode(batch: int, ctx: int, seed=0):
    """The same decode for a GQA model (32 / 8 heads of 128, blocks of 16), for comparison."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = math.ceil(ctx / 16)
    table = torch.randperm(batch * per_seq, generator=g).reshape(batch, per_seq).int().to(DEV)
    k, v = (torch.randn(table.numel(), 16, 8, 128, device=DEV, dtype=torch.bfloat16)
            for _ in range(2))
    q = torch.randn(batch, 32, 128, device=DEV, dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEV)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
    call = lambda: paged_attention(q, k, v, table, cu, lens, check=False, max_query_len=1)
    return _replayed(call), 2 * batch * ctx * 8 * 128 * 2


def timed(cases: dict, nbytes: dict) -> dict:
    """Each case's microseconds and GB/s over interleaved rounds: medians with their ranges."""
    rounds = interleaved(cases, rounds=ROUNDS, device=DEV, warmup=3, repeats=20)
    out = {}
    for name in cases:
        us = rounds.us(name)
        gbps = Spread.of([nbytes[name] / (t * 1e-6) / 1e9 for t in us.values])
        out[name] = {"us": us.median, "us_range": [us.low, us.high],
                     "gbps": gbps.median, "gbps_range": [gbps.low, gbps.high],
                     "gbps_rounds": list(gbps.values)}
    return out


def run(out_dir: Path | None = None) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/mla_decode.py needs a CUDA GPU")
    print(describe())
    n = 2 * 2**30
    src = torch.empty(n // 2, dtype=torch.float16, device=DEV).normal_()
    dst = torch.empty_like(src)
    copy = timed({"copy": lambda: dst.copy_(src)}, {"copy": 2 * n})["copy"]
    del src, dst
    results = {"copy_gbps": copy["gbps"], "copy": copy, "rounds": ROUNDS, "sections": {}}
    sections = {
        "batch 64": {f"MLA {h} heads": (lambda h=h: latent_decode(64, h, 4096)) for h in (16, 128)}
        | {"GQA 32/8 heads of 128": lambda: gqa_decode(64, 4096)},
        "batch 1": {f"MLA {h} heads, {label}": (lambda h=h, s=s: latent_decode(1, h, 32768, s))
                    for h in (16, 128) for label, s in (("split (auto)", None), ("no split", 1))},
    }
    for section, builders in sections.items():
        cases, nbytes = {}, {}
        for name, build in builders.items():
            cases[name], nbytes[name] = build()
        res = timed(cases, nbytes)
        target = TARGETS[section]
        print(f"{section}: context {4096 if section == 'batch 64' else 32768}, copy "
              f"{copy['gbps']:.0f} GB/s ({copy['gbps_range'][0]:.0f}-{copy['gbps_range'][1]:.0f})")
        for name, r in res.items():
            share = Spread.of([g / copy["gbps"] for g in r["gbps_rounds"]])
            r["copy_share"], r["copy_share_range"] = share.median, [share.low, share.high]
            line = (f"  {name:<32} {r['us']:>8.1f} us  {r['gbps']:>6.0f} GB/s  "
                    f"{share.median:.0%} of copy ({share.low:.0%}-{share.high:.0%})")
            if name.startswith("MLA") and "no split" not in name:  # the cases with a target
                r["target_met"] = share.low >= target  # the whole range clears it, or not met
                line += f"  target {target:.0%} {'met' if r['target_met'] else 'not met'}"
            print(line)
        results["sections"][section] = res
        del cases
        free_memory(DEV)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "mla_decode.json").write_text(json.dumps(
            {"fingerprint": fingerprint(), "results": results}, indent=1, default=str))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for mla_decode.json")
    run(parser.parse_args().out)
