"""What notebook 06 (and its appendix 06a) claims about the measured speeds: where prefill and
decode sit on the roofline, why prefill clears the tile model's cap (L2), long contexts and
the split path, launches against graph replay, block sizes, and the kernels' targets.

``data`` is a ``benchmarks/attention.py`` result (live on a GPU, recorded elsewhere): every
comparison in it was timed in interleaved rounds, so ratios and fractions carry their range and
a claim holds only when the whole range clears its bound. A recording made without rounds reads
as one round each (the sentence then says "1 round"). ``where`` names the GPU (" on NVIDIA
H200"); ``recorded`` is the recording checked against, or None when measured here.
"""
from __future__ import annotations

import math

import pandas as pd

from labkit.lessons.attention_backends.roofline import (
    LONG_CONTEXT,
    TILE_BEFORE,
    decode_workload,
    fraction_of_copy,
    prefill_workload,
    ratio_of,
    result_of,
    spread_of,
)
from labkit.measure.rounds import Spread
from labkit.teaching import claim

MISSING = "(claim not made: the recording has no {field}; re-record with `make record`)"


def not_claimed(field: str) -> list:
    """No claim, and a line saying which part of the recording is missing."""
    print(MISSING.format(field=field))
    return []


def _tflops_spread(result, flops: float) -> Spread:
    return Spread.of([flops / (us * 1e-6) / 1e12 for us in spread_of(result).values])


def _prefill_rates(data: dict) -> dict[str, Spread]:
    """TFLOP/s per prefill peer that ran, per round."""
    flops = prefill_workload().flops()
    return {p: _tflops_spread(r, flops) for p, r in (data.get("prefill") or {}).items()
            if spread_of(r)}


def roofline_claims(data: dict, matmul_tflops: float, *, where: str = "",
                    recorded=None) -> list:
    """Where prefill and decode sit, from their measured throughput against the two ceilings:
    prefill under the flat roof, decode on the sloped one."""
    copy = data.get("copy_gbps")
    rates = _prefill_rates(data)
    decode = result_of(data, "decode", "auto")
    if not copy or not matmul_tflops or not rates or spread_of(decode) is None:
        return not_claimed("prefill, decode or copy bandwidth")
    ridge = matmul_tflops * 1e3 / copy
    dw = decode_workload()
    shares = {p: s.median / matmul_tflops for p, s in rates.items()}
    frac = fraction_of_copy(decode, copy)
    d_share = _tflops_spread(decode, dw.flops()).median / matmul_tflops
    return [
        claim("Prefill{where} sits under the flat roof: the peers reach {lo:.0%}-{hi:.0%} of the "
              "matmul ceiling ({m:.0f} TFLOP/s), ours {ours:.0%}; the gap to the roof is each "
              "kernel's quality.", max(shares.values()) < 1.05 and min(shares.values()) > 0.2,
              lo=min(shares.values()), hi=max(shares.values()), m=matmul_tflops, where=where,
              ours=shares.get("triton (ours)", math.nan), recorded=recorded),
        claim("Decode{where} ({i:.1f} FLOP/B, left of the ridge) sits on the sloped roof: ours "
              "reads at {f:.2f} of the copy bandwidth while using {c:.1%} of the matmul ceiling.",
              dw.flops() / dw.bytes_moved() < ridge and frac.low > 0.5,
              i=dw.flops() / dw.bytes_moved(), f=frac, c=d_share, where=where,
              recorded=recorded),
    ]


def l2_reuse_claims(data: dict, matmul_tflops: float, tile_intensity: float,
                    io_intensity: float, *, where: str = "", recorded=None) -> list:
    """The tile model (K/V re-read from HBM once per query tile) puts prefill left of the ridge,
    so if every re-read reached HBM the copy bandwidth would cap it. A peer running above that
    cap in every round shows the re-reads hit L2 (one head's K/V is a few MiB); above it at the
    median only, the sentence says the rounds do not settle it. Below it at the median, the
    claim fails: nothing here would then need L2 to explain it."""
    copy = data.get("copy_gbps")
    rates = _prefill_rates(data)
    if not copy or not matmul_tflops or not rates:
        return not_claimed("prefill or copy bandwidth")
    best = max(rates, key=lambda p: rates[p].median)
    cap = max(tile_intensity, io_intensity) * copy / 1e3
    settled = rates[best].low > cap
    verdict = ("every round above that cap: the re-reads are served from L2, not HBM" if settled
               else "above that cap at the median but not in every round: this run's rounds "
               "do not settle whether the re-reads reach HBM")
    return [claim(
        "Had every query tile re-read K and V from HBM ({tile:.0f} FLOP/B by the tile model, "
        "{io:.0f} by attention_io: left of the ridge at {ridge:.0f}), the copy bandwidth would "
        "cap prefill at {cap:.0f} TFLOP/s{where}. {best} ran at {t:.0f} TFLOP/s, {verdict}.",
        rates[best].median > cap, verdict=verdict, tile=tile_intensity, io=io_intensity, ridge=matmul_tflops * 1e3 / copy, cap=cap,
        where=where, best=best, t=rates[best], recorded=recorded)]


