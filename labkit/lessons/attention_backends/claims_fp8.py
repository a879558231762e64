"""What notebook 06 and its appendix 06a claim about an fp8 KV cache: its decode speed against
bf16 and what the block-id prefetch is worth (from the benchmark's rounds), why it stops short of
twice bf16 (the compiled loop, ``sass``), and what it costs in accuracy (``fp8_accuracy``).
"""
from __future__ import annotations

import pandas as pd

from labkit.lessons.attention_backends.claims_speed import MISSING, not_claimed
from labkit.lessons.attention_backends.roofline import TARGETS, ratio_of, result_of, spread_of
from labkit.lessons.attention_backends.sass import group_opcodes
from labkit.measure.rounds import Spread
from labkit.teaching import claim

FP8_ERROR_BOUND = 2.0**-4  # e4m3 keeps 3 mantissa bits: its largest relative rounding error


def fp8_claims(data: dict, *, where: str = "", recorded=None) -> list:
    """The fp8 cache against bf16, and the block-id prefetch, from one set of rounds; and that
    the bf16 decode it divides by is the decode section's measurement."""
    in_decode = result_of(data, "decode", "fp8_e4m3") is not None
    section = "decode" if in_decode else "fp8"
    bf16 = result_of(data, "decode", "auto") if in_decode else result_of(data, "fp8", "bf16")
    f8 = result_of(data, section, "fp8_e4m3")
    f8_np = result_of(data, section, "fp8_e4m3_no_prefetch")
    speed, prefetch = ratio_of(bf16, f8), ratio_of(f8_np, f8)
    if speed is None or prefetch is None:
        return not_claimed("fp8 cache decode results")
    need = TARGETS["fp8 cache vs bf16 decode (speed ratio)"]
    made = [claim(
        "With an fp8 cache{where} batch-64 decode takes {f8:.1f} us against bf16's {bf:.1f} us: "
        "{x:.2fx} faster, short of the {ideal}x that half the bytes would give (target "
        "{need}x); the block-id prefetch is worth {p:.2fx}.",
        speed.above(1.0) and speed.high < 2.0 and prefetch.above(1.0),
        f8=spread_of(f8), bf=spread_of(bf16), x=speed, ideal=2, need=need, p=prefetch,
        where=where, recorded=recorded)]
    same = same_decode(data)
    if same is None:
        print(MISSING.format(field="decode rounds for the bf16 decode (it was timed twice)"))
    else:
        made.append(same(where, recorded))
    return made


def same_decode(data: dict):
    """The claim that the bf16 batch-64 decode reads the same in the decode figure and the fp8
    ratio: one measurement reused, or two whose round ranges overlap. None where the recording
    cannot say (the decode section was timed without rounds)."""
    auto = spread_of(result_of(data, "decode", "auto"))
    bf16 = spread_of(result_of(data, "decode", "auto") if result_of(data, "decode", "fp8_e4m3")
                     else result_of(data, "fp8", "bf16"))
    if auto is None or bf16 is None or min(auto.rounds, bf16.rounds) < 3:
        return None
    one = auto.values == bf16.values
    overlap = auto.low <= bf16.high and bf16.low <= auto.high

    def make(where, recorded):
        return claim(
            "The bf16 batch-64 decode{where} reads {a:.1f} us in the decode figure and {b:.1f} us "
            "in the fp8 ratio: {how}.", one or overlap, where=where, a=auto, b=bf16,
            how="one measurement, used by both" if one else "two measurements whose ranges "
            "overlap" if overlap else "two measurements that disagree beyond their ranges",
            recorded=recorded)
    return make


def sass_claims(loops: dict) -> list:
    """The compiled decode loops (sm_90), counted here: fp8 costs what bf16 does per key, so about
    twice as much per byte, and the byte-wide shared-memory loads are V's transpose."""
    bf16, fp8 = loops["bf16"], loops["fp8_e4m3"]
    per_key = fp8["instructions_per_key"] / bf16["instructions_per_key"]
    per_byte = per_key * bf16["kv_bytes_per_key"] / fp8["kv_bytes_per_key"]
    groups = {c: group_opcodes(d["opcodes"]) for c, d in loops.items()}
    byte_loads = {c: g.get("byte loads from shared memory", 0) for c, g in groups.items()}
    widen = groups["fp8_e4m3"].get("fp8 -> f16 conversions", 0)
    return [
        claim("Compiled for sm_90 here, the fp8 decode loop issues {per_key:.2f}x the bf16 "
              "loop's instructions per key, so {per_byte:.2f}x per byte of KV cache.",
              0.8 < per_key < 1.25 and per_byte > 1.6, per_key=per_key, per_byte=per_byte),
        claim("Per warp and iteration the fp8 loop makes {fp8_lds} byte loads from shared memory "
              "(V transposed byte by byte) and {widen} fp8 -> f16 conversions; the bf16 loop "
              "makes {bf16_lds} byte loads.", byte_loads["fp8_e4m3"] > 0 and widen > 0
              and byte_loads["bf16"] == 0, fp8_lds=byte_loads["fp8_e4m3"], widen=widen,
              bf16_lds=byte_loads["bf16"]),
    ]


def fp8_accuracy_claims(table: pd.DataFrame, device: str, bound: float = FP8_ERROR_BOUND,
                        where: str = "") -> list:
    """``fp8_accuracy.fp8_cache_error``'s table: per path, fp8's output error against the float64
    reference is larger than bf16's in every seed and stays below ``bound`` in every seed."""
    made = []
    for path, rows in table.groupby("path", sort=False):
        fp8, bf16 = Spread.of(rows.fp8_vs_float64), Spread.of(rows.bf16_vs_float64)
        ratio = Spread.of(rows.fp8_vs_float64 / rows.bf16_vs_float64)
        vs_bf16 = Spread.of(rows.fp8_vs_bf16)
        how = ("With float64 attention over each stored cache (the storage's error alone)"
               if path == "reference" else f"With labkit's `{path}` kernel")
        made.append(claim(
            "{how}, on {device}{where}, over {n} seeds: the fp8 cache's output is {fp8:.2e} off "
            "the float64 reference (relative, median and range), the bf16 cache's {bf16:.2e}; "
            "fp8 has {ratio:.1fx} bf16's error and differs from the bf16 cache's output by "
            "{vs_bf16:.2e}. Every seed stays below {bound:.4f}, e4m3's largest relative "
            "rounding error.", ratio.above(1) and fp8.below(bound), how=how, device=device,
            where=where, n=len(rows), fp8=fp8, bf16=bf16, ratio=ratio, vs_bf16=vs_bf16,
            bound=bound))
    return made
