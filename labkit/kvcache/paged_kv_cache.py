"""The KV tensors of a paged cache, and what they cost in memory.

Layout: one tensor ``kv: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
- one allocation, sized once at start-up, is what makes paging pay: requests never allocate;
- ``kv[layer, 0]`` and ``kv[layer, 1]`` are each a contiguous ``[num_blocks, block_size, H, D]``
  cache, the layout the paged-attention kernels read, so a block's tokens for all heads are one
  contiguous run of ``block_size * H * D`` values (one long read per block in decode);
- a copy-on-write copy is one indexed copy along the block axis, for all layers at once.

With ``dtype=torch.float8_e4m3fn`` each layer also has float32 ``k_scale, v_scale: [H]``
(per-head scales): values are stored divided by the scale and multiplied back when read.

An MLA cache (``latent=True``) holds one row per token and layer instead of a K and a V: the
compressed ``c_kv`` then the rotary key ``k_pe`` (``head_dim`` is their total width, 576 in
DeepSeek-V3), shared by every query head. Its tensor is ``[num_layers, 1, num_blocks,
block_size, 1, width]`` and ``latent_cache(layer)`` is the ``[num_blocks, block_size, width]``
view that ``paged_mla_attention`` reads; the value is the row's first ``kv_lora_rank`` columns,
so there is nothing else to store.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from operator import index

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
    latent: bool = False  # MLA: one shared latent row per token (head_dim wide), no separate V

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            check_positive_int(name, getattr(self, name))
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype must be one of {KV_DTYPES}, got {self.dtype}")
        if not isinstance(self.latent, bool):
            raise TypeError(f"latent must be True or False, got {self.latent!r}")
        if self.latent and self.num_kv_heads != 1:
            raise ValueError(f"an MLA latent cache has one row per token shared by every head: "
                             f"num_kv_heads must be 1, got {self.num_kv_heads}")
        if self.latent and self.fp8:
            raise ValueError("an fp8 MLA latent cache is not implemented: use bfloat16 or "
                             "float16 (or float32)")

    @property
    def planes(self) -> int:
        """Tensors cached per token and layer: K and V, or MLA's one latent."""
        return 1 if self.latent else 2

    @property
    def fp8(self) -> bool:
        return self.dtype == torch.float8_e4m3fn

    @property
    def bytes_per_token(self) -> int:
        """K and V (or MLA's latent), every layer and KV head (scales are per head, not per
        token: ignored)."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.planes * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


def _count(name: str, value, hint: str) -> int:
    """``value`` as an int >= 0 (bools refused), or an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int ({hint}), got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0 ({hint}), got {value}")
    return value


def kv_cache_bytes(shape: KVCacheShape, num_tokens: int) -> int:
    """Bytes to hold ``num_tokens`` tokens, scales included."""
    _count("num_tokens", num_tokens, "tokens to hold")
    scales = 2 * shape.num_layers * shape.num_kv_heads * 4 if shape.fp8 else 0
    return shape.bytes_per_token * num_tokens + scales


