"""skinny_linear's checks of what rides along its matmul: RoPE's arguments and the paged cache
the q/k/v GEMV may store into. Each raises a clear error, naming the parameter, before any
launch."""
from __future__ import annotations

import torch


def check_rope(rope, n: int, gated: bool, rows: int) -> None:
    """``rope=(positions, inv_freq, num_q_heads, num_kv_heads)`` for a q/k/v weight of ``n``
    rows: a clear error before any launch."""
    if gated or len(rope) != 4:
        raise ValueError("rope=(positions, inv_freq, num_q_heads, num_kv_heads) goes with a q/k/v "
                         "projection, not gated=True")
    positions, inv_freq, hq, hkv = rope
    width = (hq + 2 * hkv) * 2 * inv_freq.numel()
    if n != width:
        raise ValueError(f"rope: a q/k/v weight of (Hq + 2 Hkv) * head_dim = {width} rows for "
                         f"{hq} q heads, {hkv} kv heads and head_dim {2 * inv_freq.numel()}, "
                         f"got {n}")
    if positions.shape != (rows,):
        raise ValueError(f"rope: positions must be [rows={rows}], got {tuple(positions.shape)}")


def check_kv_cache(kv_cache, rope, x: torch.Tensor, rows: int) -> None:
    """``kv_cache=(k_cache, v_cache, slot_mapping)`` beside ``rope``: a clear error before any
    launch (the slots' range is the caller's: the engine's block manager gives them)."""
    if rope is None or len(kv_cache) != 3:
        raise ValueError("kv_cache=(k_cache, v_cache, slot_mapping) goes with rope=: the q/k/v "
                         "projection's rotated k and its v are what it stores")
    k_cache, v_cache, slots = kv_cache
    hkv, d = rope[3], 2 * rope[1].numel()
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4 or tuple(c.shape[2:]) != (hkv, d) or c.dtype != x.dtype or \
                c.stride() != k_cache.stride() or c.stride(3) != 1 or c.stride(2) != d or \
                c.stride(0) != c.shape[1] * c.stride(1):
            raise ValueError(f"{name} must be [num_blocks, block_size, {hkv}, {d}] in {x.dtype}, "
                             f"laid out like k_cache with contiguous slots, got {c.dtype} "
                             f"{tuple(c.shape)} strides {c.stride()}")
    if slots.shape != (rows,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_cache's slot_mapping must be int32 or int64 [rows={rows}], got "
                         f"{slots.dtype} {tuple(slots.shape)}")
