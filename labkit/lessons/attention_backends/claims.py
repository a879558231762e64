"""What notebook 06 claims, each sentence computed from this run's values (or the recording's,
labelled) with a condition that can fail.

``data`` is a ``benchmarks/attention.py`` result (live on a GPU, recorded elsewhere): every
comparison in it was timed in interleaved rounds, so ratios and fractions carry their range and
a claim holds only when the whole range clears its bound. A recording made without rounds reads
as one round each (the sentence then says "1 round"). ``where`` names the GPU (" on NVIDIA
H200"); ``recorded`` is the recording checked against, or None when measured here.
"""
from __future__ import annotations

import itertools
import math

import pandas as pd

from labkit.lessons.attention_backends.roofline import (
    LONG_CONTEXT,
    TARGETS,
    decode_workload,
    fraction_of_copy,
    prefill_workload,
    ratio_of,
    spread_of,
)
from labkit.measure.rounds import Spread
from labkit.teaching import claim

MISSING = "(claim not made: the recording has no {field}; re-record with `make record`)"


def _missing(field: str) -> list:
    print(MISSING.format(field=field))
    return []


def _get(data: dict, section: str, peer: str):
    value = (data or {}).get(section)
    return value.get(peer) if isinstance(value, dict) else None


# ------------------------------------------------------------- device-independent bookkeeping
def tiling_claims(tiles: pd.DataFrame, io: dict, length: int) -> list:
    """The tile arithmetic: more queries per K/V tile, more FLOPs per streamed byte; tiling moves
    fewer HBM bytes than writing the scores."""
    per = tiles.set_index(["BLOCK_M", "BLOCK_N"]).flops_per_byte
    small, large = per[(64, 64)], per[(128, 64)]
    return [
        claim("A 128-query tile does {large:.0f} FLOPs per byte of K/V it streams, a 64-query "
              "tile {small:.0f}: the intensity grows with the queries that share each tile.",
              bool(large > small), large=large, small=small),
        claim("At {n:,} tokens, 32 heads, head_dim 128, tiled attention moves {tiled:,.0f} MiB "
              "through HBM against {naive:,.0f} MiB with the scores written and read back "
              "({x:.0f}x fewer bytes).", io["tiled_bytes"] < io["naive_bytes"], n=length,
              tiled=io["tiled_bytes"] / 2**20, naive=io["naive_bytes"] / 2**20,
              x=io["naive_bytes"] / io["tiled_bytes"]),
    ]


def causal_memory_claims(ios: dict[int, dict]) -> list:
    """``ios``: ``attention_io`` per sequence length (prefill, len_q == len_k). With the causal
    mask the key loop stops at the diagonal: the fraction of K/V bytes and FLOPs left tends to
    one half as S grows. Without a score matrix in HBM, the footprint grows linearly in S."""
    lengths = sorted(ios)
    frac = {n: (ios[n]["causal_tiled_bytes"] / ios[n]["tiled_bytes"],
                ios[n]["causal_flops_computed"] / ios[n]["tiled_flops_computed"])
            for n in lengths}
    short, long_ = lengths[0], lengths[-1]
    shrinking = all(frac[a][i] >= frac[b][i] for a, b in itertools.pairwise(lengths)
                    for i in (0, 1))
    a, b = lengths[-2], lengths[-1]
    tiled_growth = ios[b]["tiled_memory_bytes"] / ios[a]["tiled_memory_bytes"]
    naive_growth = ios[b]["naive_memory_bytes"] / ios[a]["naive_memory_bytes"]
    length_growth = b / a
    return [
        claim("Causal prefill at {n:,} tokens: the kernel's key loop stops at the diagonal, so it "
              "reads {bytes_:.3f} of the tiled loop's K/V bytes and computes {flops:.3f} of its "
              "FLOPs; at {n0:,} tokens {bytes0:.3f} and {flops0:.3f}. The fraction falls with "
              "the length toward one half.",
              shrinking and 0.5 <= frac[long_][1] <= frac[long_][0] < 0.55, n=long_,
              bytes_=frac[long_][0], flops=frac[long_][1], n0=short, bytes0=frac[short][0],
              flops0=frac[short][1]),
        claim("The tiled kernel never materialises the scores: from {a:,} to {b:,} tokens "
              "({g:.0f}x the length) the HBM a call holds grows {tiled:.2f}x (Q, K, V, O: linear "
              "in S), the naive one's {naive:.2f}x (the [S, S] scores: quadratic); at {b:,} "
              "tokens {naive_mib:,.0f} MiB against {tiled_mib:,.0f} MiB.",
              tiled_growth <= length_growth * (1 + 1e-9) and naive_growth > 0.9 * length_growth**2,
              a=a, b=b, g=length_growth, tiled=tiled_growth, naive=naive_growth,
              naive_mib=ios[b]["naive_memory_bytes"] / 2**20,
              tiled_mib=ios[b]["tiled_memory_bytes"] / 2**20),
    ]


