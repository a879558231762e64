"""store_kv: write the keys and values of new tokens into their slots of a paged KV cache.

What it computes. Each forward step produces ``key, value: [num_tokens, num_kv_heads, head_dim]``
for the tokens it just processed. The block manager gave each token a *slot*,
``block_table[pos // block_size] * block_size + pos % block_size``; ``slot_mapping[t]`` is that
slot for token t, or -1 for a padding token (a CUDA-Graph bucket padded to a fixed size) that
must not be written. The cache of one layer is ``[num_blocks, block_size, num_kv_heads, head_dim]``
so slot s is row ``(s // block_size, s % block_size)``: a scatter, one row per token.

With an fp8 (e4m3) cache each head has a float32 scale: we store ``clamp(x / scale, +-448)``
cast to e4m3, and attention multiplies by the scale when it reads.

Run ``python -m labkit.kernels.store_kv`` to check the kernel against the reference and time it.
"""
import labkit  # noqa: F401  (before triton: interpreter on where there is no GPU)
import torch
import triton
import triton.language as tl
from labkit.kernels.grid import cdiv, next_power_of_2
from labkit.kernels.pdl import launch_options, pdl_for, wait_for_kernel_ahead

FP8_E4M3_MAX = 448.0                        # largest finite e4m3 value
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)       # the same, as the kernel may read a global


@triton.jit
def store_kv_kernel(
    key_ptr, value_ptr,              # [num_tokens, num_heads, head_dim], last dim contiguous
    k_cache_ptr, v_cache_ptr,        # [num_blocks, block_size, num_heads, head_dim]
    slot_mapping_ptr,                # int32 or int64 [num_tokens], -1 = skip
    k_scale_ptr, v_scale_ptr,        # float32 [num_heads] (read only when QUANTIZE)
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,  # cache strides: block, slot in block, head (k and v alike)
    block_size, num_heads, head_dim,
    BLOCK_HEADS: tl.constexpr, BLOCK_DIM: tl.constexpr, QUANTIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_kernel_ahead(PDL)
    t = tl.program_id(0).to(tl.int64)   # int64: offsets into big caches overflow int32
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)  # int32 slots too: no cast kernel per layer
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_DIM)
    # A padding token (slot -1) masks everything off rather than returning early.
    mask = (heads[:, None] < num_heads) & (dims[None, :] < head_dim) & (slot >= 0)

    k = tl.load(key_ptr + t * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if QUANTIZE:
        head_ok = heads < num_heads
        k_scale = tl.load(k_scale_ptr + heads, mask=head_ok, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads, mask=head_ok, other=1.0)
        k = k.to(tl.float32) / k_scale[:, None]
        v = v.to(tl.float32) / v_scale[:, None]
        k = tl.minimum(tl.maximum(k, -_FP8_MAX), _FP8_MAX)
        v = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)

    block = slot // block_size
    offset = block * stride_cb + (slot % block_size) * stride_cs
    offset = offset + heads[:, None] * stride_ch + dims[None, :]
    tl.store(k_cache_ptr + offset, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + offset, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale):
    """The shapes, dtypes and devices (free: no tensor value is read)."""
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache),
                    ("slot_mapping", slot_mapping)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}; wrap it "
                            "with torch.tensor(..., device=the cache's device)")
    for name, t in (("key", key), ("value", value)):
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor (the layer's K/V "
                            f"projection), got {t.dtype}")
    devices = {name: t.device for name, t in (("key", key), ("value", value),
               ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping),
               ("k_scale", k_scale), ("v_scale", v_scale)) if t is not None}
    if len(set(devices.values())) != 1:
        where = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"store_kv's tensors must all be on the cache's device, got {where}: "
                         "move them there with .to(k_cache.device)")
    if key.shape != value.shape or key.dim() != 3:
        raise ValueError(f"key and value must both be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(key.shape)} and {tuple(value.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_dim], got {tuple(k_cache.shape)}, "
                         f"{tuple(v_cache.shape)}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides (views of one layout)")
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key heads/head_dim {tuple(key.shape[1:])} do not match the cache's "
                         f"{tuple(k_cache.shape[2:])}")
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be [num_tokens]=[{key.shape[0]}], "
                         f"got {tuple(slot_mapping.shape)}")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 cache needs k_scale and v_scale: float32 [num_kv_heads]")
    if fp8 and (k_scale.shape != (key.shape[1],) or v_scale.shape != (key.shape[1],)):
        raise ValueError(f"k_scale and v_scale must be [num_kv_heads]=[{key.shape[1]}], got "
                         f"{tuple(k_scale.shape)} and {tuple(v_scale.shape)}")
    if not fp8 and (k_scale is not None or v_scale is not None):
        raise ValueError(f"k_scale/v_scale are for an fp8 cache; this cache is {k_cache.dtype}")
    return fp8


