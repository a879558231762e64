"""fp8 (e4m3) KV-cache scales, through labkit's real fp8 cache (:class:`PagedKVCache`).

An fp8 cache stores ``clamp(x / scale, +-448)`` cast to e4m3 and multiplies by ``scale`` when it
reads. The scale decides two things:
- where each value lands in e4m3's range. e4m3 is a floating-point format (3 mantissa bits), so
  its relative rounding error is the same from 2**-6 up to 448; a value only loses precision once
  ``x / scale`` falls below that, into the subnormals. One scale for the whole tensor therefore
  costs a head little until it is orders of magnitude smaller than the largest head;
- what is clipped: a value above ``448 * scale`` is stored as 448. A scale calibrated as
  ``amax / 448`` over calibration data clips whatever later arrives larger than that amax.

labkit's cache keeps one float32 scale per layer and KV head (``k_scale, v_scale: [H]``), set from
sample activations by ``PagedKVCache.set_scales`` (amax over the sample). Per tensor is the same
cache with every head's scale set to the tensor's amax / 448.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from labkit.kernels.store_kv import FP8_E4M3_MAX
from labkit.kvcache import PagedKVCache

BLOCK_SIZE = 16


def heads_of_different_magnitudes(num_tokens: int = 256, num_heads: int = 8, head_dim: int = 64,
                                  smallest: float = 1e-5, seed: int = 0) -> torch.Tensor:
    """Keys [num_tokens, num_heads, head_dim]: Gaussian, head ``h`` scaled so the heads' sizes
    fall evenly on a log scale from 1 down to ``smallest`` (deliberately far apart)."""
    if not 0 < smallest <= 1:
        raise ValueError(f"smallest must be in (0, 1]: the last head's size relative to the "
                         f"first, got {smallest!r}")
    g = torch.Generator().manual_seed(seed)
    sizes = torch.logspace(0, float(np.log10(smallest)), num_heads)
    return torch.randn(num_tokens, num_heads, head_dim, generator=g) * sizes[None, :, None]


def fp8_roundtrip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` [T, H, D] written into an fp8 cache whose per-head scales are ``scale`` [H] (a
    per-tensor scale is one value repeated), read back dequantised to float32."""
    num_tokens, heads, dim = x.shape
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    cache = PagedKVCache(1, heads, dim, num_blocks, BLOCK_SIZE, dtype=torch.float8_e4m3fn)
    cache.k_scale[0] = scale
    cache.v_scale[0] = scale
    cache.write(0, x, x, torch.arange(num_tokens), use_kernel=False)
    return cache.gather(0, list(range(num_blocks)), num_tokens)[0]


def per_head_scale(sample: torch.Tensor) -> torch.Tensor:
    """The scales ``PagedKVCache.set_scales`` calibrates from ``sample`` [T, H, D]: per head,
    amax / 448."""
    cache = PagedKVCache(1, sample.shape[1], sample.shape[2], 1, BLOCK_SIZE,
                         dtype=torch.float8_e4m3fn)
    cache.set_scales(0, sample, sample)
    return cache.k_scale[0].clone()


def per_tensor_scale(sample: torch.Tensor) -> torch.Tensor:
    """One scale for every head: the whole sample's amax / 448, repeated per head."""
    return (sample.abs().amax() / FP8_E4M3_MAX).float().expand(sample.shape[1]).clone()


def relative_error(x: torch.Tensor, y: torch.Tensor, dims=(0, 2)) -> torch.Tensor:
    """||y - x|| / ||x|| per head (over tokens and head_dim), or overall with ``dims=None``."""
    if dims is None:
        return (y - x).norm() / x.norm()
    return (y - x).norm(dim=dims) / x.norm(dim=dims)


def scale_granularity(key: torch.Tensor) -> pd.DataFrame:
    """Per head: its size against the largest head, and the relative error of an e4m3 round
    trip with one per-tensor scale and with per-head scales (both amax over ``key`` itself)."""
    amax = key.abs().amax(dim=(0, 2))
    tensor = relative_error(key, fp8_roundtrip(key, per_tensor_scale(key)))
    head = relative_error(key, fp8_roundtrip(key, per_head_scale(key)))
    return pd.DataFrame({"head": range(key.shape[1]),
                         "amax / largest": (amax / amax.max()).tolist(),
                         "error, per-tensor scale": tensor.tolist(),
                         "error, per-head scale": head.tolist()})


def stale_scale(num_tokens: int = 256, num_heads: int = 8, head_dim: int = 64,
                growth: float = 2.0, seed: int = 0) -> pd.DataFrame:
    """Per-head scales calibrated on one sample, then used for later tokens: from the same
    distribution (in range), ``growth`` times larger (stale), and computed on the fly from the
    live tokens themselves. Per row: the share of values clipped and the relative error."""
    if not growth > 1:
        raise ValueError(f"growth must be > 1 (how much larger the live values are than the "
                         f"calibration sample), got {growth!r}")
    g = torch.Generator().manual_seed(seed)
    calibration = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    in_range = torch.randn(num_tokens, num_heads, head_dim, generator=g)
    calibrated = per_head_scale(calibration)
    rows = []
    for name, live, scale in (("calibrated, same distribution", in_range, calibrated),
                              (f"calibrated, live values {growth:g}x larger", growth * in_range,
                               calibrated),
                              ("on the fly (amax of the live tokens)", growth * in_range,
                               per_head_scale(growth * in_range))):
        # 1 + 1e-6: amax / 448 rounds in float32, and the amax itself must not count as clipped
        clipped = (live / scale[None, :, None]).abs() > FP8_E4M3_MAX * (1 + 1e-6)
        rows.append({"scale": name, "clipped share": float(clipped.float().mean()),
                     "relative error": float(relative_error(live, fp8_roundtrip(live, scale),
                                                            dims=None))})
    return pd.DataFrame(rows)