def mla_claims(spec, cache: dict) -> list:
    """The MLA example as selection sees it: one latent "KV head" shared by every query head,
    and its cache bytes per token (``compare.mla_cache_bytes``) against per-head K and V."""
    return [claim(
        "DeepSeek-V3's MLA spec caches {kv} latent of width {w} per token and layer, read by all "
        "{hq} query heads: {mla:,} bytes in bf16, against {per:,} bytes for per-head K and V of "
        "the same heads ({x:.0f}x less).",
        spec.num_kv_heads == 1 and 2 * spec.head_dim == cache["mla_bytes"] and cache["ratio"] > 1,
        kv=spec.num_kv_heads, w=spec.head_dim, hq=spec.num_q_heads, mla=cache["mla_bytes"],
        per=cache["per_head_bytes"], x=cache["ratio"])]


FP8_ERROR_BOUND = 2.0**-4  # e4m3 keeps 3 mantissa bits: its largest relative rounding error


def fp8_accuracy_claims(table: pd.DataFrame, device: str, bound: float = FP8_ERROR_BOUND,
                        where: str = "") -> list:
    """``compare.fp8_cache_error``'s table: per path, fp8's output error against the float64
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


def selection_claims(chosen: dict, refused: dict) -> list:
    """Who serves the awkward shapes, from the selection just run (``chosen``: name -> (backend,
    passed over); ``refused``: name -> reasons per backend)."""
    fp8_a100 = chosen.get("GQA + fp8 KV cache on an A100", ("nothing",))[0]
    hd96 = chosen.get("head_dim 96 (Phi-2-like)", ("nothing",))[0]
    mla = {n: r for n, r in refused.items() if "MLA" in n}
    mla_reasoned = bool(mla) and all(
        all(any("MLA" in why for why in reasons) for reasons in r.values()) for r in mla.values())
    backends = sorted({b for r in mla.values() for b in r})
    return [
        claim("An fp8 KV cache on an A100 (compute capability 8.0) is served by `{b}`: every "
              "faster backend refused it, and the log says why.", fp8_a100 == "reference",
              b=fp8_a100),
        claim("head_dim 96 is served by `{b}`: labkit's Triton kernels refuse it.",
              hd96 not in ("triton", "nothing"), b=hd96),
        claim("MLA is refused by every backend ({names}), each naming MLA among its reasons.",
              mla_reasoned, names=", ".join(backends) or "none refused it"),
    ]


def correctness_claim(checks: dict, device: str) -> list:
    """Every compatible backend against the float64 reference, on the cases just run."""
    tables = list(checks.values())
    compared = sum(int(t.compatible.sum()) for t in tables)
    passed = all(bool(t.passed[t.compatible].all()) for t in tables)
    worst = max((float(t.relative_error.max()) for t in tables if t.compatible.any()),
                default=math.nan)
    return [claim("On {device}, {n} backend runs over {cases} cases matched the float64 "
                  "reference within their dtype's tolerance; the largest relative error was "
                  "{worst:.1e}.", passed and compared > 0, device=device, n=compared,
                  cases=len(tables), worst=worst)]


def sass_claims(loops: dict) -> list:
    """The compiled decode loops (sm_90), counted here: fp8 costs what bf16 does per key, so about
    twice as much per byte, and the byte-wide shared-memory loads are V's transpose."""
    from labkit.lessons.attention_backends.sass import group_opcodes
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


# ------------------------------------------------------------------------ the GPU's figures
def _tflops_spread(result, flops: float) -> Spread:
    return Spread.of([flops / (us * 1e-6) / 1e12 for us in spread_of(result).values])


