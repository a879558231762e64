"""Backends side by side: the same workload through each, checked against the reference, timed,
and placed on a roofline by the bytes it must move and the FLOPs it must do.

An ``AttentionWorkload`` is a batch of sequences: ``lens_q`` new tokens over ``seq_lens`` keys
each, run through the paged entry point (``paged=True``, a cache of ``block_size`` blocks) or
the packed one (contiguous K/V). ``check_backends`` and ``time_registry`` return pandas tables;
``tile_io`` and ``attention_io`` are the arithmetic behind FlashAttention's IO argument;
``mla_cache_bytes`` what a latent cache saves.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from itertools import accumulate

import pandas as pd
import torch

from labkit.attention.backends import BACKENDS, PRIORITY
from labkit.attention.reference import flash_attention_ref, paged_attention_ref
from labkit.attention.selection import AttentionSpec, reasons_against
from labkit.measure.rounds import interleaved

FP8 = getattr(torch, "float8_e4m3fn", None)


@dataclass(frozen=True)
class AttentionWorkload:
    lens_q: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_q_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 64
    dtype: torch.dtype = torch.float32
    paged: bool = True
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    causal: bool = True
    window: int | None = None
    name: str = field(default="", compare=False)

    def __post_init__(self):
        if len(self.lens_q) != len(self.seq_lens) or not self.lens_q:
            raise ValueError(f"lens_q and seq_lens need one entry per sequence, got "
                             f"{len(self.lens_q)} and {len(self.seq_lens)}")
        bad = [(q, k) for q, k in zip(self.lens_q, self.seq_lens)
               if q < 0 or (self.paged and q > k)]
        if bad:
            raise ValueError(f"each sequence needs 0 <= new tokens <= seq_len (the cache holds "
                             f"the new tokens too); got {bad}")
        if self.kv_cache_dtype != "auto" and not self.paged:
            raise ValueError("a quantised KV cache needs paged=True")

    def spec(self, device: str) -> AttentionSpec:
        cc = None
        if device == "cuda" and torch.cuda.is_available():
            cc = torch.cuda.get_device_capability()
        return AttentionSpec(
            self.num_q_heads, self.num_kv_heads, self.head_dim, dtype=self.dtype,
            sliding_window=self.window, kv_cache_dtype=self.kv_cache_dtype,
            kv_scale="none" if self.kv_cache_dtype == "auto" else "per_kv_head",
            block_size=self.block_size if self.paged else None, device=device,
            compute_capability=cc)

    def visible_keys(self) -> int:
        """Query-key pairs that survive the mask, summed over sequences and queries."""
        total = 0
        for len_q, len_k in zip(self.lens_q, self.seq_lens):
            for i in range(len_q):
                pos = len_k - len_q + i
                hi = min(len_k, pos + 1) if self.causal else len_k
                lo = max(0, pos - self.window + 1) if self.window else 0
                total += max(0, hi - lo)
        return total

    def flops(self) -> int:
        return 4 * self.visible_keys() * self.num_q_heads * self.head_dim  # QK^T and PV

    def bytes_moved(self) -> int:
        """The least HBM traffic: every needed key/value once, queries in, outputs out."""
        kv_elem = 1 if self.kv_cache_dtype == "fp8_e4m3" else torch.finfo(self.dtype).bits // 8
        elem = torch.finfo(self.dtype).bits // 8
        kv = 2 * sum(self.seq_lens) * self.num_kv_heads * self.head_dim * kv_elem
        return kv + 2 * sum(self.lens_q) * self.num_q_heads * self.head_dim * elem

    def make(self, device: str, seed: int) -> tuple[tuple, dict]:
        """(positional args, keyword args) for ``backend.paged`` or ``backend.flash``."""
        g = torch.Generator().manual_seed(seed)
        cu_q = torch.tensor([0, *accumulate(self.lens_q)], dtype=torch.int32)
        q = torch.randn(sum(self.lens_q), self.num_q_heads, self.head_dim, generator=g)
        kw = {"causal": self.causal, "window": self.window}
        if not self.paged:
            cu_k = torch.tensor([0, *accumulate(self.seq_lens)], dtype=torch.int32)
            k, v = (torch.randn(sum(self.seq_lens), self.num_kv_heads, self.head_dim,
                                generator=g) for _ in range(2))
            args = (q.to(self.dtype), k.to(self.dtype), v.to(self.dtype), cu_q, cu_k)
            return tuple(a.to(device) for a in args), kw
        width = max(1, max(math.ceil(n / self.block_size) for n in self.seq_lens))
        num_blocks = len(self.seq_lens) * width
        table = torch.randperm(num_blocks, generator=g).reshape(len(self.seq_lens), width).int()
        shape = (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = (torch.randn(shape, generator=g).to(self.dtype) for _ in range(2))
        if self.kv_cache_dtype == "fp8_e4m3":
            scales = [c.float().abs().amax((0, 1, 3)) / 448.0 for c in (k_cache, v_cache)]
            k_cache, v_cache = ((c.float() / s[:, None]).to(FP8)
                                for c, s in zip((k_cache, v_cache), scales))
            kw.update(k_scale=scales[0].to(device), v_scale=scales[1].to(device))
        lens = torch.tensor(self.seq_lens, dtype=torch.int32)
        args = (q.to(self.dtype), k_cache, v_cache, table, cu_q, lens)
        return tuple(a.to(device) for a in args), kw


def _run(name: str, w: AttentionWorkload, args, kw):
    backend = BACKENDS[name]
    return backend.paged(*args, **kw) if w.paged else backend.flash(*args, **kw)


def check_backends(w: AttentionWorkload, device: str = "cpu",
                   seed: int | None = None) -> pd.DataFrame:
    """Each backend's error against the float64 reference on fresh inputs (rerun: new seed)."""
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else seed
    args, kw = w.make(device, seed)
    ref = (paged_attention_ref if w.paged else flash_attention_ref)(*args, **kw)
    rows = []
    for name in PRIORITY:
        why = reasons_against(BACKENDS[name], w.spec(device))
        row = {"backend": name, "compatible": not why, "reasons": "; ".join(why), "seed": seed,
               "max_abs_error": None, "relative_error": None}
        if not why:
            diff = _run(name, w, args, kw).double() - ref
            row["max_abs_error"] = diff.abs().max().item() if diff.numel() else 0.0
            row["relative_error"] = (diff.norm() / ref.norm().clamp_min(1e-30)).item()
        rows.append(row)
    return pd.DataFrame(rows)