def long_context_claims(data: dict, *, where: str = "", recorded=None) -> list:
    """At 32k tokens: fewer sequences leave more of the roof unused (a matter of degree), and
    the split path is what closes most of the gap."""
    copy = data.get("copy_gbps")
    split = {b: fraction_of_copy(result_of(data, "long_context", f"B{b} split (auto)"), copy)
             for b in (1, 2, 4)}
    b1_none = ratio_of(result_of(data, "long_context", "B1 no split"),
                       result_of(data, "long_context", "B1 split (auto)"))
    b1_no = fraction_of_copy(result_of(data, "long_context", "B1 no split"), copy)
    b64 = fraction_of_copy(result_of(data, "decode", "auto"), copy)
    if None in split.values() or b1_none is None or b64 is None:
        return not_claimed("long_context split / no split results")
    return [
        claim("At {ctx:,} tokens{where} the split path reads at {b1:.2f}, {b2:.2f} and {b4:.2f} "
              "of the copy bandwidth for batch 1, 2 and 4, against {b64:.2f} for batch 64 at 4k: "
              "the fewer the sequences, the further below the roof (batch 1 stays below batch 4 "
              "in every round).", split[1].high < split[4].low, ctx=LONG_CONTEXT, where=where,
              b1=split[1], b2=split[2], b4=split[4], b64=b64, recorded=recorded),
        claim("Without splits, batch 1 at {ctx:,} tokens{where} reads at {no:.3f} of the copy "
              "bandwidth; the split path is {x:.1fx} faster: it, not the batch, closes most of "
              "the gap to the roof.", b1_none.above(5.0), ctx=LONG_CONTEXT, where=where,
              no=b1_no, x=b1_none, recorded=recorded),
    ]


TILE_SLACK = 0.01  # at batch 4 the two tiles come within noise of each other


def _wins(ratio) -> bool:
    """Faster in the median and in every round but at most one."""
    return ratio.median > 1.0 and sum(v <= 1.0 for v in ratio.values) <= 1


def decode_tile_claims(data: dict, *, where: str = "", recorded=None) -> list:
    """The decode tile for heads 128 wide (32 keys, block ids loaded a tile ahead) against the
    one it replaced (64 keys, block ids loaded in the iteration that uses them), per batch at
    32k tokens, in the same rounds. Holds when it is faster at batch 1 and 2 in the median and
    in all rounds but at most one (a kernel of 40 us now and then meets a slow round: on H200
    gpu-check runs one round of five fell to 0.90x at batch 1 in one run and to 0.96x at batch 2
    in another, the medians 1.07x and 1.04x in both), and at batch 4, where the sequences fill
    the GPU and the two tiles come close, at most ``TILE_SLACK`` slower in the median."""
    ratios = {b: ratio_of(result_of(data, "long_context", f"B{b} {TILE_BEFORE}"),
                          result_of(data, "long_context", f"B{b} split (auto)")) for b in (1, 2, 4)}
    if None in ratios.values():
        return not_claimed("long_context results for the 64-key tile")
    return [claim(
        "At {ctx:,} tokens{where} decode's 32-key tiles, with each next tile's block ids loaded "
        "one iteration ahead, ran {b1:.2fx} as fast as 64-key tiles without that at batch 1 "
        "and {b2:.2fx} at batch 2 (faster in the median and in all rounds but at most one), "
        "{b4:.2fx} at batch 4 (the median no more than {slack:.0%} slower); the tile plan "
        "(kernels/paged_attention_tiles.py) gives every decode of heads 128 wide the 32-key "
        "tile.", all(_wins(ratios[b]) for b in (1, 2)) and ratios[4].median >= 1 - TILE_SLACK,
        ctx=LONG_CONTEXT, slack=TILE_SLACK,
        where=where, b1=ratios[1], b2=ratios[2], b4=ratios[4], recorded=recorded)]


