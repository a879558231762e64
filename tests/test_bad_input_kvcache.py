"""Bad input to the KV cache, store_kv, the block manager and the prefix cache: each call is
refused with an error that names the parameter, the value and the limit, and leaves the object
exactly as it was (tensors compared with a clone taken before, the manager with its snapshot)."""
import pytest
import torch

from labkit.kernels.store_kv import store_kv, store_kv_ref
from labkit.kvcache import (BlockManager, KVCacheShape, PagedKVCache, PrefixCache, kv_cache_bytes,
                            tokens_that_fit)

FP8 = torch.float8_e4m3fn
STORES = [store_kv, store_kv_ref]


def small_cache(dtype=torch.float32, num_layers=2, heads=1):
    """2 blocks of 4 slots: capacity 8, and layer 1 lies right after layer 0 in memory."""
    cache = PagedKVCache(num_layers, heads, 16, 2, 4, dtype=dtype)
    cache.kv.copy_(torch.randn(cache.kv.shape).to(dtype))
    return cache


def snapshot(cache):
    scales = () if cache.k_scale is None else (cache.k_scale.clone(), cache.v_scale.clone())
    return cache.kv.clone(), scales


def assert_unchanged(cache, before):
    kv, scales = before
    assert torch.equal(cache.kv.float(), kv.float()), "a refused call changed the KV tensor"
    if scales:
        assert torch.equal(cache.k_scale, scales[0]) and torch.equal(cache.v_scale, scales[1]), \
            "a refused call changed the fp8 scales"


def kv(num_tokens, heads=1):
    return torch.randn(num_tokens, heads, 16), torch.randn(num_tokens, heads, 16)


# ---------------------------------------------------------------- slots (store_kv, write)
@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("slot", [8, 9, 10**6, -2, -10**6])
def test_a_slot_outside_the_cache_is_refused_before_anything_is_written(use_kernel, slot):
    cache = small_cache()
    before = snapshot(cache)
    k, v = kv(2)
    with pytest.raises(ValueError, match=rf"slot {slot}, outside \[-1, 8\)"):
        cache.write(0, k, v, torch.tensor([0, slot]), use_kernel=use_kernel)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("store", STORES)
def test_store_kv_refuses_a_slot_past_the_end_of_a_bare_cache(store):
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    k, v = kv(1)
    with pytest.raises(ValueError, match=r"slot 8, outside \[-1, 8\).*2 blocks x 4 slots"):
        store(k, v, k_cache, v_cache, torch.tensor([8], dtype=torch.int32))
    assert (k_cache == 0).all() and (v_cache == 0).all()


@pytest.mark.parametrize("store", STORES)
def test_two_tokens_in_one_slot_are_refused(store):
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    k, v = kv(3)
    with pytest.raises(ValueError, match="slot 5 to more than one token"):
        store(k, v, k_cache, v_cache, torch.tensor([5, -1, 5]))
    assert (k_cache == 0).all() and (v_cache == 0).all()


@pytest.mark.parametrize("store", STORES)
def test_padding_slots_stay_allowed_and_unwritten(store):
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    k, v = kv(3)
    store(k, v, k_cache, v_cache, torch.tensor([-1, 7, -1]))
    assert torch.equal(k_cache.view(8, 1, 16)[7], k[1])
    assert (k_cache.view(8, 1, 16)[:7] == 0).all()


def test_check_false_skips_reading_the_slots():
    """check=False is the caller's promise (the engine builds its slots itself): in-range slots
    are written as usual, without the sort and host sync of the check."""
    cache = small_cache()
    k, v = kv(2)
    cache.write(1, k, v, torch.tensor([3, 6]), check=False)
    assert torch.equal(cache.key_cache(1).reshape(8, 1, 16)[[3, 6]], k)


@pytest.mark.parametrize("store", STORES)
def test_integer_keys_are_a_type_error_not_a_silent_cast(store):
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    k, v = kv(1)
    with pytest.raises(TypeError, match="key must be a floating-point tensor.*int64"):
        store((k * 10).long(), v, k_cache, v_cache, torch.tensor([0]))
    assert (k_cache == 0).all()


def test_a_slot_mapping_that_is_not_a_tensor_is_a_type_error_naming_it():
    cache = small_cache()
    k, v = kv(1)
    with pytest.raises(TypeError, match="slot_mapping must be a torch.Tensor, got list"):
        cache.write(0, k, v, [0])


@pytest.mark.parametrize("store", STORES)
def test_tensors_on_another_device_are_refused_by_name(store):
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    k, v = kv(1)
    with pytest.raises(ValueError, match="key on meta.*k_cache on cpu"):
        store(k.to("meta"), v.to("meta"), k_cache, v_cache, torch.tensor([0]))
    assert (k_cache == 0).all()