def time_registry(w: AttentionWorkload, device: str = "cpu", *, rounds: int = 3,
                  repeats: int = 5, warmup: int = 1,
                  names: tuple[str, ...] | None = None) -> pd.DataFrame:
    """Each compatible backend of the registry called as an engine calls it (its input checks,
    paged gathers and masks included), timed in the same interleaved rounds: the median wall
    time with its range, as TFLOP/s, GB/s and FLOPs per byte. On a GPU the profiler's GPU kernel
    time of one call sits beside it (``gpu_us``): where it is far below the wall time, the call
    is bound by the host. A backend whose first call raises is a row with its ``error`` (a limit
    shown, not a time)."""
    args, kw = w.make(device, 0)
    runnable, failed = {}, []
    for name in names or PRIORITY:
        if reasons_against(BACKENDS[name], w.spec(device)):
            continue  # the compatibility matrix says why
        call = functools.partial(_run, name, w, args, kw)
        try:
            call()  # first call outside the timed region: compiles and autotuning happen here
            runnable[name] = call
        except Exception as exc:  # noqa: BLE001 (a backend that fails is reported, not dropped)
            failed.append({"workload": w.name, "backend": name,
                           "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
    rows = []
    if runnable:
        timed = interleaved(runnable, rounds=rounds, device=device, warmup=warmup,
                            repeats=repeats)
        for name, call in runnable.items():
            s = timed.us(name)
            gpu_us, kernels = _gpu_time(call, device)
            seconds = s.median * 1e-6
            rows.append({"workload": w.name, "backend": name, "us": s.median, "us_low": s.low,
                         "us_high": s.high, "rounds": s.rounds, "gpu_us": gpu_us,
                         "kernels": kernels, "tflops": w.flops() / seconds / 1e12,
                         "gbps": w.bytes_moved() / seconds / 1e9,
                         "flops_per_byte": w.flops() / w.bytes_moved(), "error": None})
    return registry_table(rows + failed)


REGISTRY_COLUMNS = ["workload", "backend", "us", "us_low", "us_high", "rounds", "gpu_us",
                    "kernels", "tflops", "gbps", "flops_per_byte", "error"]
REGISTRY_COUNTS = ["rounds", "kernels"]


def registry_table(rows) -> pd.DataFrame:
    """``time_registry``'s table from its rows (a list of dicts, a recording's columns, or a
    table): the counts as integers (pandas ``Int64``), missing where a backend raised or
    where there is no GPU lane. Without the cast one row with no count turns a column of kernel
    counts into floats (``21.0``)."""
    table = pd.DataFrame(rows)
    table = table.reindex(columns=REGISTRY_COLUMNS)
    return table.astype({c: "Int64" for c in REGISTRY_COUNTS})


def _gpu_time(call, device: str) -> tuple[float | None, int | None]:
    """GPU kernel time of one call (the union of its kernels on the profiler's GPU lanes) and its
    kernel count; (None, None) on a CPU, where there is no GPU lane."""
    if device != "cuda":
        return None, None
    from labkit.measure.profile import trace
    summary = trace(call, device=device, warmup=0).summary
    return summary.get("gpu_busy_us"), summary.get("kernel_count")


def tile_io(block_m: int, block_n: int, head_dim: int, elem_bytes: int = 2) -> dict:
    """One query tile of ``flash_attention``: what stays on chip, what crosses HBM per K/V tile."""
    resident = block_m * head_dim * elem_bytes + block_m * head_dim * 4 + 2 * block_m * 4
    streamed = 2 * block_n * head_dim * elem_bytes  # one K tile and one V tile
    flops = 4 * block_m * block_n * head_dim  # S = Q K^T and O += P V
    return {"resident_bytes": resident, "streamed_bytes_per_tile": streamed,
            "flops_per_tile": flops, "flops_per_byte": flops / streamed}


def tile_table(tiles: list[tuple[int, int]], head_dim: int, tried=frozenset()) -> pd.DataFrame:
    """``tile_io`` for each ``(BLOCK_M, BLOCK_N)`` of ``tiles``, one row each; ``tried``: the tiles
    this machine's autotuner list holds. The sizes and byte and FLOP counts are integers."""
    rows = [{"BLOCK_M": m, "BLOCK_N": n, "tried here": (m, n) in tried} | tile_io(m, n, head_dim)
            for m, n in tiles]
    counts = ["BLOCK_M", "BLOCK_N", "resident_bytes", "streamed_bytes_per_tile", "flops_per_tile"]
    return pd.DataFrame(rows).astype({c: "int64" for c in counts})


def attention_io(len_q: int, len_k: int, num_heads: int, head_dim: int, block_m: int = 128,
                 elem_bytes: int = 2, block_n: int = 64) -> dict:
    """HBM bytes of one head-batch of attention: naive (scores written and read back) vs tiled
    (no scores in HBM, but K/V read once per query tile).

    ``causal_*``: the tiled kernel with the causal mask, which stops each query tile's key loop
    at the diagonal (``flash_fwd_kernel``'s ``hi``), so the key tiles above it are neither read
    nor computed. ``*_memory_bytes``: what must sit in HBM during the call, naive with one
    ``[len_q, len_k]`` score matrix per head, tiled with Q, K, V and O only."""
    qo = 2 * len_q * head_dim * elem_bytes
    kv = 2 * len_k * head_dim * elem_bytes
    scores = len_q * len_k * elem_bytes
    naive = qo + kv + 4 * scores  # S written, read for softmax, P written, read for PV
    query_tiles = math.ceil(len_q / block_m)
    tiled = qo + kv * query_tiles
    flops = 4 * len_q * len_k * head_dim
    keys_read = 0  # per head, summed over query tiles, whole key tiles as the kernel loads them
    causal_flops = 0
    for t in range(query_tiles):
        rows = min(block_m, len_q - t * block_m)
        hi = min(len_k, len_k - len_q + t * block_m + rows)  # one past the tile's last position
        keys = min(len_k, math.ceil(max(hi, 0) / block_n) * block_n)
        keys_read += keys
        causal_flops += 4 * block_m * keys * head_dim  # whole tiles, masked lanes included
    causal_tiled = qo + 2 * keys_read * head_dim * elem_bytes
    full_flops = 4 * block_m * query_tiles * math.ceil(len_k / block_n) * block_n * head_dim
    return {"naive_bytes": naive * num_heads, "tiled_bytes": tiled * num_heads,
            "flops": flops * num_heads, "naive_flops_per_byte": flops / naive,
            "tiled_flops_per_byte": flops / tiled,
            "causal_tiled_bytes": causal_tiled * num_heads,
            "tiled_flops_computed": full_flops * num_heads,
            "causal_flops_computed": causal_flops * num_heads,
            "naive_memory_bytes": (qo + kv + scores) * num_heads,
            "tiled_memory_bytes": (qo + kv) * num_heads}


def mla_cache_bytes(num_q_heads: int, latent: int, rope: int, qk_nope: int, v_head: int,
                    elem_bytes: int = 2) -> dict:
    """KV-cache bytes per token and layer: MLA's one shared latent (``latent`` compressed K/V +
    ``rope`` decoupled RoPE key) against per-head K (``qk_nope + rope`` wide) and V (``v_head``)
    for every query head, what the same attention would cache without compression."""
    mla = (latent + rope) * elem_bytes
    per_head = num_q_heads * (qk_nope + rope + v_head) * elem_bytes
    return {"mla_bytes": mla, "per_head_bytes": per_head, "ratio": per_head / mla}
