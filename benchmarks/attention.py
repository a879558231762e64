"""Attention on a GPU: labkit's Triton kernels against their peers, measured in the same run.

    python benchmarks/attention.py --out results/        # prints ratios, writes CSV + JSON

1. causal prefill B4 H32 S4096 D128 bf16: ours vs SDPA (flash, cuDNN) and FlexAttention, TFLOP/s
2. paged decode B64, 32 q heads over 8 KV heads, 4k context, D128, bf16, block 16: GB/s against
   the device-copy bandwidth measured here, against SDPA flash and FlexAttention over contiguous
   KV, and the fp8 (e4m3) cache at the same shape
3. long-context decode, batch 1..4 at 32k tokens: the split-KV path against no split, and
   against 64-key tiles that load their block ids in the iteration that uses them
4. block size (16..256) x context sweep -> attention_block_sweep.csv
5. the registry's backends called as an engine calls them (input checks, paged gathers, masks
   built per call) at the shapes of 1 and 2: wall time beside the profiler's GPU kernel time

Within a section every peer is timed in the same interleaved rounds (A B C, A B C, ...), so a
drift of the clocks lands on all of them; each keeps its per-round medians (``rounds_us``,
round i of every peer ran together), its median and range, and its ``l2``: what it read its
data from (a working set over twice the L2, or the L2 flushed between samples where a section's
working set fits in twice it: the block sweep's shortest context). A ratio is taken within each
round and reported with its range: ``ratio(a, b)``. A peer that cannot run here is kept with its
error, never silently dropped. ``record()`` returns all of it as a JSON-serialisable dict
(``make record``).
"""
from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import torch

import labkit  # noqa: F401
from labkit.device import describe, free_memory, synchronize
from labkit.measure.bench import flush_needed, l2_statement, save_results
from labkit.measure.rounds import Spread, interleaved

DEV = "cuda"
ROUNDS = 5


def _error(exc: Exception) -> dict:
    return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def timed(peers: dict, bytes_read: dict, rounds: int = ROUNDS, repeats: int = 20) -> dict:
    """Every peer that runs here, timed in the same interleaved rounds: ``{label: {"us", "us_range",
    "rounds_us", "l2"}}``; a peer whose first call raises is ``{"error": ...}``. The first call
    (and the timer's warm-up) is outside the timed region: compiles and autotuning happen there.
    ``bytes_read``: per label, the bytes one call reads; where any fits in twice the L2, every
    peer is timed with the L2 flushed between samples, so the rounds stay comparable."""
    flush = any(flush_needed(bytes_read[label], DEV) for label in peers)
    runnable, out = {}, {}
    for label, make in peers.items():
        try:
            fn = make()  # builds the peer (a graph capture, a compile): may raise
            fn()
            synchronize(DEV)
            runnable[label] = fn
        except Exception as exc:  # noqa: BLE001 (report any peer failure)
            print(f"  {label}: not available ({type(exc).__name__}: {str(exc)[:200]})")
            out[label] = _error(exc)
    if runnable:
        result = interleaved(runnable, rounds=rounds, device=DEV, warmup=3, repeats=repeats,
                             flush_l2=flush)
        for label in runnable:
            s = result.us(label)
            out[label] = {"us": s.median, "us_range": [s.low, s.high], "rounds_us": list(s.values),
                          "l2": l2_statement(bytes_read[label], DEV, flushed=flush)}
    return {label: out[label] for label in peers}


def print_l2(results) -> None:
    """The section's L2 statements, each once."""
    for line in dict.fromkeys(r["l2"] for r in results if isinstance(r, dict) and "l2" in r):
        print(f"  L2: {line}")


def ratio(a: dict, b: dict) -> Spread | None:
    """a's time over b's, within each round (how many times faster b is), or None."""
    if not (isinstance(a, dict) and isinstance(b, dict) and "rounds_us" in a and "rounds_us" in b):
        return None
    return Spread.of([x / y for x, y in zip(a["rounds_us"], b["rounds_us"])])


def _add_rate(result: dict, amount: float, key: str, scale: float) -> None:
    """``result[key]``: ``amount`` per second of its median (and per round), in units of ``scale``."""
    if "us" in result:
        result[key] = amount / (result["us"] * 1e-6) / scale
        result[f"{key}_range"] = [amount / (hi * 1e-6) / scale for hi in result["us_range"][::-1]]


def _now(fn):
    """A peer launched from Python as it stands."""
    return lambda: fn


