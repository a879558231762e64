"""MLA decode on a GPU: paged_mla_attention over a latent cache against the copy bandwidth.

    python benchmarks/mla_decode.py --out results/      # prints, writes mla_decode.json

DeepSeek-V3's latent (kv_lora_rank 512 + rope 64: 576 values per token and layer), bf16, blocks
of 64 tokens, each call replayed from a CUDA Graph as an engine's decode step replays it:

1. batch 64 at 4,096 tokens, 16 and 128 query heads: GB/s of latent cache read, each byte
   counted once, as a share of the device-copy bandwidth measured in the same run (target 75%);
   at 16 heads also the kernel's other tile orientation (rows on the MMA's M side), in the
   same rounds;
2. batch 1 at 32,768 tokens, 16 and 128 heads: the split-KV plan (auto) against no split
   (target 70% for the split path);
3. beside them, GQA decode (paged_attention, 32 query / 8 KV heads of 128) at batch 64 and
   4,096 tokens: per token it reads 2,048 values where MLA reads 576.

Bytes are not the whole story: every head multiplies each latent row twice (576 wide as a key,
512 as a value), so a decode call does ``2 * heads * (576 + 512)`` FLOPs per cached token
against 1,152 bytes. At 16 heads that is about 30 FLOPs a byte, far under the H200's ridge
(bf16 matmul over copy bandwidth, both timed here and printed), so the copy bandwidth bounds
it; at 128 heads about 240, over the ridge: the tensor cores bound it, and no kernel reaches 75%
of copy bandwidth there. Each MLA case prints its TFLOP/s and the time the tighter of the two
roofs allows.

The batch-64 caches (288 MiB of latent, 1 GiB of GQA K and V) are over twice the L2, so each
call reads them from HBM; batch 1's latent cache at 32k tokens is 36 MiB, which the H200's L2
holds, so that section flushes the L2 between samples. Each case's ``l2`` says which. The cases
of a section are timed in the same interleaved rounds; each figure is the median with its range,
and a target is met only when the whole range clears it.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import labkit  # noqa: F401  (device set-up before anything imports triton)
from labkit.device import describe, free_memory
from labkit.lessons.mla import (RANK, ROPE, SCALE, decode_inputs, gqa_decode, latent_decode, rate,
                                roofs, timed)
from labkit.lessons.mla.decode import ROWS_ON_M
from labkit.measure.bench import flush_needed, l2_statement, save_results

DEV = "cuda"
ROUNDS = 5
TARGETS = {"batch 64": 0.75, "batch 1": 0.70}


def run(out_dir: Path | None = None) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/mla_decode.py needs a CUDA GPU")
    print(describe())
    roof = roofs(ROUNDS, DEV)
    print(f"roofs: copy {roof['copy_gbps']:.0f} GB/s ({roof['copy']['gbps_range'][0]:.0f}-"
          f"{roof['copy']['gbps_range'][1]:.0f}), bf16 matmul (8192^3) "
          f"{roof['matmul_tflops']:.0f} TFLOP/s: ridge {roof['ridge']:.0f} FLOPs a byte")
    roof["copy"]["l2"] = l2_statement(2 * 2**30, DEV)  # a 2 GiB source, as roofs() copies
    roof["matmul_l2"] = l2_statement(2 * 8192 * 8192 * 2, DEV)  # a and b of the bf16 8192^3
    results = {**roof, "rounds": ROUNDS, "sections": {}}
    sections = {
        "batch 64": {f"MLA {h} heads": (lambda h=h: latent_decode(64, h, 4096)) for h in (16, 128)}
        | {ROWS_ON_M: lambda: latent_decode(64, 16, 4096, keys_on_m=False),
           "GQA 32/8 heads of 128": lambda: gqa_decode(64, 4096)},
        "batch 1": {f"MLA {h} heads, {label}": (lambda h=h, s=s: latent_decode(1, h, 32768, s))
                    for h in (16, 128) for label, s in (("split (auto)", None), ("no split", 1))},
    }
    shapes = {}
    shapes[ROWS_ON_M] = (64, 16, 4096)
    for h in (16, 128):
        shapes[f"MLA {h} heads"] = (64, h, 4096)
        for label in ("split (auto)", "no split"):
            shapes[f"MLA {h} heads, {label}"] = (1, h, 32768)
    for section, builders in sections.items():
        cases, nbytes = {}, {}
        for name, build in builders.items():
            cases[name], nbytes[name] = build()
        flush = any(flush_needed(b, DEV) for b in nbytes.values())
        res = rate(timed(cases, nbytes, ROUNDS, DEV, flush_l2=flush), shapes, roof)
        for name, r in res.items():
            r["l2"] = l2_statement(nbytes[name], DEV, flushed=flush)
        target = TARGETS[section]
        print(f"{section}: context {4096 if section == 'batch 64' else 32768}")
        for line in dict.fromkeys(r["l2"] for r in res.values()):
            print(f"  L2: {line}")
        for name, r in res.items():
            line = (f"  {name:<32} {r['us']:>8.1f} us  {r['gbps']:>6.0f} GB/s  "
                    f"{r['copy_share']:.0%} of copy ({r['copy_share_range'][0]:.0%}-"
                    f"{r['copy_share_range'][1]:.0%})")
            if name in shapes:
                line += f"  {r['tflops']:>4.0f} TFLOP/s, {r['roof_share']:.0%} of roof"
            if name.startswith("MLA ") and "no split" not in name:  # the cases with a target
                r["target_met"] = r["copy_share_range"][0] >= target  # the whole range clears it
                line += f"  target {target:.0%} {'met' if r['target_met'] else 'not met'}"
            print(line)
        results["sections"][section] = res
        del cases
        free_memory(DEV)
    save_results(out_dir, "mla_decode.json", results)
    return results


def record() -> dict:
    """`make record mla`: the decode figures notebook 10 shows where no GPU is present."""
    return run()


def sweep(out_dir: Path | None = None, only: list[str] | None = None) -> list[dict]:
    """Tile settings against each target case, one plan per setting built from ``plan_mla``'s
    (tile orientation, heads per program, keys per tile, warps, stages, KV splits), each
    replayed from a graph:
    the data behind ``plan_mla``'s choices. A setting that does not compile (registers, shared
    memory) is listed with its error."""
    import dataclasses
    import itertools
    from labkit.kernels.grid import cdiv
    from labkit.kernels.paged_attention_split import keys_per_split
    from labkit.kernels.paged_mla_attention import plan_mla
    from labkit.lessons.mla import replayed
    from labkit.measure.bench import measure
    rows = []  # the L2 is flushed where a case's cache fits in twice it (batch 1)
    for batch, heads, ctx in ((64, 16, 4096), (64, 128, 4096), (1, 16, 32768), (1, 128, 32768)):
        if only and f"{batch}x{heads}" not in only:
            continue
        ql, qr, cache, table, cu, lens, out = decode_inputs(batch, heads, ctx, device=DEV)
        nbytes = batch * ctx * (RANK + ROPE) * 2
        flush = flush_needed(nbytes, DEV)
        base = plan_mla(heads, RANK, cache.shape, batch, ctx, 1, DEV, scale=SCALE)
        splits = (1, 2, 4) if batch > 1 else (32, 64, 128, 256)
        for keys_on_m, group, bn, warps, stages, ns in itertools.product(
                (True, False), (16, 32, 64), (32, 64), (4, 8), (1, 2, 3), splits):
            if group > max(heads, 16) or (keys_on_m and (group >= 64 or bn < 64)) or \
                    (not keys_on_m and stages == 1):
                continue  # keys on M: for fewer than 64 rows, over tiles wgmma's M can take
            plan = dataclasses.replace(
                base, consts={**base.consts, "HEADS": group, "BLOCK_Q": 1, "BLOCK_N": bn,
                              "KEYS_ON_M": keys_on_m},
                launch={"num_warps": warps, "num_stages": stages},
                grid=(batch, cdiv(heads, group), ns), num_splits=ns,
                keys_per_split=keys_per_split(ctx, ns, bn))
            row = {"batch": batch, "heads": heads, "ctx": ctx, "keys_on_m": keys_on_m,
                   "group": group, "block_n": bn, "warps": warps, "stages": stages,
                   "splits": ns, "l2": l2_statement(nbytes, DEV, flushed=flush)}
            try:
                fn = lambda plan=plan: plan.run(ql, qr, cache, table, cu, lens, out=out)
                replay = replayed(fn)
                t = measure(replay, device=DEV, warmup=2, repeats=10, flush_l2=flush)
                row |= {"us": t.median_us, "gbps": nbytes / (t.median_us * 1e3)}
            except Exception as e:  # noqa: BLE001 (a setting that does not fit is a result)
                row["error"] = f"{type(e).__name__}: {e}"[:120]
            rows.append(row)
        done = [r for r in rows if r["heads"] == heads and r["batch"] == batch and "us" in r]
        done.sort(key=lambda r: r["us"])
        print(f"batch {batch} heads {heads} ctx {ctx}: plan_mla's choice "
              f"{base.consts} {base.launch} splits {base.num_splits}; L2: "
              f"{l2_statement(nbytes, DEV, flushed=flush)}; fastest:")
        for r in done[:6]:
            print(f"  {'keys' if r['keys_on_m'] else 'rows'} on M, "
                  f"group {r['group']:>3} block_n {r['block_n']:>3} warps {r['warps']} "
                  f"stages {r['stages']} splits {r['splits']:>2}: {r['us']:8.1f} us "
                  f"{r['gbps']:6.0f} GB/s")
        del cache, table
        free_memory(DEV)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "mla_sweep.json").write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for mla_decode.json")
    parser.add_argument("--sweep", action="store_true",
                        help="time tile settings per case instead (-> mla_sweep.json)")
    parser.add_argument("--only", nargs="+", metavar="BATCHxHEADS",
                        help="with --sweep: these cases only (64x16 64x128 1x16 1x128)")
    args = parser.parse_args()
    sweep(args.out, args.only) if args.sweep else run(args.out)
