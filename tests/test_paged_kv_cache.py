"""KV tensors: the slot-writing kernel against its torch reference, CoW copies, memory estimates."""
import pytest
import torch

from labkit.kernels.store_kv import store_kv, store_kv_ref
from labkit.kvcache import BlockManager, KVCacheShape, PagedKVCache, kv_cache_bytes, tokens_that_fit

FP8 = torch.float8_e4m3fn


def random_case(num_tokens, num_heads, head_dim, num_blocks, block_size, dtype, device="cpu",
                pad_every=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if pad_every:
        slots[::pad_every] = -1
    key = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(device, dtype)
    value = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(device, dtype)
    return key, value, slots.to(device)


def run_both(key, value, slots, num_blocks, block_size, dtype, scales=(None, None)):
    shape = (num_blocks, block_size, key.shape[1], key.shape[2])
    caches = [torch.full(shape, 7, device=key.device, dtype=torch.float32).to(dtype)
              for _ in range(4)]
    store_kv(key, value, caches[0], caches[1], slots, *scales)
    store_kv_ref(key, value, caches[2], caches[3], slots, *scales)
    return caches


# ---------------------------------------------------------------- kernel vs reference (CPU)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens, num_heads, head_dim, num_blocks, block_size, pad_every", [
    (1, 1, 64, 1, 16, 0),       # one token
    (37, 3, 40, 8, 16, 0),      # heads and head_dim not powers of two, tokens not a block multiple
    (20, 2, 128, 4, 8, 3),      # padding tokens (slot -1) scattered through the batch
    (5, 8, 16, 2, 4, 0),        # more heads than fit one program's tile width
])
def test_store_kv_matches_the_reference_under_the_interpreter(
        dtype, num_tokens, num_heads, head_dim, num_blocks, block_size, pad_every):
    key, value, slots = random_case(num_tokens, num_heads, head_dim, num_blocks, block_size,
                                    dtype, pad_every=pad_every, seed=num_tokens)
    k, v, k_ref, v_ref = run_both(key, value, slots, num_blocks, block_size, dtype)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref), \
        "a copy is exact: any difference is a wrong slot, head or dim"


def test_store_kv_takes_int32_slots_as_the_engine_builds_them():
    key, value, slots = random_case(37, 3, 40, 8, 16, torch.float32, pad_every=4, seed=3)
    k, v, k_ref, v_ref = run_both(key, value, slots.int(), 8, 16, torch.float32)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.gpu