# ---------------------------------------------------------------- layers, blocks, lengths
@pytest.mark.parametrize("layer", [2, 5, -1, -2])
def test_a_layer_outside_the_cache_is_refused_everywhere(layer):
    cache = small_cache()
    before = snapshot(cache)
    k, v = kv(1)
    for call in (lambda: cache.write(layer, k, v, torch.tensor([0])),
                 lambda: cache.gather(layer, [0], 1), lambda: cache.key_cache(layer),
                 lambda: cache.value_cache(layer), lambda: cache.scales(layer)):
        with pytest.raises(ValueError, match=rf"layer {layer} is outside \[0, 2\)"):
            call()
    assert_unchanged(cache, before)


def test_a_layer_that_is_not_an_int_is_a_type_error():
    with pytest.raises(TypeError, match="layer must be an int in"):
        small_cache().gather(0.0, [0], 1)


@pytest.mark.parametrize("block", [-1, 2, 10**6])
def test_gather_refuses_block_ids_outside_the_cache(block):
    with pytest.raises(ValueError, match=rf"block_table\[1\] is block {block}, outside \[0, 2\)"):
        small_cache().gather(0, [0, block], 5)


def test_gather_refuses_a_block_id_that_is_not_an_int():
    with pytest.raises(TypeError, match=r"block_table\[0\] must be a block id.*float 0.5"):
        small_cache().gather(0, [0.5], 1)


@pytest.mark.parametrize("num_tokens, error, match", [
    (-3, ValueError, "num_tokens must be >= 0"), (9, ValueError, "9 tokens need 3 blocks"),
    (1.5, TypeError, "num_tokens must be an int"), (True, TypeError, "num_tokens must be an int")],
    ids=["negative", "too many", "float", "bool"])
def test_gather_refuses_a_length_outside_zero_to_the_tables_capacity(num_tokens, error, match):
    with pytest.raises(error, match=match):
        small_cache().gather(0, [0, 1], num_tokens)


def test_gather_of_zero_tokens_is_empty():
    k, v = small_cache().gather(0, [0, 1], 0)
    assert k.shape == v.shape == (0, 1, 16)


@pytest.mark.parametrize("copies, error, match", [
    ([(0, -1)], ValueError, r"dst\[0\] is block -1, outside \[0, 2\)"),
    ([(-1, 0)], ValueError, r"src\[0\] is block -1"),
    ([(0, 5)], ValueError, r"dst\[0\] is block 5"),
    ([(0.5, 1)], TypeError, r"src\[0\] must be a block id"),
    ([(0, 1, 1)], ValueError, "pairs"),
    ([0], TypeError, "list of \\(src, dst\\) block pairs")],
    ids=["dst -1", "src -1", "dst past the end", "float id", "triple", "not pairs"])
def test_copy_blocks_refuses_bad_block_ids_and_copies_nothing(copies, error, match):
    cache = small_cache()
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        cache.copy_blocks(copies)
    assert_unchanged(cache, before)


# ---------------------------------------------------------------- fp8 scales
@pytest.mark.parametrize("poison", [float("nan"), float("inf"), -float("inf")])
def test_set_scales_refuses_a_non_finite_sample_and_names_the_head(poison):
    cache = small_cache(FP8, heads=3)
    before = snapshot(cache)
    key, value = torch.randn(4, 3, 16), torch.randn(4, 3, 16)
    value[2, 1, 5] = poison
    with pytest.raises(ValueError, match="value sample of layer 1, head 1 holds NaN or inf"):
        cache.set_scales(1, key, value)
    assert_unchanged(cache, before)
    assert not torch.isnan(cache.k_scale).any()


@pytest.mark.parametrize("key, error, match", [
    (torch.randn(4, 2, 16), ValueError, r"\[num_tokens >= 1, 3, 16\].*got \(4, 2, 16\)"),
    (torch.randn(0, 3, 16), ValueError, r"got \(0, 3, 16\)"),
    (torch.randn(4, 3), ValueError, r"got \(4, 3\)"),
    ([1.0], TypeError, "must be a floating-point tensor.*got list"),
    (torch.ones(4, 3, 16, dtype=torch.int32), TypeError, "got torch.int32")],
    ids=["wrong heads", "no tokens", "2-D", "a list", "int"])
def test_set_scales_refuses_a_bad_sample_without_changing_either_scale(key, error, match):
    cache = small_cache(FP8, heads=3)
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        cache.set_scales(0, torch.randn(4, 3, 16), key)   # the good key must not be applied
    with pytest.raises(error, match=match):
        cache.set_scales(0, key, torch.randn(4, 3, 16))
    assert_unchanged(cache, before)


# ---------------------------------------------------------------- memory estimates
def test_memory_helpers_refuse_a_zero_block_size_and_negative_counts():
    shape = KVCacheShape(2, 2, 16, torch.float16)
    for call in (lambda: tokens_that_fit(shape, 10**6, block_size=0),
                 lambda: PagedKVCache.for_memory(shape, 10**6, block_size=0)):
        with pytest.raises(ValueError, match="block_size must be a power of two"):
            call()
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        kv_cache_bytes(shape, -5)
    with pytest.raises(TypeError, match="memory_bytes must be a finite number"):
        tokens_that_fit(shape, float("nan"))


