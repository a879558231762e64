"""The KV tensors of a paged cache, and what they cost in memory.

Layout: one tensor ``kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
- one allocation, sized once at start-up, is what makes paging pay: requests never allocate;
- ``kv[layer, 0]`` and ``kv[layer, 1]`` are each a contiguous ``[num_blocks, block_size, H, D]``
  cache, the layout the paged-attention kernels read, so a block's tokens for all heads are one
  contiguous run of ``block_size * H * D`` values (one long read per block in decode);
- a copy-on-write copy is one indexed copy along the block axis, for all layers at once.

With ``dtype=torch.float8_e4m3fn`` each layer also has float32 ``k_scale, v_scale: [H]``
(per-head scales): values are stored divided by the scale and multiplied back when read.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit import check_positive_int, check_power_of_two
from labkit.kernels.store_kv import FP8_E4M3_MAX, store_kv, store_kv_ref

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn)


@dataclass(frozen=True)
class KVCacheShape:
    """What one token of KV cache is made of: a model's attention shape and the cache dtype."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            check_positive_int(name, getattr(self, name))
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype must be one of {KV_DTYPES}, got {self.dtype}")

    @property
    def fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def bytes_per_token(self) -> int:
        """K and V, every layer and KV head (scales are per head, not per token: ignored)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def kv_cache_bytes(shape: KVCacheShape, num_tokens: int) -> int:
    """Bytes to hold ``num_tokens`` tokens, scales included."""
    scales = 2 * shape.num_layers * shape.num_kv_heads * 4 if shape.fp8 else 0
    return shape.bytes_per_token * num_tokens + scales


def tokens_that_fit(shape: KVCacheShape, memory_bytes: int, block_size: int = 16) -> int:
    """How many tokens (whole blocks) a memory budget holds."""
    per_block = shape.bytes_per_token * block_size
    return (max(0, memory_bytes - kv_cache_bytes(shape, 0)) // per_block) * block_size


def memory_table(models: dict[str, tuple[int, int, int]], memory_bytes: int,
                 dtypes=(torch.bfloat16, torch.float8_e4m3fn), block_size: int = 16):
    """Per model ``(num_layers, num_kv_heads, head_dim)`` and cache dtype: KiB per token and
    how many tokens ``memory_bytes`` holds. Returns a pandas DataFrame."""
    import pandas as pd

    rows = []
    for name, (layers, heads, dim) in models.items():
        for dtype in dtypes:
            shape = KVCacheShape(layers, heads, dim, dtype)
            rows.append({"model": name, "kv dtype": str(dtype).replace("torch.", ""),
                         "KiB per token": shape.bytes_per_token / 1024,
                         "tokens that fit": tokens_that_fit(shape, memory_bytes, block_size)})
    return pd.DataFrame(rows)


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu"):
        self.shape = KVCacheShape(num_layers, num_kv_heads, head_dim, dtype)
        check_positive_int("num_blocks", num_blocks, hint="KV blocks in the cache")
        check_power_of_two("block_size", block_size, hint="tokens a block holds; 16 is usual")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv = torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                              dtype=dtype, device=device)
        if self.shape.fp8:
            self.k_scale = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device)
            self.v_scale = torch.ones_like(self.k_scale)
        else:
            self.k_scale = self.v_scale = None

    @classmethod
    def for_memory(cls, shape: KVCacheShape, memory_bytes: int, block_size: int = 16,
                   device: str | torch.device = "cpu") -> "PagedKVCache":
        """As many blocks as ``memory_bytes`` holds: how an engine sizes its cache at start-up."""
        num_blocks = tokens_that_fit(shape, memory_bytes, block_size) // block_size
        if num_blocks < 1:
            raise ValueError(f"{memory_bytes:,} bytes hold no block of {block_size} tokens at "
                             f"{shape.bytes_per_token:,} bytes per token; give more memory")
        return cls(shape.num_layers, shape.num_kv_heads, shape.head_dim, num_blocks, block_size,
                   shape.dtype, device)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def key_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim], a view."""
        return self.kv[layer, 0]

    def value_cache(self, layer: int) -> torch.Tensor:
        return self.kv[layer, 1]

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.k_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]

    def set_scales(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Per-head fp8 scales from sample keys/values [num_tokens, H, D]: max |x| maps to 448."""
        if not self.shape.fp8:
            raise ValueError(f"scales are for an fp8 cache; this cache is {self.shape.dtype}")
        for scale, x in ((self.k_scale, key), (self.v_scale, value)):
            amax = x.detach().float().abs().amax(dim=(0, 2)).clamp_min(1e-6)
            scale[layer] = amax / FP8_E4M3_MAX

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor, *, use_kernel: bool = True) -> None:
        """key, value: [num_tokens, num_kv_heads, head_dim] into slot_mapping [num_tokens]."""
        fn = store_kv if use_kernel else store_kv_ref
        fn(key, value, self.key_cache(layer), self.value_cache(layer), slot_mapping,
           *self.scales(layer))

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Apply the block manager's copy-on-write (src, dst) pairs, every layer, K and V."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.kv.device)
        dst = torch.tensor([d for _, d in copies], device=self.kv.device)
        if len(set(dst.tolist())) != len(copies) or set(dst.tolist()) & set(src.tolist()):
            raise ValueError(f"copy_blocks needs distinct destinations that are not sources, "
                             f"got {copies}")
        self.kv[:, :, dst] = self.kv[:, :, src]

    def gather(self, layer: int, block_table: list[int], num_tokens: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's keys and values [num_tokens, H, D], read back in order (dequantised to
        float32 for fp8): the reference read path that tests and attention references use."""
        if num_tokens > len(block_table) * self.block_size:
            raise ValueError(f"{num_tokens} tokens need {-(-num_tokens // self.block_size)} "
                             f"blocks, the block table has {len(block_table)}")
        idx = torch.tensor(block_table, dtype=torch.long, device=self.kv.device)
        k = self.kv[layer, 0, idx].flatten(0, 1)[:num_tokens]
        v = self.kv[layer, 1, idx].flatten(0, 1)[:num_tokens]
        if self.shape.fp8:
            k = k.float() * self.k_scale[layer][:, None]
            v = v.float() * self.v_scale[layer][:, None]
        return k, v