def test_store_kv_launches_one_kernel_for_int32_slots():
    from torch.profiler import ProfilerActivity, profile
    key, value, slots = random_case(9, 8, 128, 4, 16, torch.bfloat16, "cuda", seed=5)
    caches = [torch.zeros(4, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    slots = slots.int()
    store_kv(key, value, *caches, slots, check=False)  # compiled before the trace
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        store_kv(key, value, *caches, slots, check=False)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert kernels == ["store_kv_kernel"], f"a cast kernel per layer is host time: {kernels}"


def test_store_kv_with_no_tokens_writes_nothing():
    key, value, slots = random_case(0, 2, 32, 2, 4, torch.float32)
    k, v, _, _ = run_both(key, value, slots, 2, 4, torch.float32)
    assert (k == 7).all() and (v == 7).all()


def test_store_kv_leaves_padding_and_untouched_slots_alone():
    key, value, slots = random_case(6, 2, 32, 4, 4, torch.float32, pad_every=2)
    k, _, _, _ = run_both(key, value, slots, 4, 4, torch.float32)
    written = set(slots[slots >= 0].tolist())
    for s in range(16):
        if s not in written:
            assert (k.view(16, 2, 32)[s] == 7).all(), f"slot {s} was not asked for but changed"


def test_store_kv_reads_keys_from_a_strided_qkv_projection():
    qkv = torch.randn(9, 3, 4, 32)  # [tokens, (q, k, v), heads, head_dim]: k is a strided view
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.arange(9) * 2
    k, v, k_ref, v_ref = run_both(key, value, slots, 5, 4, torch.float32)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.parametrize("bad, match", [
    (lambda k, v, kc, vc, s: (k[:, :1], v, kc, vc, s), "key and value"),
    (lambda k, v, kc, vc, s: (k, v, kc, vc, s[:-1]), "slot_mapping"),
    (lambda k, v, kc, vc, s: (k, v, kc, vc, s.float()), "int32 or int64"),
    (lambda k, v, kc, vc, s: (k, v, kc[..., :16], vc[..., :16], s), "do not match"),
])
def test_store_kv_refuses_mismatched_inputs(bad, match):
    key, value, slots = random_case(4, 2, 32, 2, 4, torch.float32)
    kc = torch.zeros(2, 4, 2, 32)
    with pytest.raises(ValueError, match=match):
        store_kv(*bad(key, value, kc, kc.clone(), slots))


def test_an_fp8_cache_needs_scales():
    key, value, slots = random_case(4, 2, 32, 2, 4, torch.float32)
    kc = torch.zeros(2, 4, 2, 32, dtype=FP8)
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        store_kv_ref(key, value, kc, kc.clone(), slots)


# ---------------------------------------------------------------- the cache object
def test_tokens_written_through_the_block_manager_read_back_in_order():
    bm = BlockManager(8, 4)
    cache = PagedKVCache(2, 3, 16, num_blocks=8, block_size=4, dtype=torch.float32)
    bm.allocate("x", list(range(3)))                     # so that "a" does not start at block 0
    bm.allocate("a", list(range(10)))
    key, value = torch.randn(10, 3, 16), torch.randn(10, 3, 16)
    slots = torch.tensor(bm.slots("a", 0, 10))
    cache.write(1, key, value, slots)
    k, v = cache.gather(1, bm.block_table("a"), 10)
    assert torch.equal(k, key) and torch.equal(v, value)
    assert (cache.key_cache(0) == 0).all(), "layer 0 was not written"


def test_copy_on_write_copies_every_layer_k_and_v_of_the_block():
    bm = BlockManager(8, 4)
    cache = PagedKVCache(3, 2, 8, num_blocks=8, block_size=4, dtype=torch.float32)
    bm.allocate("a", list(range(6)))
    for layer in range(3):
        cache.write(layer, torch.randn(6, 2, 8), torch.randn(6, 2, 8),
                    torch.tensor(bm.slots("a", 0, 6)))
    bm.fork("a", "b")
    copies = bm.append_token("b", 99)
    cache.copy_blocks(copies)
    for layer in range(3):
        ka, va = cache.gather(layer, bm.block_table("a"), 6)
        kb, vb = cache.gather(layer, bm.block_table("b"), 6)
        assert torch.equal(ka, kb) and torch.equal(va, vb), f"layer {layer} lost the prefix"


def test_fp8_cache_round_trips_within_e4m3_precision():
    cache = PagedKVCache(1, 4, 32, num_blocks=4, block_size=4, dtype=FP8)
    key, value = torch.randn(10, 4, 32) * 5, torch.randn(10, 4, 32) * 0.01
    cache.set_scales(0, key, value)
    cache.write(0, key, value, torch.arange(10), use_kernel=False)
    k, v = cache.gather(0, [0, 1, 2], 10)
    # e4m3 keeps 3 mantissa bits: relative error up to 2**-4, plus the subnormal floor.
    for got, want in ((k, key), (v, value)):
        amax = want.abs().amax()
        assert ((got - want).abs() <= want.abs() * 2**-4 + amax * 2**-9).all()


def test_memory_estimate_for_a_llama_3_8b_shape():
    bf16 = KVCacheShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    fp8 = KVCacheShape(num_layers=32, num_kv_heads=8, head_dim=128, dtype=FP8)
    assert bf16.bytes_per_token == 128 * 1024, "2 (K,V) x 32 layers x 8 heads x 128 x 2 bytes"
    assert fp8.bytes_per_token == bf16.bytes_per_token // 2
    assert kv_cache_bytes(fp8, 1000) == 1000 * 64 * 1024 + 2 * 32 * 8 * 4, "plus per-head scales"
    assert tokens_that_fit(bf16, 2**30, block_size=16) == 8192
    assert tokens_that_fit(fp8, 2**30 + 2 * 32 * 8 * 4, block_size=16) == 16384


def test_a_cache_sized_for_a_memory_budget_fits_in_it():
    shape = KVCacheShape(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16)
    cache = PagedKVCache.for_memory(shape, 100_000, block_size=8)
    assert cache.nbytes <= 100_000 < cache.nbytes + shape.bytes_per_token * 8, \
        "as many whole blocks as the budget holds, and no more"
    with pytest.raises(ValueError, match="give more memory"):
        PagedKVCache.for_memory(shape, 100, block_size=8)


def test_cache_config_errors_say_what_to_change():
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        KVCacheShape(32, 0, 128)
    with pytest.raises(ValueError, match="dtype"):
        KVCacheShape(32, 8, 128, torch.int8)
    with pytest.raises(ValueError, match="power of two"):
        PagedKVCache(1, 1, 8, num_blocks=4, block_size=6)


# ---------------------------------------------------------------- on the GPU
@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, num_heads, head_dim, block_size", [
    (1, 8, 128, 16), (1000, 8, 128, 16), (333, 4, 64, 256), (77, 2, 256, 32), (50, 5, 96, 16)])