def tokens_that_fit(shape: KVCacheShape, memory_bytes: int, block_size: int = 16) -> int:
    """How many tokens (whole blocks) a memory budget holds."""
    check_power_of_two("block_size", block_size, hint="tokens a block holds; 16 is usual")
    if (isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, float))
            or not math.isfinite(memory_bytes)):
        raise TypeError(f"memory_bytes must be a finite number of bytes, got {memory_bytes!r}")
    memory_bytes = int(memory_bytes)
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
                 device: str | torch.device = "cpu", *, latent: bool = False):
        self.shape = KVCacheShape(num_layers, num_kv_heads, head_dim, dtype, latent)
        check_positive_int("num_blocks", num_blocks, hint="KV blocks in the cache")
        check_power_of_two("block_size", block_size, hint="tokens a block holds; 16 is usual")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.kv = torch.zeros(num_layers, self.shape.planes, num_blocks, block_size,
                              num_kv_heads, head_dim, dtype=dtype, device=device)
        if self.shape.fp8:
            self.k_scale = torch.ones(num_layers, num_kv_heads, dtype=torch.float32, device=device)
            self.v_scale = torch.ones_like(self.k_scale)
        else:
            self.k_scale = self.v_scale = None
        # Each layer's views, made once: an engine asks for them in every layer of every step,
        # and indexing kv again each time costs the host microseconds per call. Everything
        # writes kv and the scales in place, so the views stay valid.
        self._layers = [(self.kv[i, 0], self.kv[i, -1],
                         None if self.k_scale is None else self.k_scale[i],
                         None if self.v_scale is None else self.v_scale[i])
                        for i in range(num_layers)]

    @classmethod
    def for_memory(cls, shape: KVCacheShape, memory_bytes: int, block_size: int = 16,
                   device: str | torch.device = "cpu") -> "PagedKVCache":
        """As many blocks as ``memory_bytes`` holds: how an engine sizes its cache at start-up."""
        num_blocks = tokens_that_fit(shape, memory_bytes, block_size) // block_size
        if num_blocks < 1:
            raise ValueError(f"{memory_bytes:,} bytes hold no block of {block_size} tokens at "
                             f"{shape.bytes_per_token:,} bytes per token; give more memory")
        return cls(shape.num_layers, shape.num_kv_heads, shape.head_dim, num_blocks, block_size,
                   shape.dtype, device, latent=shape.latent)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    # ------------------------------------------------------------------ checks
    # Python indexing would wrap -1 to the last layer or block: a learner's off-by-one would
    # read or write someone else's KV instead of failing.
    def _layer(self, layer) -> int:
        num_layers = self.shape.num_layers
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer must be an int in [0, {num_layers}), got "
                            f"{type(layer).__name__} {layer!r}")
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer {layer} is outside [0, {num_layers}): this cache has "
                             f"{num_layers} layers")
        return layer

    def _block_ids(self, name: str, blocks) -> list[int]:
        """Block ids as ints in [0, num_blocks): a list, tuple or 1-D int tensor."""
        if isinstance(blocks, torch.Tensor):
            if blocks.dim() != 1 or blocks.is_floating_point() or blocks.dtype == torch.bool:
                raise TypeError(f"{name} must be a list of block ids (ints), got a "
                                f"{blocks.dtype} tensor of shape {tuple(blocks.shape)}")
            blocks = blocks.tolist()
        if isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__"):
            raise TypeError(f"{name} must be a list of block ids (ints), got "
                            f"{type(blocks).__name__}")
        out = []
        for i, b in enumerate(blocks):
            try:
                if isinstance(b, bool):
                    raise TypeError
                b = index(b)
            except TypeError:
                raise TypeError(f"{name}[{i}] must be a block id (an int), got "
                                f"{type(b).__name__} {b!r}") from None
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"{name}[{i}] is block {b}, outside [0, {self.num_blocks}): "
                                 f"this cache has {self.num_blocks} blocks")
            out.append(b)
        return out

    # ------------------------------------------------------------------ views
    def _kv_only(self, what: str) -> None:
        if self.shape.latent:
            raise ValueError(f"{what} is for a K/V cache; this is an MLA latent cache: use "
                             "latent_cache(layer) and write_latent (the value is the latent's "
                             "first kv_lora_rank columns)")

    def key_cache(self, layer: int) -> torch.Tensor:
        """[num_blocks, block_size, num_kv_heads, head_dim], a view."""
        self._kv_only("key_cache")
        return self._layers[self._layer(layer)][0]

    def value_cache(self, layer: int) -> torch.Tensor:
        self._kv_only("value_cache")
        return self._layers[self._layer(layer)][1]

    def latent_cache(self, layer: int) -> torch.Tensor:
        """MLA: [num_blocks, block_size, width] (c_kv then k_pe), a view."""
        if not self.shape.latent:
            raise ValueError("latent_cache is for an MLA cache (latent=True); this cache holds "
                             "K and V: use key_cache and value_cache")
        return self._layers[self._layer(layer)][0][:, :, 0]

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._layers[self._layer(layer)][2:]

    def set_scales(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Per-head fp8 scales from sample keys/values [num_tokens, H, D]: max |x| maps to 448.

        Both samples are checked before either scale changes: a NaN or inf would make a NaN
        scale, and every value read back through it NaN."""
        if not self.shape.fp8:
            raise ValueError(f"scales are for an fp8 cache; this cache is {self.shape.dtype}")
        layer = self._layer(layer)
        heads, dim = self.shape.num_kv_heads, self.shape.head_dim
        amaxes = []
        for name, x in (("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor) or not x.is_floating_point():
                what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
                raise TypeError(f"set_scales: {name} must be a floating-point tensor "
                                f"[num_tokens, {heads}, {dim}], got {what}")
            if x.dim() != 3 or tuple(x.shape[1:]) != (heads, dim) or x.shape[0] == 0:
                raise ValueError(f"set_scales: {name} must be [num_tokens >= 1, {heads}, {dim}] "
                                 f"(sample tokens of layer {layer}), got {tuple(x.shape)}")
            amax = x.detach().float().abs().amax(dim=(0, 2))
            finite = torch.isfinite(amax)
            if not bool(finite.all()):
                head = int((~finite).nonzero()[0])
                raise ValueError(f"set_scales: the {name} sample of layer {layer}, head {head} "
                                 f"holds NaN or inf (max |x| = {float(amax[head])}); the scale "
                                 "would be too. Calibrate on finite activations")
            amaxes.append(amax.clamp_min(1e-6).to(self.k_scale.device))
        self.k_scale[layer] = amaxes[0] / FP8_E4M3_MAX
        self.v_scale[layer] = amaxes[1] / FP8_E4M3_MAX

    # ------------------------------------------------------------------ operations
    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor,
              slot_mapping: torch.Tensor, *, use_kernel: bool = True, check: bool = True) -> None:
        """key, value: [num_tokens, num_kv_heads, head_dim] into slot_mapping [num_tokens].

        ``check``: as for ``store_kv``, slots outside [-1, num_blocks * block_size) or given
        twice are refused before anything is written (one host sync on a GPU, skipped during
        graph capture); a caller that builds its slots itself may pass ``check=False``."""
        fn = store_kv if use_kernel else store_kv_ref
        fn(key, value, self.key_cache(layer), self.value_cache(layer), slot_mapping,
           *self.scales(layer), check=check)

    def write_latent(self, layer: int, latent: torch.Tensor, slot_mapping: torch.Tensor, *,
                     use_kernel: bool = True, check: bool = True) -> None:
        """MLA: latent [num_tokens, width] (c_kv then k_pe) into slot_mapping [num_tokens];
        slot -1 is padding and writes nothing. ``check``: slots outside [-1, capacity) or given
        twice are refused before anything is written (a host sync; an engine that built its
        slots itself, or a CUDA Graph capture, passes False). The store is ``store_kv``'s, the
        one latent row standing in for both K and V."""
        cache = self.latent_cache(layer)
        width = self.shape.head_dim
        if not isinstance(latent, torch.Tensor) or latent.dim() != 2 or \
                latent.shape[1] != width or latent.dtype != cache.dtype:
            what = (latent.dtype, tuple(latent.shape)) if isinstance(latent, torch.Tensor) \
                else type(latent).__name__
            raise ValueError(f"latent must be {cache.dtype} [num_tokens, {width}], got {what}")
        if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1 or \
                slot_mapping.shape[0] != latent.shape[0] or slot_mapping.is_floating_point():
            raise ValueError(f"slot_mapping must be an int tensor [{latent.shape[0]}] (one slot "
                             f"per latent row), got {slot_mapping!r}")
        rows = self.kv[self._layer(layer), 0]  # [num_blocks, block_size, 1, width]
        row = latent.contiguous()[:, None]
        (store_kv if use_kernel else store_kv_ref)(row, row, rows, rows, slot_mapping,
                                                   check=check)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Apply the block manager's copy-on-write (src, dst) pairs, every layer, K and V."""
        if not copies:
            return
        try:
            pairs = [tuple(c) for c in copies]
        except TypeError:
            raise TypeError(f"copies must be a list of (src, dst) block pairs, got {copies!r}") \
                from None
        if any(len(p) != 2 for p in pairs):
            raise ValueError(f"copies must be (src, dst) block pairs, got {copies!r}")
        src = self._block_ids("copy_blocks src", [s for s, _ in pairs])
        dst = self._block_ids("copy_blocks dst", [d for _, d in pairs])
        if len(set(dst)) != len(dst) or set(dst) & set(src):
            raise ValueError(f"copy_blocks needs distinct destinations that are not sources, "
                             f"got {copies}")
        src = torch.tensor(src, device=self.kv.device)
        dst = torch.tensor(dst, device=self.kv.device)
        self.kv[:, :, dst] = self.kv[:, :, src]

    def gather(self, layer: int, block_table: list[int], num_tokens: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's keys and values [num_tokens, H, D], read back in order (dequantised to
        float32 for fp8): the reference read path that tests and attention references use. For
        an MLA cache both are the latent rows [num_tokens, 1, width]."""
        layer = self._layer(layer)
        block_table = self._block_ids("block_table", block_table)
        _count("num_tokens", num_tokens, "tokens to read back")
        if num_tokens > len(block_table) * self.block_size:
            raise ValueError(f"{num_tokens} tokens need {-(-num_tokens // self.block_size)} "
                             f"blocks, the block table has {len(block_table)}")
        idx = torch.tensor(block_table, dtype=torch.long, device=self.kv.device)
        k = self.kv[layer, 0, idx].flatten(0, 1)[:num_tokens]
        v = self.kv[layer, -1, idx].flatten(0, 1)[:num_tokens]
        if self.shape.fp8:
            k = k.float() * self.k_scale[layer][:, None]
            v = v.float() * self.v_scale[layer][:, None]
        return k, v