def test_a_memory_budget_may_be_written_as_a_float():
    shape = KVCacheShape(2, 2, 16, torch.float16)
    assert tokens_that_fit(shape, 1e6) == tokens_that_fit(shape, 10**6)
    assert PagedKVCache.for_memory(shape, 1e6).num_blocks == tokens_that_fit(shape, 10**6) // 16


# ---------------------------------------------------------------- the block manager
@pytest.mark.parametrize("caching", [True, False], ids=["caching on", "caching off"])
@pytest.mark.parametrize("tokens, error, match", [
    (["a", "b"], TypeError, r"token_ids\[0\] is str 'a'"),
    ([1, 2.5], TypeError, r"token_ids\[1\] is float 2.5"),
    ([1, True], TypeError, r"token_ids\[1\] is a bool"),
    ([2**64], ValueError, r"in \[-2\*\*63, 2\*\*63\): token_ids\[0\] is 18446744073709551616"),
    ("hello", TypeError, "token_ids must be a list of ints, got str"),
    (None, TypeError, "token_ids must be a list of ints, got NoneType"),
    (iter([1, 2]), TypeError, "token_ids must be a list of ints")],
    ids=["str", "float", "bool", "too big", "a string", "None", "an iterator"])
def test_bad_token_ids_are_refused_the_same_way_with_caching_on_or_off(caching, tokens, error,
                                                                        match):
    bm = BlockManager(8, 4, enable_prefix_caching=caching)
    bm.allocate("x", [1, 2, 3, 4, 5])
    before = bm.snapshot()
    for call in (lambda: bm.allocate("s", tokens), lambda: bm.can_allocate(tokens),
                 lambda: bm.cached_prefix_len(tokens)):
        with pytest.raises(error, match=match):
            call()
    assert bm.snapshot() == before


@pytest.mark.parametrize("caching", [True, False], ids=["caching on", "caching off"])
@pytest.mark.parametrize("token", ["x", 1.5, True])
def test_a_bad_appended_or_set_token_is_refused_with_caching_on_or_off(caching, token):
    bm = BlockManager(8, 4, enable_prefix_caching=caching)
    bm.allocate("a", [1, 2, 3])
    before = bm.snapshot()
    with pytest.raises(TypeError, match="token ids must be ints.*token_id is"):
        bm.append_token("a", token)
    assert bm.snapshot() == before
    bm.append_token("a", None)
    before = bm.snapshot()
    with pytest.raises(TypeError, match="token ids must be ints.*token_id is"):
        bm.set_token("a", token)
    assert bm.snapshot() == before and bm.has_pending("a")


@pytest.mark.parametrize("block", [-1, 8, 10**6])
def test_block_ids_outside_the_manager_are_refused(block):
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(30)))   # block 7, the one -1 would wrap to, is in use
    for call in (bm.ref_count, bm.is_cached):
        with pytest.raises(ValueError, match=rf"block {block} is outside \[0, 8\)"):
            call(block)
    with pytest.raises(TypeError, match="block must be an int"):
        bm.ref_count(1.0)


def test_block_manager_options_must_be_what_they_say():
    with pytest.raises(TypeError, match="enable_prefix_caching must be True or False, got 'no'"):
        BlockManager(8, 4, enable_prefix_caching="no")    # bool("no") would switch it on
    with pytest.raises(TypeError, match="hash_fn must be a function"):
        BlockManager(8, 4, hash_fn=None)


def test_slots_refuses_positions_that_are_not_ints():
    bm = BlockManager(8, 4)
    bm.allocate("a", [1, 2, 3])
    with pytest.raises(TypeError, match="start must be an int token position, got float"):
        bm.slots("a", 0.5, 2)


# ---------------------------------------------------------------- the prefix cache
@pytest.mark.parametrize("block", [-1, 4])
def test_registering_a_block_outside_the_cache_changes_nothing(block):
    cache = PrefixCache(4)
    before = cache.snapshot()
    with pytest.raises(ValueError, match=rf"block {block} is outside \[0, 4\)"):
        cache.register(block, b"h", (b"", b""))
    assert cache.snapshot() == before
    assert cache.lookup(b"h", (b"", b"")) is None


def test_a_registered_block_cannot_be_registered_again_under_another_hash():
    cache = PrefixCache(4)
    cache.register(0, b"a", (b"", b"1"))
    before = cache.snapshot()
    with pytest.raises(ValueError, match="block 0 is already registered"):
        cache.register(0, b"b", (b"", b"2"))
    assert cache.snapshot() == before


def test_only_registered_blocks_can_be_parked_and_only_parked_ones_revived_or_evicted():
    cache = PrefixCache(4)
    with pytest.raises(ValueError, match=r"park\(1\): the block is not registered"):
        cache.park(1)
    with pytest.raises(ValueError, match=r"revive\(2\): the block is not evictable"):
        cache.revive(2)
    with pytest.raises(ValueError, match="no block is evictable"):
        cache.evict()
    assert cache.snapshot() == PrefixCache(4).snapshot()


@pytest.mark.parametrize("num_blocks", [0, -1, 2.0])
def test_a_prefix_cache_needs_a_positive_block_count(num_blocks):
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        PrefixCache(num_blocks)
