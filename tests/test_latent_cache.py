"""An MLA latent cache: one shared row per token and layer, read by paged_mla_attention."""
import math

import pytest
import torch

import labkit  # noqa: F401
from labkit.attention import paged_mla_attention, paged_mla_attention_ref
from labkit.kvcache import BlockManager, KVCacheShape, PagedKVCache, tokens_that_fit

RANK, ROPE = 32, 16


def test_a_latent_token_costs_one_row_where_gqa_costs_a_k_and_a_v():
    # DeepSeek-V3's latent (512 + 64) against a Llama-70B-style GQA layer (8 KV heads of 128)
    mla = KVCacheShape(61, 1, 512 + 64, torch.bfloat16, latent=True)
    gqa = KVCacheShape(61, 8, 128, torch.bfloat16)
    assert mla.bytes_per_token == 61 * 576 * 2
    assert gqa.bytes_per_token == 61 * 2 * 8 * 128 * 2
    budget = 2**30
    assert tokens_that_fit(mla, budget, 64) == budget // (mla.bytes_per_token * 64) * 64
    assert tokens_that_fit(mla, budget, 64) > 3 * tokens_that_fit(gqa, budget, 64)
    cache = PagedKVCache.for_memory(mla, 2**22, block_size=16)
    assert cache.nbytes <= 2**22 and cache.latent_cache(0).shape[1:] == (16, 576)


def test_latents_written_through_the_block_manager_are_what_the_mla_kernel_attends_over():
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(2, 1, RANK + ROPE, num_blocks=12, block_size=8, dtype=torch.float32,
                         latent=True)
    blocks = BlockManager(12, 8, enable_prefix_caching=False)
    lens = [19, 5]
    for seq, n in enumerate(lens):
        blocks.allocate(seq, list(range(n)))
    slots = torch.tensor(blocks.slots(0, 0, 19) + blocks.slots(1, 0, 5))
    latents = torch.randn(sum(lens), RANK + ROPE, generator=g)
    cache.write_latent(1, latents, slots)
    assert cache.latent_cache(0).abs().sum() == 0, "another layer's rows were written"
    rows, _ = cache.gather(1, blocks.block_table(0), 19)
    assert torch.equal(rows[:, 0], latents[:19])
    # the kernel reads the same rows through the block tables
    width = max(len(blocks.block_table(s)) for s in (0, 1))
    table = torch.tensor([blocks.block_table(s) + [0] * (width - len(blocks.block_table(s)))
                          for s in (0, 1)], dtype=torch.int32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q_latent, q_rope = torch.randn(2, 4, RANK, generator=g), torch.randn(2, 4, ROPE, generator=g)
    args = (q_latent, q_rope, cache.latent_cache(1), table, cu, seq_lens)
    scale = 1 / math.sqrt(40)
    out = paged_mla_attention(*args, scale=scale)
    # against attention written out over the latents as they were produced
    c_kv, k_pe = latents[:19, :RANK], latents[:19, RANK:]
    s = (q_latent[0] @ c_kv.T + q_rope[0] @ k_pe.T) * scale
    assert torch.allclose(out[0], torch.softmax(s, -1) @ c_kv, atol=1e-4)
    assert torch.allclose(out.double(), paged_mla_attention_ref(*args, scale=scale), atol=1e-4)


def test_padding_slots_write_nothing_and_bad_slots_write_nothing_at_all():
    cache = PagedKVCache(1, 1, RANK + ROPE, num_blocks=2, block_size=8, dtype=torch.float32,
                         latent=True)
    cache.write_latent(0, torch.ones(3, RANK + ROPE), torch.tensor([-1, 4, -1]))
    assert cache.latent_cache(0).view(16, -1).sum(1).nonzero().flatten().tolist() == [4]
    before = cache.kv.clone()
    for slots, words in (([1, 16, 2], r"slot 16, outside \[-1, 16\)"),
                         ([1, 1, 2], "gives slot 1 to more than one token"),
                         ([0, -2, 3], r"slot -2, outside \[-1, 16\)")):
        with pytest.raises(ValueError, match=words):
            cache.write_latent(0, torch.full((3, RANK + ROPE), 7.0), torch.tensor(slots))
    assert torch.equal(cache.kv, before), "a refused write changed the cache"


@pytest.mark.parametrize("make,error,words", [
    (lambda: KVCacheShape(4, 2, 576, latent=True), ValueError, "num_kv_heads must be 1"),
    (lambda: KVCacheShape(4, 1, 576, torch.float8_e4m3fn, latent=True), ValueError, "fp8"),
    (lambda: KVCacheShape(4, 1, 576, latent="yes"), TypeError, "latent must be True or False"),
    (lambda: PagedKVCache(1, 1, 48, 2, 8, torch.float32, latent=True).key_cache(0), ValueError,
     "latent_cache"),
    (lambda: PagedKVCache(1, 2, 16, 2, 8, torch.float32).latent_cache(0), ValueError,
     "key_cache and value_cache"),
    (lambda: PagedKVCache(1, 1, 48, 2, 8, torch.float32, latent=True).write_latent(
        0, torch.zeros(2, 40), torch.tensor([0, 1])), ValueError, r"\[num_tokens, 48\]"),
])
def test_latent_cache_errors_say_what_to_change(make, error, words):
    with pytest.raises(error, match=words):
        make()