def _replayed(fn):
    """A peer replayed from a CUDA Graph, like an engine's decode step: no launch cost."""
    def make():
        from labkit.graphs import capture_graph
        graph, _ = capture_graph(fn)
        return graph.replay
    return make


def copy_bandwidth(nbytes: int = 2 * 2**30) -> dict:
    """GB/s of a device-to-device copy (read + write counted): the ceiling decode aims at."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=DEV).normal_()
    dst = torch.empty_like(src)
    res = timed({"copy": _now(lambda: dst.copy_(src))}, {"copy": nbytes})["copy"]
    _add_rate(res, 2 * nbytes, "gbps", 1e9)
    return res


def prefill(B=4, H=32, S=4096, D=128) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from labkit.attention import flash_attention
    dtype = torch.bfloat16
    q, k, v = (torch.randn(B, H, S, D, device=DEV, dtype=dtype) for _ in range(3))
    packed = [x.transpose(1, 2).reshape(B * S, H, D).contiguous() for x in (q, k, v)]
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=DEV)
    flops = 2 * B * H * S * S * D  # causal: half of 4*B*H*S*S*D
    F = torch.nn.functional

    def sdpa(backend):
        def run():
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return run

    def flex():  # the block mask is built once, as for a fixed shape; compiled on first call
        mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, S, S, device=DEV)
        compiled = torch.compile(flex_attention, dynamic=False)
        return lambda: compiled(q, k, v, block_mask=mask)

    peers = {
        # Engines build cu_seqlens themselves, so they skip the checks that read it (host syncs).
        "triton (ours)": _now(lambda: flash_attention(*packed, cu, cu, max_seqlen_q=S,
                                                      check=False)),
        "ours, checked": _now(lambda: flash_attention(*packed, cu, cu)),
        "ours, pointer loads": _now(lambda: flash_attention(*packed, cu, cu, max_seqlen_q=S,
                                                            check=False, tma=False)),
        "sdpa flash": _now(sdpa(SDPBackend.FLASH_ATTENTION)),
        "sdpa cudnn": _now(sdpa(SDPBackend.CUDNN_ATTENTION)),
        "flex": flex,
    }
    res = timed(peers, dict.fromkeys(peers, 3 * B * H * S * D * 2))  # q, k and v
    for r in res.values():
        _add_rate(r, flops, "tflops", 1e12)
    print(f"causal prefill B{B} H{H} S{S} D{D} bf16, {ROUNDS} interleaved rounds")
    print_l2(res.values())
    for name, r in res.items():
        vs = ratio(r, res["triton (ours)"])
        if vs is not None:
            print(f"  {name:<20} {r['us']:>9.1f} us {r['tflops']:>6.1f} TFLOP/s   its time / "
                  f"ours {vs:.2fx}")
    return res


def _paged_inputs(B, Hq, Hkv, ctx, D, block_size, cache_dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_seq = math.ceil(ctx / block_size)
    num_blocks = B * blocks_per_seq
    table = torch.randperm(num_blocks, generator=g).reshape(B, blocks_per_seq).int().to(DEV)
    shape = (num_blocks, block_size, Hkv, D)
    k_cache = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device=DEV, dtype=torch.bfloat16)
    scales = {}
    if cache_dtype != torch.bfloat16:  # per-kv-head scales: amax over everything else
        k_scale = k_cache.float().abs().amax((0, 1, 3)) / 448.0
        v_scale = v_cache.float().abs().amax((0, 1, 3)) / 448.0
        k_cache = (k_cache.float() / k_scale[:, None]).to(cache_dtype)
        v_cache = (v_cache.float() / v_scale[:, None]).to(cache_dtype)
        scales = {"k_scale": k_scale, "v_scale": v_scale}
    q = torch.randn(B, Hq, D, device=DEV, dtype=torch.bfloat16)
    cu = torch.arange(B + 1, dtype=torch.int32, device=DEV)
    seq_lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    kv_bytes = 2 * B * ctx * Hkv * D * k_cache.element_size()
    return (q, k_cache, v_cache, table, cu, seq_lens), scales, kv_bytes


def _paged(args, scales=None, graph: bool = True, **kw):
    """Decode as an engine runs it: replayed from a CUDA Graph (``graph=False``: launched from
    Python, where a short call is bounded by the wrapper's host time, not by the GPU)."""
    from labkit.attention import paged_attention
    kw = {"check": False, "max_query_len": 1, **kw}  # what an engine's decode step would pass
    call = lambda: paged_attention(*args, **(scales or {}), **kw)
    if not graph or kw.get("check"):  # checked calls sync with the host: not capturable
        return _now(call)
    return _replayed(call)


def decode(copy_gbps, B=64, Hq=32, Hkv=8, ctx=4096, D=128, block_size=16) -> dict:
    """Every variant at one shape in one set of rounds, the fp8 cache included: the bf16 decode
    the fp8 ratio divides by is the same measurement as ``auto``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention
    args, _, kv_bytes = _paged_inputs(B, Hq, Hkv, ctx, D, block_size)
    fp8 = {}
    if hasattr(torch, "float8_e4m3fn"):
        fp8["fp8"] = _paged_inputs(B, Hq, Hkv, ctx, D, block_size, torch.float8_e4m3fn)
    peers = {label: _paged(args, **kw) for label, kw in {
        "auto": {}, "auto, launched from Python": {"graph": False},
        "checked": {"check": True, "max_query_len": None},
        "split 2": {"num_splits": 2}, "split 4": {"num_splits": 4},
        "block_n 64, no prefetch": {"tuning": {"block_n": 64, "prefetch": False}},
        "block_n 128 w8": {"tuning": {"block_n": 128, "num_warps": 8}},
        "stages 4": {"tuning": {"num_stages": 4}},
        "stages 2": {"tuning": {"num_stages": 2}}}.items()}
    if fp8:
        f_args, f_scales, _ = fp8["fp8"]
        peers["fp8_e4m3"] = _paged(f_args, f_scales)
        peers["fp8_e4m3_no_prefetch"] = _paged(f_args, f_scales, tuning={"prefetch": False})
    q = args[0].unsqueeze(2)  # [B, Hq, 1, D]
    k, v = (torch.randn(B, Hkv, ctx, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    F = torch.nn.functional

    def sdpa_gqa():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def flex():  # every key visible to the one query: no mask; compiled on first call
        compiled = torch.compile(flex_attention, dynamic=False)
        return lambda: compiled(q, k, v, enable_gqa=True)

    peers["sdpa flash"] = _replayed(sdpa_gqa)
    peers["flex"] = flex
    # every peer reads the whole cache (fp8: half the bytes); q and the tables are small
    reads = {label: kv_bytes // (2 if label.startswith("fp8") else 1) for label in peers}
    res = {"kv_bytes": kv_bytes, "copy_gbps": copy_gbps, **timed(peers, reads)}
    for label in peers:
        _add_rate(res[label], kv_bytes // (2 if label.startswith("fp8") else 1), "gbps", 1e9)
        _add_rate(res[label], B, "tokens_per_s", 1)
    print(f"paged decode B{B} GQA {Hq}/{Hkv} ctx {ctx} D{D} bf16 block {block_size}: copy "
          f"bandwidth {copy_gbps:.0f} GB/s, {ROUNDS} interleaved rounds")
    print_l2(res[name] for name in peers)
    for name in peers:
        r = res[name]
        if "us" in r:
            vs = ratio(res["sdpa flash"], r)
            print(f"  {name:<27} {r['us']:>8.1f} us {r['gbps']:>7.0f} GB/s = "
                  f"{r['gbps'] / copy_gbps:.0%} of copy"
                  + (f", sdpa flash time / its time {vs:.2fx}" if vs else ""))
    return res


def fp8_of(decode_res: dict) -> dict:
    """The fp8 comparison, read from the decode section's rounds (one bf16 measurement)."""
    bf16, f8, f8_np = (decode_res.get(k) for k in ("auto", "fp8_e4m3", "fp8_e4m3_no_prefetch"))
    speedup, no_prefetch = ratio(bf16, f8), ratio(bf16, f8_np)
    if speedup is None:
        return {"error": (f8 or {}).get("error", "no fp8 cache decode measured")}
    res = {"bf16": bf16, "fp8_e4m3": f8, "fp8_e4m3_no_prefetch": f8_np,
           "bf16_is": "decode/auto", "speedup": speedup.median,
           "speedup_range": [speedup.low, speedup.high]}
    if no_prefetch is not None:
        res["speedup_no_prefetch"] = no_prefetch.median
        res["speedup_no_prefetch_range"] = [no_prefetch.low, no_prefetch.high]
    print(f"fp8 cache decode: {f8['us']:.1f} us vs bf16 {bf16['us']:.1f} us = {speedup:.2fx}")
    return res


def long_context(copy_gbps, ctx=32768, Hq=32, Hkv=8, D=128) -> dict:
    res = {}
    print(f"long-context decode ctx {ctx} GQA {Hq}/{Hkv} D{D} bf16 block 16, {ROUNDS} rounds")
    for B in (1, 2, 4):
        args, _, kv_bytes = _paged_inputs(B, Hq, Hkv, ctx, D, 16)
        peers = {f"B{B} {label}": _paged(args, **kw) for label, kw in {
            "split (auto)": {}, "no split": {"num_splits": 1},
            "split, 64-key tiles, no prefetch": {"tuning": {"block_n": 64, "prefetch": False}},
            "split, launched from Python": {"graph": False}}.items()}
        for label, r in timed(peers, dict.fromkeys(peers, kv_bytes)).items():
            _add_rate(r, kv_bytes, "gbps", 1e9)
            res[label] = r
            if "us" in r:
                print(f"  {label:<32} {r['us']:>8.1f} us {r['gbps']:>7.0f} GB/s "
                      f"= {r['gbps'] / copy_gbps:.0%} of copy; L2: {r['l2']}")
        free_memory(DEV)
    return res


def block_sweep(copy_gbps, out_dir: Path | None, B=16, Hq=32, Hkv=8, D=128) -> list[dict]:
    rows = []
    for ctx in (1024, 4096, 16384):  # the block sizes of one context in the same rounds
        inputs = {bs: _paged_inputs(B, Hq, Hkv, ctx, D, bs) for bs in (16, 32, 64, 128, 256)}
        res = timed({bs: _paged(args) for bs, (args, _, _) in inputs.items()},
                    {bs: kv_bytes for bs, (_, _, kv_bytes) in inputs.items()}, rounds=3)
        for bs, (_, _, kv_bytes) in inputs.items():
            r = res[bs]
            if "us" not in r:
                continue
            _add_rate(r, kv_bytes, "gbps", 1e9)
            rows.append({"block_size": bs, "context": ctx, "batch": B, "us": round(r["us"], 2),
                         "us_low": round(r["us_range"][0], 2),
                         "us_high": round(r["us_range"][1], 2), "gbps": round(r["gbps"], 1),
                         "fraction_of_copy": round(r["gbps"] / copy_gbps, 3), "l2": r["l2"]})
        del inputs
        free_memory(DEV)
    rows.sort(key=lambda r: (r["block_size"], r["context"]))
    print(f"block-size sweep (B{B} GQA {Hq}/{Hkv} D{D} bf16), GB/s:")
    for r in rows:
        print(f"  block {r['block_size']:>3} ctx {r['context']:>6}: {r['gbps']:>7.0f} GB/s "
              f"({r['fraction_of_copy']:.0%} of copy); L2: {r['l2']}")
    if out_dir is not None and rows:
        with open(out_dir / "attention_block_sweep.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return rows


def registry() -> list[dict]:
    """The registry's backends at the prefill and decode shapes, called as an engine calls them."""
    from labkit.lessons.attention_backends import roofline as rl
    from labkit.tools.recorded import json_columns
    workloads = [rl.prefill_workload(), rl.decode_workload()]
    table = rl.registry_points(workloads, DEV)
    # not flushed: each workload's least traffic is over twice the L2 (l2_statement refuses less)
    table["l2"] = table.workload.map({w.name: l2_statement(w.bytes_moved(), DEV)
                                      for w in workloads})
    print(table.drop(columns=["timing"], errors="ignore").to_string())
    return json_columns(table)


def run(out_dir: Path | None = None, with_registry: bool = True) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU; on CPU see the recorded "
                         "figures: labkit.tools.recorded.load('attention_backends')")
    print(describe())
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    copy = copy_bandwidth()
    copy_gbps = copy["gbps"]
    results = {"copy_gbps": copy_gbps, "copy": copy, "rounds": ROUNDS}
    steps = [("prefill", prefill), ("decode", lambda: decode(copy_gbps)),
             ("fp8", lambda: fp8_of(results["decode"])),
             ("long_context", lambda: long_context(copy_gbps)),
             ("block_sweep", lambda: block_sweep(copy_gbps, out_dir))]
    if with_registry:
        steps.append(("registry", registry))
    for name, step in steps:
        try:
            results[name] = step()
        except Exception as exc:  # noqa: BLE001  (one failed section must not hide the others)
            print(f"{name}: FAILED ({type(exc).__name__}: {exc})")
            results[name] = _error(exc)
        free_memory(DEV)
    save_results(out_dir, "attention.json", results)
    return results


def record() -> dict:
    """For ``make record``: every figure above, as plain data."""
    return run(None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for the CSV and JSON")
    run(parser.parse_args().out)