def test_store_kv_matches_the_reference_on_the_gpu_bf16(num_tokens, num_heads, head_dim,
                                                        block_size):
    num_blocks = -(-num_tokens // block_size) + 3
    key, value, slots = random_case(num_tokens, num_heads, head_dim, num_blocks, block_size,
                                    torch.bfloat16, "cuda", pad_every=5)
    k, v, k_ref, v_ref = run_both(key, value, slots, num_blocks, block_size, torch.bfloat16)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, num_heads, head_dim", [(1, 8, 128), (517, 8, 128),
                                                             (64, 3, 64)])
def test_store_kv_matches_the_reference_on_the_gpu_fp8(num_tokens, num_heads, head_dim):
    num_blocks = -(-num_tokens // 16) + 2
    key, value, slots = random_case(num_tokens, num_heads, head_dim, num_blocks, 16,
                                    torch.bfloat16, "cuda", pad_every=7)
    key = key * 20
    scales = (key.float().abs().amax(dim=(0, 2)) / 448 + 1e-6,
              torch.rand(num_heads, device="cuda") + 0.5)
    k, v, k_ref, v_ref = run_both(key, value, slots, num_blocks, 16, FP8, scales)
    for got, want in ((k, k_ref), (v, v_ref)):
        diff = (got.float() - want.float()).abs()
        # Same rounding expected; allow one e4m3 step (2**-3 relative) if the division rounds
        # differently on the two paths.
        assert (diff <= want.float().abs() * 2**-3 + 2**-9).all()
        assert (diff > 0).float().mean() < 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_addresses_caches_beyond_2_31_elements(slot_dtype):
    num_blocks, block_size, num_heads, head_dim = 140_000, 16, 8, 128  # 2.3e9 elements per cache
    k_cache = torch.zeros(num_blocks, block_size, num_heads, head_dim, device="cuda",
                          dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([num_blocks * block_size - 1, 5, num_blocks * block_size // 2 + 3],
                         device="cuda", dtype=slot_dtype)
    key = torch.randn(3, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    store_kv(key, key, k_cache, v_cache, slots)
    flat = k_cache.view(-1, num_heads, head_dim)
    assert torch.equal(flat[slots.long()], key), "int32 offsets would wrap past 2**31 elements"
    del k_cache, v_cache
    torch.cuda.empty_cache()