def roofline_claims(data: dict, matmul_tflops: float, tile_intensity: float,
                    io_intensity: float, *, where: str = "", recorded=None) -> list:
    """Where prefill and decode sit, from their measured throughput against the two ceilings.

    The tile model (K/V re-read from HBM once per query tile) puts prefill left of the ridge,
    so if every re-read reached HBM the copy bandwidth would cap it. A peer running above that
    cap shows the re-reads hit L2 (one head's K/V is a few MiB), and the flat roof binds."""
    copy = data.get("copy_gbps")
    prefill = {p: r for p, r in (data.get("prefill") or {}).items() if spread_of(r)}
    decode = _get(data, "decode", "auto")
    if not copy or not matmul_tflops or not prefill or spread_of(decode) is None:
        return _missing("prefill, decode or copy bandwidth")
    ridge = matmul_tflops * 1e3 / copy
    pw, dw = prefill_workload(), decode_workload()
    rates = {p: _tflops_spread(r, pw.flops()) for p, r in prefill.items()}
    best = max(rates, key=lambda p: rates[p].median)
    cap = max(tile_intensity, io_intensity) * copy / 1e3
    shares = {p: s.median / matmul_tflops for p, s in rates.items()}
    frac = fraction_of_copy(decode, copy)
    d_share = _tflops_spread(decode, dw.flops()).median / matmul_tflops
    made = [
        claim("Had every query tile re-read K and V from HBM ({tile:.0f} FLOP/B by the tile "
              "model, {io:.0f} by attention_io: left of the ridge at {ridge:.0f}), the copy "
              "bandwidth would cap prefill at {cap:.0f} TFLOP/s{where}. {best} ran at {t:.0f} "
              "TFLOP/s, every round above that cap: the re-reads are served from L2, not HBM.",
              rates[best].low > cap, tile=tile_intensity, io=io_intensity, ridge=ridge,
              cap=cap, where=where, best=best, t=rates[best], recorded=recorded),
        claim("Prefill{where} sits under the flat roof: the peers reach {lo:.0%}-{hi:.0%} of the "
              "matmul ceiling ({m:.0f} TFLOP/s), ours {ours:.0%}; the gap to the roof is each "
              "kernel's quality.", max(shares.values()) < 1.05 and min(shares.values()) > 0.2, lo=min(shares.values()), hi=max(shares.values()),
              m=matmul_tflops, where=where, ours=shares.get("triton (ours)", math.nan),
              recorded=recorded),
        claim("Decode{where} ({i:.1f} FLOP/B, left of the ridge) sits on the sloped roof: ours "
              "reads at {f:.2f} of the copy bandwidth while using {c:.1%} of the matmul ceiling.",
              dw.flops() / dw.bytes_moved() < ridge and frac.low > 0.5,
              i=dw.flops() / dw.bytes_moved(), f=frac, c=d_share, where=where,
              recorded=recorded),
    ]
    return made


def long_context_claims(data: dict, *, where: str = "", recorded=None) -> list:
    """At 32k tokens: fewer sequences leave more of the roof unused (a matter of degree), and
    the split path is what closes most of the gap."""
    copy = data.get("copy_gbps")
    split = {b: fraction_of_copy(_get(data, "long_context", f"B{b} split (auto)"), copy)
             for b in (1, 2, 4)}
    b1_none = ratio_of(_get(data, "long_context", "B1 no split"),
                       _get(data, "long_context", "B1 split (auto)"))
    b1_no = fraction_of_copy(_get(data, "long_context", "B1 no split"), copy)
    b64 = fraction_of_copy(_get(data, "decode", "auto"), copy)
    if None in split.values() or b1_none is None or b64 is None:
        return _missing("long_context split / no split results")
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


def launch_claims(data: dict, *, where: str = "", tolerance: float = 0.10,
                  recorded=None) -> list:
    """Graph replay against a launch from Python, interleaved: a long kernel hides its launch,
    a short one does not. Only what the range supports is claimed."""
    auto, python = _get(data, "decode", "auto"), _get(data, "decode",
                                                      "auto, launched from Python")
    b1, b1_py = (_get(data, "long_context", k) for k in ("B1 split (auto)",
                                                         "B1 split, launched from Python"))
    long_ratio, short_ratio = ratio_of(python, auto), ratio_of(b1_py, b1)
    if long_ratio is None or short_ratio is None:
        return _missing("decode auto / launched from Python results")
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


def fp8_claims(data: dict, *, where: str = "", recorded=None) -> list:
    """The fp8 cache against bf16, and the block-id prefetch, from one set of rounds; and that
    the bf16 decode it divides by is the decode section's measurement."""
    in_decode = _get(data, "decode", "fp8_e4m3") is not None
    section = "decode" if in_decode else "fp8"
    bf16 = _get(data, "decode", "auto") if in_decode else _get(data, "fp8", "bf16")
    f8 = _get(data, section, "fp8_e4m3")
    f8_np = _get(data, section, "fp8_e4m3_no_prefetch")
    speed, prefetch = ratio_of(bf16, f8), ratio_of(f8_np, f8)
    made = []
    if speed is None or prefetch is None:
        return _missing("fp8 cache decode results")
    need = TARGETS["fp8 cache vs bf16 decode (speed ratio)"]
    made.append(claim(
        "With an fp8 cache{where} batch-64 decode takes {f8:.1f} us against bf16's {bf:.1f} us: "
        "{x:.2fx} faster, short of the {ideal}x that half the bytes would give (target "
        "{need}x); the block-id prefetch is worth {p:.2fx}.",
        speed.above(1.0) and speed.high < 2.0 and prefetch.above(1.0),
        f8=spread_of(f8), bf=spread_of(bf16), x=speed, ideal=2, need=need, p=prefetch,
        where=where, recorded=recorded))
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
    auto = spread_of(_get(data, "decode", "auto"))
    bf16 = spread_of(_get(data, "decode", "auto") if _get(data, "decode", "fp8_e4m3")
                     else _get(data, "fp8", "bf16"))
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


