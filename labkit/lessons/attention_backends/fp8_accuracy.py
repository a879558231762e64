"""What an fp8 KV cache costs in accuracy, apart from the kernel that reads it.

The correctness check compares an fp8 backend with the reference over the same dequantised
cache, so it sees the kernel's error only. Here one set of K/V values drawn in float32 (the
"true" cache) is stored in bf16 and in fp8 e4m3 with a scale per KV head, and each cache's
attention output is compared with float64 attention over the float32 values.
"""
from __future__ import annotations

import math
from itertools import accumulate

import pandas as pd
import torch

from labkit.attention.backends import BACKENDS
from labkit.attention.reference import paged_attention_ref
from labkit.attention.selection import AttentionSpec, reasons_against
from labkit.lessons.attention_backends.compare import FP8, AttentionWorkload


def fp8_cache_error(w: AttentionWorkload, device: str = "cpu", seeds=range(5)) -> pd.DataFrame:
    """What storing the cache in fp8 costs in accuracy, one row per seed and path.

    K and V are drawn in float32 (the "true" values) and stored three ways: as they are, in
    bf16, and in fp8 e4m3 with a scale per KV head (what ``AttentionWorkload.make`` does). The
    queries are bf16 throughout, so only the cache's storage differs. ``path="reference"``
    attends in float64 (``paged_attention_ref``) over each stored cache: the storage's error
    alone, on any machine. ``path="triton"`` runs labkit's kernel on the bf16 and fp8 caches
    on a GPU that ``reasons_against`` lets it serve (in Triton's interpreter the kernel's bf16
    and fp8 arithmetic is not the GPU's, so a CPU run measures the reference path only).
    Errors are relative (``|out - ref| / |ref|``, Frobenius norms) against the float64
    attention over the float32 cache, and fp8 against bf16 on the same path."""
    rows = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        cu_q = torch.tensor([0, *accumulate(w.lens_q)], dtype=torch.int32)
        q = torch.randn(sum(w.lens_q), w.num_q_heads, w.head_dim, generator=g).bfloat16()
        width = max(1, max(math.ceil(n / w.block_size) for n in w.seq_lens))
        num_blocks = len(w.seq_lens) * width
        table = torch.randperm(num_blocks, generator=g).reshape(len(w.seq_lens), width).int()
        shape = (num_blocks, w.block_size, w.num_kv_heads, w.head_dim)
        k, v = (torch.randn(shape, generator=g) for _ in range(2))
        scales = [c.abs().amax((0, 1, 3)) / 448.0 for c in (k, v)]  # e4m3's largest is 448
        fp8 = [(c / s[:, None]).to(FP8) for c, s in zip((k, v), scales)]
        lens = torch.tensor(w.seq_lens, dtype=torch.int32)
        kw = {"causal": w.causal, "window": w.window}
        exact = paged_attention_ref(q, k, v, table, cu_q, lens, **kw)
        caches = {"bf16": ((k.bfloat16(), v.bfloat16()), {}),
                  "fp8_e4m3": (tuple(fp8), {"k_scale": scales[0], "v_scale": scales[1]})}
        paths = {"reference": None}
        spec = AttentionSpec(w.num_q_heads, w.num_kv_heads, w.head_dim, torch.bfloat16,
                             kv_cache_dtype="fp8_e4m3", kv_scale="per_kv_head",
                             block_size=w.block_size, device=device,
                             compute_capability=(torch.cuda.get_device_capability()
                                                 if device == "cuda" else None))
        if device == "cuda" and not reasons_against(BACKENDS["triton"], spec):
            paths["triton"] = BACKENDS["triton"]
        for path, backend in paths.items():
            out = {}
            for cache, ((kc, vc), scale) in caches.items():
                if backend is None:
                    out[cache] = paged_attention_ref(q, kc, vc, table, cu_q, lens, **kw, **scale)
                else:
                    args = (q, kc, vc, table, cu_q, lens)
                    out[cache] = backend.paged(*(a.to(device) for a in args), **kw, **{
                        n: t.to(device) for n, t in scale.items()}).double().cpu()

            def rel(a, b):
                return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
            rows.append({"seed": seed, "path": path,
                         "bf16_vs_float64": rel(out["bf16"], exact),
                         "fp8_vs_float64": rel(out["fp8_e4m3"], exact),
                         "fp8_vs_bf16": rel(out["fp8_e4m3"], out["bf16"])})
    return pd.DataFrame(rows)
