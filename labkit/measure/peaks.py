"""The machine's two ceilings: memory-copy bandwidth and matrix-multiply throughput.

Every later figure is read against these: a memory-bound kernel is judged by the fraction of
copy bandwidth it reaches, a compute-bound one by the fraction of the matmul rate.
"""
from __future__ import annotations

import torch

from labkit.measure import bench
from labkit.device import select_device


def copy_bandwidth(device="auto", nbytes: int = 2**30) -> float:
    """Device-to-device copy in GB/s, counting bytes read plus bytes written."""
    dev = select_device(device)
    src = torch.randn(nbytes // 4, device=dev)
    dst = torch.empty_like(src)
    t = bench.measure(lambda: dst.copy_(src), device=dev, warmup=3, repeats=20)
    return bench.gbps(2 * nbytes, t)


def matmul_tflops(device="auto", n: int = 8192, dtype: torch.dtype | None = None) -> float:
    """An n x n x n product on random data (zeros run faster and would flatter the ceiling)."""
    dev = select_device(device)
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    t = bench.measure(lambda: a @ b, device=dev, warmup=3, repeats=10)
    return bench.tflops(2 * n**3, t)


def ceilings(device="auto", quick: bool = False) -> dict:
    """Both ceilings on ``device``: copy GB/s and matmul TFLOP/s (``quick``: small sizes)."""
    dev = select_device(device)
    big = dev.type == "cuda" and not quick
    return {
        "copy_GBps": copy_bandwidth(dev, 2**30 if big else 2**26),
        "matmul_TFLOPs": matmul_tflops(dev, 8192 if big else 1024),
        "matmul_dtype": "bfloat16" if dev.type == "cuda" else "float32",
        "device": str(dev),
    }


def record() -> dict:
    return ceilings("cuda")