def targets_claim(score: pd.DataFrame, *, where: str = "", recorded=None) -> list:
    """The required targets: met only when every round clears them; a range that straddles a
    target is said to, and not called met; the claim fails if any required target is missed."""
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
        "not measured: {absent}.", len(by["missed"]) == 0 and len(by["met"]) > 0, n=len(must),
        where=where, met=len(by["met"]), rounds=rounds, noise=noise, missed=missed,
        absent=", ".join(by["not measured"]) or "none", recorded=recorded)]


# -------------------------------------------------------- the registry against the benchmark
# (workload, registry backend, the benchmark's bare kernels: section, peers). Where SDPA may
# dispatch to more than one kernel, the fastest of them is the bare kernel's lower bound.
PAIRS = [
    ("prefill", "triton", "prefill", ("triton (ours)",)),
    ("prefill", "flex", "prefill", ("flex",)),
    ("prefill", "sdpa", "prefill", ("sdpa flash", "sdpa cudnn")),
    ("decode B64 ctx 4096", "triton", "decode", ("auto",)),
    ("decode B64 ctx 4096", "flex", "decode", ("flex",)),
    ("decode B64 ctx 4096", "sdpa", "decode", ("sdpa flash",)),
]


def registry_claims(registry: pd.DataFrame | None, data: dict, *, where: str = "",
                    recorded=None) -> list:
    """Why the live roofline (the registry, as an engine calls it) and the benchmark (the bare
    kernels, engine-style arguments, graphs where they capture) differ: the wall time splits into
    the GPU's kernel time (the profiler's) and host time, and the kernel time into the bare
    kernel's and the wrapper's extra GPU work (checks, gathers, masks built per call). Holds when
    the split is consistent: the GPU time is no more than the wall time and no less than the
    bare kernel's (the two measured the same shapes)."""
    if registry is None or "gpu_us" not in registry or registry.gpu_us.isna().all():
        return _missing("registry section (wall and GPU kernel time per backend)")
    made = []
    for workload, backend, section, peers in PAIRS:
        rows = registry[(registry.workload == workload) & (registry.backend == backend)
                        & registry.error.isna()]
        bares = {p: spread_of(_get(data, section, p)) for p in peers}
        bares = {p: s for p, s in bares.items() if s is not None}
        if rows.empty or not bares or pd.isna(rows.gpu_us.iloc[0]):
            continue
        peer = min(bares, key=lambda p: bares[p].median)
        bare = bares[peer]
        r = rows.iloc[0]
        wall = Spread.of([r.us_low, r.us, r.us_high])
        gpu = float(r.gpu_us)
        made.append(claim(
            "{workload}, `{backend}` through the registry{where}: {wall:.0f} us wall (median, "
            "range over rounds), of which the GPU ran {k} kernel(s) for {gpu:.0f} us; the "
            "benchmark's bare `{peer}` takes {bare:.0f} us. Host time (GPU idle) is {host:.0f} "
            "us; the wrapper's extra GPU work {extra}.",
            gpu <= 1.1 * wall.high and gpu >= 0.8 * bare.median, workload=workload,
            backend=backend, where=where, wall=wall.median,
            k=int(r.kernels) if pd.notna(r.kernels) else "?", gpu=gpu,
            peer=peer, bare=bare.median, host=max(0.0, wall.median - gpu),
            extra=_extra_gpu(gpu - bare.median), recorded=recorded))
    if not made:
        return _missing("registry rows that the benchmark also measured")
    return made


def _extra_gpu(us: float) -> str:
    """The registry's kernel time above the bare kernel's: two separate measurements, so a
    difference below zero says there is none, not that the wrapper saved time."""
    if us < 0:
        return (f"none measurable (the registry's kernels took {-us:.0f} us less than the bare "
                "kernel timed in the benchmark: the two measurements' noise)")
    return f"{us:.0f} us"


def registry_limits(registry: pd.DataFrame | None, data: dict) -> pd.DataFrame:
    """Every backend or peer that raised instead of running, with its error: a limit shown."""
    rows = []
    if registry is not None and len(registry):
        for r in registry[registry.error.notna()].itertuples():
            rows.append({"where": f"registry, {r.workload}", "backend": r.backend,
                         "error": r.error})
    for section in ("prefill", "decode", "long_context"):
        for peer, result in ((data or {}).get(section) or {}).items():
            if isinstance(result, dict) and "error" in result:
                rows.append({"where": f"benchmark, {section}", "backend": peer,
                             "error": result["error"]})
    return pd.DataFrame(rows, columns=["where", "backend", "error"])
