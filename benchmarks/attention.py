"""Attention on a GPU: labkit's Triton kernels against their peers, measured in the same run.

    python benchmarks/attention.py --out results/        # prints ratios, writes CSV + JSON

1. causal prefill B4 H32 S4096 D128 bf16: ours vs SDPA (flash, cuDNN) and FlexAttention, TFLOP/s
2. paged decode B64, 32 q heads over 8 KV heads, 4k context, D128, bf16, block 16: GB/s against
   the device-copy bandwidth measured here, and against SDPA flash over contiguous KV
3. long-context decode, batch 1..4 at 32k tokens: the split-KV path against no split
4. fp8 (e4m3) cache decode against bf16 at the shape of 2
5. block size (16..256) x context sweep -> attention_block_sweep.csv
``record()`` returns all of it as a JSON-serialisable dict (``make record``).
"""
from __future__ import annotations

import argparse
import csv
import functools
import json
import math
import statistics
from pathlib import Path

import torch

import labkit  # noqa: F401
from labkit.measure.bench import gbps, measure, tflops
from labkit.device import describe, fingerprint, free_memory, synchronize

DEV = "cuda"


def _time(fn, repeats=20):
    return measure(fn, device=DEV, warmup=3, repeats=repeats)


def copy_bandwidth(nbytes: int = 2 * 2**30) -> float:
    """GB/s of a device-to-device copy (read + write counted): the ceiling decode aims at."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=DEV).normal_()
    dst = torch.empty_like(src)
    return gbps(2 * nbytes, _time(lambda: dst.copy_(src)))


def _try(label, fn, graph: bool = False):
    """A peer that cannot run here is reported as such, never silently dropped. ``graph``:
    time it replayed from a CUDA Graph, like our decode kernel, so neither pays launch cost."""
    try:
        fn()
        synchronize(DEV)
        if graph:
            from labkit.graphs import capture_graph
            fn = capture_graph(fn)[0].replay
        return _time(fn)
    except Exception as exc:  # noqa: BLE001 (report any peer failure)
        print(f"  {label}: not available ({type(exc).__name__}: {str(exc)[:120]})")
        return None


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

    mask = create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, S, S, device=DEV)
    flex = torch.compile(flex_attention, dynamic=False)
    peers = {
        # Engines build cu_seqlens themselves, so they skip the checks that read it (host syncs).
        "triton (ours)": lambda: flash_attention(*packed, cu, cu, max_seqlen_q=S, check=False),
        "ours, checked": lambda: flash_attention(*packed, cu, cu),
        "ours, pointer loads": lambda: flash_attention(*packed, cu, cu, max_seqlen_q=S,
                                                       check=False, tma=False),
        "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "flex": lambda: flex(q, k, v, block_mask=mask),
    }
    res = {}
    for name, fn in peers.items():
        t = _try(name, fn)
        res[name] = None if t is None else {"us": t.median_us, "tflops": tflops(flops, t)}
    ours = res["triton (ours)"]["us"]
    print(f"causal prefill B{B} H{H} S{S} D{D} bf16")
    for name, r in res.items():
        if r:
            print(f"  {name:<20} {r['us']:>9.1f} us {r['tflops']:>6.1f} TFLOP/s   ours is "
                  f"{r['us'] / ours:.2f}x its speed")
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


def _paged_time(args, scales, graph: bool = True, **kw):
    """Decode as an engine runs it: replayed from a CUDA Graph (``graph=False``: launched from
    Python, where a short call is bounded by the wrapper's host time, not by the GPU)."""
    from labkit.attention import paged_attention
    from labkit.graphs import capture_graph
    kw = {"check": False, "max_query_len": 1, **kw}  # what an engine's decode step would pass
    call = lambda: paged_attention(*args, **scales, **kw)  # noqa: E731
    if not graph or kw.get("check"):  # checked calls sync with the host: not capturable
        return _time(call)
    replay = capture_graph(call)[0].replay
    return _time(replay)


def decode(copy_gbps, B=64, Hq=32, Hkv=8, ctx=4096, D=128, block_size=16) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    args, _, kv_bytes = _paged_inputs(B, Hq, Hkv, ctx, D, block_size)
    res = {"kv_bytes": kv_bytes, "copy_gbps": copy_gbps}
    for label, kw in {"auto": {}, "auto, launched from Python": {"graph": False},
                      "checked": {"check": True, "max_query_len": None},
                      "split 2": {"num_splits": 2}, "split 4": {"num_splits": 4},
                      "block_n 32": {"tuning": {"block_n": 32}},
                      "block_n 128 w8": {"tuning": {"block_n": 128, "num_warps": 8}},
                      "stages 4": {"tuning": {"num_stages": 4}},
                      "stages 2": {"tuning": {"num_stages": 2}}}.items():
        t = _paged_time(args, {}, **kw)
        res[label] = {"us": t.median_us, "gbps": gbps(kv_bytes, t)}
    q = args[0].unsqueeze(2)  # [B, Hq, 1, D]
    k, v = (torch.randn(B, Hkv, ctx, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    F = torch.nn.functional
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        t = _try("sdpa flash (enable_gqa)",
                 lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), graph=True)
    if t is None:  # older torch: no GQA in the flash kernel, so give it the heads repeated
        k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            t = _try("sdpa flash (kv repeated)",
                     lambda: F.scaled_dot_product_attention(q, k, v), graph=True)
    res["sdpa flash"] = None if t is None else {"us": t.median_us, "gbps": gbps(kv_bytes, t)}
    print(f"paged decode B{B} GQA {Hq}/{Hkv} ctx {ctx} D{D} bf16 block {block_size}: "
          f"copy bandwidth {copy_gbps:.0f} GB/s")
    for name, r in res.items():
        if isinstance(r, dict):
            sd = res["sdpa flash"]
            vs = f", sdpa flash time / ours {sd['us'] / r['us']:.2f}x" if sd else ""
            print(f"  {name:<27} {r['us']:>8.1f} us {r['gbps']:>7.0f} GB/s = "
                  f"{r['gbps'] / copy_gbps:.0%} of copy{vs}")
    return res


def long_context(copy_gbps, ctx=32768, Hq=32, Hkv=8, D=128) -> dict:
    res = {}
    print(f"long-context decode ctx {ctx} GQA {Hq}/{Hkv} D{D} bf16 block 16")
    for B in (1, 2, 4):
        args, _, kv_bytes = _paged_inputs(B, Hq, Hkv, ctx, D, 16)
        for label, kw in {"split (auto)": {}, "no split": {"num_splits": 1},
                          "split, launched from Python": {"graph": False}}.items():
            t = _paged_time(args, {}, **kw)
            res[f"B{B} {label}"] = {"us": t.median_us, "gbps": gbps(kv_bytes, t)}
            print(f"  B{B} {label:<28} {t.median_us:>8.1f} us {gbps(kv_bytes, t):>7.0f} GB/s "
                  f"= {gbps(kv_bytes, t) / copy_gbps:.0%} of copy")
    return res


def fp8_decode(B=64, Hq=32, Hkv=8, ctx=4096, D=128, rounds=5) -> dict:
    """bf16 against fp8 (e4m3) caches at one shape, and fp8 without the block-id prefetch.

    The three are timed in turn, ``rounds`` times over, and each keeps its median round: the
    fp8 kernel is bound by the SMs more than the bf16 one, so a drift in clocks during the run
    would otherwise land on whichever was timed last."""
    from labkit.attention import paged_attention
    from labkit.graphs import capture_graph
    variants = {}
    for name, dt, tuning in (("bf16", torch.bfloat16, None),
                             ("fp8_e4m3", torch.float8_e4m3fn, None),
                             ("fp8_e4m3_no_prefetch", torch.float8_e4m3fn, {"prefetch": False})):
        args, scales, kv_bytes = _paged_inputs(B, Hq, Hkv, ctx, D, 16, cache_dtype=dt)
        call = functools.partial(paged_attention, *args, **scales, check=False,
                                 max_query_len=1, tuning=tuning)
        variants[name] = (capture_graph(call)[0].replay, kv_bytes, args)  # args: keep alive
    rounds_us = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (replay, _, _) in variants.items():
            rounds_us[name].append(_time(replay).median_us)
    res = {}
    for name, (_, kv_bytes, _) in variants.items():
        us = statistics.median(rounds_us[name])
        res[name] = {"us": us, "gbps": kv_bytes / (us * 1e-6) / 1e9,
                     "tokens_per_s": B / (us * 1e-6), "rounds_us": rounds_us[name]}
    res["speedup"] = res["bf16"]["us"] / res["fp8_e4m3"]["us"]
    res["speedup_no_prefetch"] = res["bf16"]["us"] / res["fp8_e4m3_no_prefetch"]["us"]
    spread = [b / f for b, f in zip(rounds_us["bf16"], rounds_us["fp8_e4m3"])]
    res["speedup_range"] = [min(spread), max(spread)]
    print(f"fp8 cache decode B{B} ctx {ctx}: {res['fp8_e4m3']['us']:.1f} us vs bf16 "
          f"{res['bf16']['us']:.1f} us = {res['speedup']:.2f}x (rounds {min(spread):.2f}-"
          f"{max(spread):.2f}x; without the block-id prefetch "
          f"{res['fp8_e4m3_no_prefetch']['us']:.1f} us = {res['speedup_no_prefetch']:.2f}x)")
    return res


def block_sweep(copy_gbps, out_dir: Path | None, B=16, Hq=32, Hkv=8, D=128) -> list[dict]:
    rows = []
    for block_size in (16, 32, 64, 128, 256):
        for ctx in (1024, 4096, 16384):
            args, _, kv_bytes = _paged_inputs(B, Hq, Hkv, ctx, D, block_size)
            t = _paged_time(args, {})
            rows.append({"block_size": block_size, "context": ctx, "batch": B,
                         "us": round(t.median_us, 2), "gbps": round(gbps(kv_bytes, t), 1),
                         "fraction_of_copy": round(gbps(kv_bytes, t) / copy_gbps, 3)})
    print(f"block-size sweep (B{B} GQA {Hq}/{Hkv} D{D} bf16), GB/s:")
    for r in rows:
        print(f"  block {r['block_size']:>3} ctx {r['context']:>6}: {r['gbps']:>7.0f} GB/s "
              f"({r['fraction_of_copy']:.0%} of copy)")
    if out_dir is not None:
        with open(out_dir / "attention_block_sweep.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return rows


def run(out_dir: Path | None = None) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/attention.py needs a CUDA GPU; on CPU see the recorded "
                         "figures: labkit.tools.recorded.load('attention_backends')")
    print(describe())
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    copy_gbps = copy_bandwidth()
    results = {"copy_gbps": copy_gbps}
    for name, step in (("prefill", prefill), ("decode", lambda: decode(copy_gbps)),
                       ("long_context", lambda: long_context(copy_gbps)),
                       ("fp8", fp8_decode),
                       ("block_sweep", lambda: block_sweep(copy_gbps, out_dir))):
        try:
            results[name] = step()
        except Exception as exc:  # noqa: BLE001  (one failed section must not hide the others)
            print(f"{name}: FAILED ({type(exc).__name__}: {exc})")
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        free_memory(DEV)
    if out_dir is not None:
        (out_dir / "attention.json").write_text(json.dumps(
            {"fingerprint": fingerprint(), "results": results}, indent=1))
    return results


def record() -> dict:
    """For ``make record``: every figure above, as plain data."""
    return run(None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help="folder for the CSV and JSON")
    run(parser.parse_args().out)