def launch_claims(data: dict, *, where: str = "", tolerance: float = 0.10,
                  recorded=None) -> list:
    """Graph replay against a launch from Python, interleaved: a long kernel hides its launch,
    a short one does not. Only what the range supports is claimed."""
    auto = result_of(data, "decode", "auto")
    python = result_of(data, "decode", "auto, launched from Python")
    b1 = result_of(data, "long_context", "B1 split (auto)")
    b1_py = result_of(data, "long_context", "B1 split, launched from Python")
    long_ratio, short_ratio = ratio_of(python, auto), ratio_of(b1_py, b1)
    if long_ratio is None or short_ratio is None:
        return not_claimed("decode auto / launched from Python results")
    return [
        claim("At batch 64, 4k tokens{where} one decode kernel takes {us:.1f} us replayed; "
              "launched from Python it takes {r:.3fx} that. The range stays within ±{tol:.0%}: a "
              "kernel this long hides its launch, and neither way is faster beyond that.",
              long_ratio.low > 1 - tolerance and long_ratio.high < 1 + tolerance,
              us=spread_of(auto), r=long_ratio, tol=tolerance, where=where, recorded=recorded),
        claim("At batch 1, 32k tokens{where} the split kernels take {us:.1f} us replayed; "
              "launched from Python {r:.2fx} that: a short step is bound by its host work, "
              "which a graph removes.", short_ratio.above(1.2), us=spread_of(b1),
              r=short_ratio, where=where, recorded=recorded),
    ]


def block_sweep_claims(table: pd.DataFrame | None, batch: int | None, *, where: str = "",
                       recorded=None) -> list:
    """``roofline.block_sweep_table``: decode's fraction of the copy bandwidth per block size
    (rows) and context (columns). Holds when the block size moves it less, at any context, than
    the context moves it at every block size: there the context, not the block, sets the pace."""
    if table is None or table.shape[0] < 2 or table.shape[1] < 2:
        return not_claimed("block_sweep results")
    by_block = table.max() - table.min()  # per context, over block sizes
    short, long_ = table.columns.min(), table.columns.max()
    by_context = table[long_] - table[short]  # per block size
    smallest = table.index.min()
    return [claim(
        "Decode of batch {b}{where}: from block size {lo} to {hi} tokens the fraction of the "
        "copy bandwidth moves by at most {spread:.3f} at any one context, while from {c0:,} to "
        "{c1:,} tokens of context it rises by at least {gap:.3f} at every block size ({f0:.2f} to "
        "{f1:.2f} at block {lo}): the context length, not the block size, sets how close decode "
        "comes to the roof here.", bool(by_block.max() < by_context.min()), b=batch,
        where=where, lo=smallest, hi=table.index.max(), spread=by_block.max(), c0=short,
        c1=long_, gap=by_context.min(), f0=table.loc[smallest, short],
        f1=table.loc[smallest, long_], recorded=recorded)]


def targets_claim(score: pd.DataFrame, *, where: str = "", recorded=None) -> list:
    """The required targets, scored: met only when every round clears them; a range that
    straddles a target is said to, and not called met; a missed target is named with its value.
    The targets are the open kernel issue's, so some are missed: the claim reports them, and
    fails where a target went unmeasured (a section of the benchmark that did not run)."""
    must = score[score.kind == "must"]
    by = {v: list(must.target[must.verdict == v]) for v in ("met", "within noise", "missed",
                                                             "not measured")}
    noise = "; ".join(f"{r.target} {r.measured:.3f} ({r.low:.3f}-{r.high:.3f}) vs {r.required}"
                      for r in must[must.verdict == "within noise"].itertuples()) or "none"
    missed = "; ".join(f"{r.target} {r.measured:.3f} vs {r.required}"
                       for r in must[must.verdict == "missed"].itertuples()) or "none"
    rounds = int(must.rounds.max()) if len(must) else 0
    return [claim(
        "Of {n} required targets{where}, {met} are met in every round (up to {rounds}); within "
        "noise (the range straddles the target, so not called met): {noise}; missed: {missed}; "
        "not measured: {absent}.", len(by["not measured"]) == 0 and len(must) > 0, n=len(must),
        where=where, met=len(by["met"]), rounds=rounds, noise=noise, missed=missed,
        absent=", ".join(by["not measured"]) or "none", recorded=recorded)]