def _check_slots(slot_mapping: torch.Tensor, k_cache: torch.Tensor, check: bool) -> None:
    """Every slot in [-1, num_blocks * block_size) and no slot twice (-1 aside), before anything
    is written: the kernel would write a slot past the end into the next layer's cache, or
    outside the tensor, and two tokens in one slot race.

    Reading the slots costs one host sync, so it is skipped with ``check=False`` and while a
    CUDA Graph is being captured (a sync there is illegal; the capture's slots come from the
    caller, who checked or built them)."""
    if not check or slot_mapping.numel() == 0:
        return
    if slot_mapping.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    capacity = k_cache.shape[0] * k_cache.shape[1]
    ordered = slot_mapping.long().sort().values
    repeated = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    lo, hi, twice = torch.stack([ordered[0], ordered[-1], repeated.any().long()]).tolist()
    if lo < -1 or hi >= capacity:
        bad = lo if lo < -1 else hi
        raise ValueError(f"slot_mapping holds slot {bad}, outside [-1, {capacity}): the cache has "
                         f"{k_cache.shape[0]} blocks x {k_cache.shape[1]} slots (-1 marks a "
                         "padding token, never written); take slots from the block manager's "
                         "block table, or make the cache larger. Nothing was written")
    if twice:
        slot = int(ordered[1:][repeated][0])
        raise ValueError(f"slot_mapping gives slot {slot} to more than one token: each token "
                         "needs its own slot (two writes to one slot race). Nothing was written")


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *,
             check: bool = True) -> None:
    """Scatter ``key``/``value`` [num_tokens, H, D] into the caches at ``slot_mapping`` (in place).

    Slots must be distinct (two tokens never share a slot) and in [-1, num_blocks * block_size);
    -1 is a padding token, not written. ``check=True`` checks the shapes, dtypes and devices and
    reads the slots to make sure, before anything is written (one host sync on a GPU; skipped
    while a CUDA Graph is being captured). A caller that builds its tensors and slots itself, as
    the engine's runner does in every layer of every step, may pass ``check=False``, as
    ``paged_attention(check=False)`` does: then only the launch's own needs are checked (an
    eager step pays the host time of every check in every layer).
    """
    if check:
        fp8 = _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        fp8 = k_cache.dtype == torch.float8_e4m3fn
    _check_slots(slot_mapping, k_cache, check)
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("the head_dim axis of key, value and the caches must be contiguous; "
                         "call .contiguous() first")
    if k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError("the cache's (num_blocks, block_size) axes must be contiguous with each "
                         "other: slots address them as one flat row index")
    block_dim = next_power_of_2(head_dim)
    block_heads = min(next_power_of_2(num_heads), max(1, 2048 // block_dim))
    grid = (num_tokens, cdiv(num_heads, block_heads))
    dummy = k_scale if fp8 else slot_mapping  # never read when QUANTIZE is off
    store_kv_kernel[grid](
        key, value, k_cache, v_cache, slot_mapping,
        k_scale if fp8 else dummy, v_scale if fp8 else dummy,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[1], num_heads, head_dim,
        BLOCK_HEADS=block_heads, BLOCK_DIM=block_dim, QUANTIZE=fp8,
        PDL=(pdl := pdl_for(key.device)), **launch_options(pdl),
    )


def store_kv_ref(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None, *,
                 check: bool = True) -> None:
    """The same scatter in plain torch: index the cache as one row per slot."""
    _check(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    _check_slots(slot_mapping, k_cache, check)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k, v = key[keep], value[keep]
    if k_cache.dtype == torch.float8_e4m3fn:
        k = (k.float() / k_scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        v = (v.float() / v_scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    rows = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(rows, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
    v_cache.view(rows, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)


if __name__ == "__main__":
    from labkit.measure.bench import gbps, measure
    from labkit.device import interpreter_on

    device = labkit.select_device("auto")
    dtype = torch.float16 if interpreter_on() else torch.bfloat16
    num_blocks, block_size, num_heads, head_dim = (64, 16, 8, 128) if interpreter_on() else \
        (8192, 16, 8, 128)
    num_tokens = 37 if interpreter_on() else 4096
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
    slots[::7] = -1
    key = torch.randn(num_tokens, num_heads, head_dim, device=device, dtype=dtype)
    value = torch.randn_like(key)
    caches = [torch.zeros(num_blocks, block_size, num_heads, head_dim, device=device, dtype=dtype)
              for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots)
    store_kv_ref(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    print(f"store_kv matches the reference on {num_tokens} tokens ({dtype}, {device})")
    if interpreter_on():
        print("(Triton's interpreter runs the kernel in Python: its time says nothing of a GPU)")
    moved = 4 * key.numel() * key.element_size()  # read k, v; write k, v
    for name, fn in (("triton", store_kv), ("torch ", store_kv_ref)):
        # check=False: the calls above checked these slots; time the scatter, not the host sync
        t = measure(lambda: fn(key, value, caches[0], caches[1], slots, check=False), device=device,
                    warmup=2, repeats=5 if interpreter_on() else 50)
        print(f"{name} {t}  {gbps(moved, t):8.2f} GB/s")
