"""What attention's inputs must satisfy, checked on the host before a kernel is launched.

Shared by ``flash_attention``, ``paged_attention`` and ``paged_mla_attention``. Each check turns
bad input into an error that names the limit and what to change, never a wrong answer or an
illegal memory access on the GPU. The checks that read tensor values (cu_seqlens, seq_lens,
block ids) cost a host sync, so the kernels skip them with ``check=False`` and under CUDA Graph
capture.
"""
from __future__ import annotations

import math
from operator import index

import torch

from labkit import check_positive_int

HEAD_DIMS = (16, 32, 64, 128, 256)
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8 = getattr(torch, "float8_e4m3fn", None)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_tensors(**tensors) -> None:
    """Each argument is a tensor: a list or an array would fail later with an AttributeError."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}; wrap it "
                            "with torch.tensor(..., device=q.device)")


def check_flag(name: str, value, allow_none: bool = False) -> None:
    """A switch is a bool: a string such as "no" is truthy and would silently mean yes."""
    if not (isinstance(value, bool) or (allow_none and value is None)):
        raise TypeError(f"{name} must be True or False{' or None' if allow_none else ''}, "
                        f"got {value!r}")


def resolve_max_query_len(given, longest_q, cu_seqlens_q, total: int, name: str,
                          what: str) -> int:
    """The grid's query extent: ``given`` (checked against ``longest_q`` when that is known),
    else read from ``cu_seqlens_q``, which needs a host sync and so is refused while capturing.

    ``given`` is a host int, so it is checked on every call, ``check=False`` included: ``total``
    new tokens over ``batch`` sequences put between ceil(total / batch) and ``total`` of them in
    the longest. Below that, tokens would get no output; above it, the grid launches programs
    for tokens that do not exist (a huge value launches millions)."""
    if given is not None:
        if isinstance(given, bool):
            raise TypeError(f"{name} must be an int ({what} in the longest sequence) or None, "
                            f"got {given!r}")
        try:
            given = index(given)
        except TypeError:
            raise TypeError(f"{name} must be an int ({what} in the longest sequence) or None, "
                            f"got {type(given).__name__} {given!r}") from None
        batch = cu_seqlens_q.numel() - 1
        least = -(-total // batch) if batch else total
        if given < least or (total and given > total):
            raise ValueError(f"{name}={given} is impossible for {total} {what} in {batch} "
                             f"sequences: the longest has between {least} and {total}; pass "
                             f"the longest sequence's count, or None to read it from "
                             "cu_seqlens_q")
    if given is None:
        if _capturing():
            raise ValueError(f"pass {name} when capturing a CUDA Graph")
        return longest_q if longest_q is not None else int(cu_seqlens_q.diff().max())
    if longest_q is not None and given < longest_q:
        raise ValueError(f"{name}={given} but a sequence has {longest_q} {what}: its later "
                         f"{what} would get no output")
    return given


def check_heads_and_dtypes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_dims: int) -> None:
    """Shared by the flash and paged wrappers: ranks, head counts, head dims, dtypes, devices."""
    check_tensors(q=q, k=k, v=v) if k_dims == 3 else check_tensors(q=q, k_cache=k, v_cache=v)
    if q.dim() != 3 or k.dim() != k_dims or v.shape != k.shape:
        raise ValueError(f"q must be [tokens, num_q_heads, head_dim] and k, v the same {k_dims}-D "
                         f"shape; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[-2]
    if k.shape[-1] != head_dim:
        raise ValueError(f"q has head_dim {head_dim} but k/v have {k.shape[-1]}: they must match")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads}): that is what GQA/MQA means")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}; pad the heads "
                         "to the next size or use the sdpa backend")
    if q.dtype not in QUERY_DTYPES:
        raise TypeError(f"q must be one of {QUERY_DTYPES}, got {q.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the head_dim axis of q, k and v must be contiguous (stride 1); "
                         "call .contiguous() first")
    if len({q.device, k.device, v.device}) != 1:
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")


def check_cu_seqlens(cu: torch.Tensor, total: int, name: str, device,
                     check: bool = True) -> int | None:
    """int32 [batch + 1], from 0 to ``total``, never decreasing. Returns the longest sequence.

    Reading values costs one host sync, so with ``check=False`` or under CUDA Graph capture only
    the shape and dtype are checked and None is returned.
    """
    check_tensors(**{name: cu})
    if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2 or cu.device != device:
        raise ValueError(f"{name} must be int32 [batch + 1] on {device}, got {cu.dtype} "
                         f"{tuple(cu.shape)} on {cu.device}")
    if not check or _capturing():
        return None
    lens = cu.diff()
    first, last, shortest, longest = torch.stack([cu[0], cu[-1], lens.min(), lens.max()]).tolist()
    if first != 0 or last != total or shortest < 0:
        host = cu[:8].tolist()
        raise ValueError(f"{name} must start at 0, never decrease and end at the token count "
                         f"{total}; got {host}{'...' if cu.numel() > 8 else ''} (last {last})")
    return longest


def softmax_scale(scale: float | None, head_dim: int) -> float:
    """1/sqrt(head_dim) unless given; must be positive (the kernels scale the row maximum) and
    finite (an infinite scale turns every score into inf - inf = NaN)."""
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite positive number (None means "
                         f"1/sqrt(head_dim)), got {scale}")
    return scale


def check_window(causal: bool, window: int | None) -> None:
    check_flag("causal", causal)
    if window is None:
        return
    check_positive_int("window", window, hint="keys each query sees")
    if not causal:
        raise ValueError("window needs causal=True: a sliding window counts the most recent keys")


def check_cache(q, k_cache, v_cache, k_scale, v_scale) -> bool:
    """Returns whether the cache is fp8 (and so needs the scales)."""
    check_heads_and_dtypes(q, k_cache, v_cache, k_dims=4)
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache is {k_cache.dtype} but v_cache is {v_cache.dtype}")
    fp8 = FP8 is not None and k_cache.dtype == FP8
    if not fp8 and k_cache.dtype != q.dtype:
        raise TypeError(f"the KV cache must be q's dtype ({q.dtype}) or float8_e4m3fn, "
                        f"got {k_cache.dtype}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous [num_blocks, block_size, "
                         "num_kv_heads, head_dim] tensors; a sliced or transposed view would be "
                         "addressed wrongly, so pass .contiguous() (or the cache itself)")
    num_kv_heads = k_cache.shape[2]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not fp8 and s is not None:
            raise ValueError(f"{name} was given but the cache is {k_cache.dtype}: scales are "
                             "for fp8 (e4m3) caches only")
        if fp8 and (s is None or s.dtype != torch.float32 or tuple(s.shape) != (num_kv_heads,)
                    or s.device != q.device):
            raise ValueError(f"an fp8 cache needs {name} as float32 [num_kv_heads="
                             f"{num_kv_heads}] on {q.device} (one scale per KV head), got "
                             f"{None if s is None else (s.dtype, tuple(s.shape))}")
    return fp8


def check_tables(block_tables, seq_lens, cu_seqlens_q, num_blocks, block_size, device,
                  check: bool) -> int | None:
    """Block table and lengths agree with the cache. Returns the longest sequence, reading the
    values in ONE host sync; with ``check=False`` (or during graph capture) returns None."""
    check_tensors(block_tables=block_tables, seq_lens=seq_lens)
    batch = cu_seqlens_q.numel() - 1
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or \
            block_tables.shape[0] != batch or block_tables.stride(1) != 1 or \
            block_tables.device != device:
        raise ValueError(f"block_tables must be int32 [batch={batch}, max_blocks] on {device} "
                         f"with contiguous rows, got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)} on {block_tables.device}")
    if seq_lens.dtype != torch.int32 or tuple(seq_lens.shape) != (batch,) or \
            seq_lens.device != device:
        raise ValueError(f"seq_lens must be int32 [batch={batch}] on {device}, got "
                         f"{seq_lens.dtype} {tuple(seq_lens.shape)} on {seq_lens.device}")
    if not check or _capturing():
        return None
    capacity = block_tables.shape[1] * block_size
    used = torch.arange(block_tables.shape[1], device=device)[None, :] < \
        ((seq_lens + block_size - 1) // block_size)[:, None]
    ids = torch.cat([torch.where(used, block_tables, 0).flatten(),
                     torch.zeros(1, dtype=torch.int32, device=device)])
    spare = seq_lens - cu_seqlens_q.diff()  # cached tokens before the new ones
    longest, fewest_spare, lowest, highest = torch.stack(
        [seq_lens.max(), spare.min(), ids.min(), ids.max()]).tolist()
    if longest > capacity or fewest_spare < 0:
        b = int(((seq_lens > capacity) | (spare < 0)).int().argmax())
        raise ValueError(
            f"sequence {b}: seq_lens={int(seq_lens[b])} must be at least its "
            f"{int(seq_lens[b] - spare[b])} new tokens and at most the block table's capacity "
            f"{block_tables.shape[1]} blocks x {block_size} = {capacity}; widen block_tables "
            "or fix seq_lens")
    if lowest < 0 or highest >= num_blocks:
        raise ValueError(f"block_tables holds block ids outside [0, {num_blocks}) within "
                         f"seq_lens (got {lowest}..{highest})")
    return longest


def _check_width(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two of at least 16 (tl.dot's smallest "
                         f"tile and tl.arange's rule), got {value}; DeepSeek-V2/V3 use 512 "
                         "and 64")


def check_mla_inputs(q_latent, q_rope, latent_cache, out=None) -> tuple[int, int]:
    """Shapes, dtypes, devices and layouts; returns (kv_lora_rank, qk_rope_head_dim)."""
    check_tensors(q_latent=q_latent, q_rope=q_rope, latent_cache=latent_cache)
    if q_latent.dim() != 3 or q_rope.dim() != 3 or q_rope.shape[:2] != q_latent.shape[:2]:
        raise ValueError("q_latent must be [tokens, num_heads, kv_lora_rank] and q_rope "
                         "[tokens, num_heads, qk_rope_head_dim] with the same tokens and heads; "
                         f"got {tuple(q_latent.shape)} and {tuple(q_rope.shape)}")
    rank, rope = q_latent.shape[2], q_rope.shape[2]
    _check_width("kv_lora_rank (q_latent's last dim)", rank)
    _check_width("qk_rope_head_dim (q_rope's last dim)", rope)
    if latent_cache.dim() != 3 or latent_cache.shape[2] != rank + rope:
        raise ValueError("latent_cache must be [num_blocks, block_size, kv_lora_rank + "
                         f"qk_rope_head_dim = {rank + rope}] (c_kv then k_pe), got "
                         f"{tuple(latent_cache.shape)}")
    if q_latent.dtype not in QUERY_DTYPES:
        raise TypeError(f"q_latent must be one of {QUERY_DTYPES}, got {q_latent.dtype}")
    if q_rope.dtype != q_latent.dtype or latent_cache.dtype != q_latent.dtype:
        raise TypeError(f"q_latent, q_rope and latent_cache must share one dtype, got "
                        f"{q_latent.dtype}, {q_rope.dtype}, {latent_cache.dtype}")
    if q_latent.stride(-1) != 1 or q_rope.stride(-1) != 1:
        raise ValueError("the last axis of q_latent and q_rope must be contiguous (stride 1); "
                         "call .contiguous() first")
    if not latent_cache.is_contiguous():
        raise ValueError("latent_cache must be a contiguous [num_blocks, block_size, width] "
                         "tensor; pass .contiguous() (or the cache itself)")
    if len({q_latent.device, q_rope.device, latent_cache.device}) != 1:
        raise ValueError(f"q_latent, q_rope and latent_cache are on different devices: "
                         f"{q_latent.device}, {q_rope.device}, {latent_cache.device}")
    if out is not None:
        check_tensors(out=out)
        if out.shape != q_latent.shape or out.dtype != q_latent.dtype or \
                out.device != q_latent.device or out.stride(-1) != 1:
            raise ValueError(f"out must be {q_latent.dtype} {tuple(q_latent.shape)} on "
                             f"{q_latent.device} with a contiguous last axis, got {out.dtype} "
                             f"{tuple(out.shape)} on {out.device}")
    return rank, rope
