"""Notebook 05's lesson: its claims hold on its own workloads and fail when the numbers behind
them are perturbed (the schemes swapped, the pool sizes reversed, a fork that did not copy, the
two fp8 scales swapped); the MHA / GQA / MLA memory rows follow from the config's dims. The
TTFT a prefix hit saves is tested in test_paged_kv_cache_ttft.py."""
import pandas as pd
import pytest
import torch

from labkit.lessons.paged_kv_cache import attention_memory as am
from labkit.lessons.paged_kv_cache import claims as pc
from labkit.lessons.paged_kv_cache import fp8_scales
from labkit.lessons.paged_kv_cache import memory as bmap
from labkit.lessons.paged_kv_cache import prefix_workload as pw


@pytest.fixture(scope="module")
def workloads():
    requests = bmap.sample_requests(300, 4096, seed=0)
    memory = bmap.compare_memory(requests, [4096 * k for k in (4, 16, 64)], 4096, 16)
    by_block = bmap.utilisation_by_block_size(requests, 16 * 4096, 4096)
    prompts = pw.chat_workload(120, seed=1)
    on = pw.run_prefix_workload(prompts, num_blocks=256)
    off = pw.run_prefix_workload(prompts, num_blocks=256, enable_prefix_caching=False)
    pressure = pd.DataFrame([pw.run_prefix_workload(prompts, n) for n in (48, 128, 384)])
    return memory, by_block, on, off, pressure


def test_the_claims_hold_on_the_notebooks_workloads(workloads):
    memory, by_block, on, off, pressure = workloads
    made = (pc.memory_claims(memory, by_block, 16) + pc.prefix_claims(on, off, pressure)
            + [pc.copy_on_write_claim([(2, 3)], True)])
    assert len(made) == 6 and all(c.held for c in made), [c.text for c in made if not c.held]


def test_the_memory_claims_fail_with_paged_and_contiguous_swapped(workloads):
    memory, by_block, *_ = workloads
    flip = {"contiguous": "paged (block 16)", "paged (block 16)": "contiguous"}
    swapped = memory.assign(scheme=memory.scheme.map(flip))
    gain, used, _ = pc.memory_claims(swapped, by_block, 16)
    assert not gain.held and not used.held


def test_the_block_size_claim_fails_when_big_blocks_waste_less(workloads):
    memory, by_block, *_ = workloads
    paged = by_block.scheme != "contiguous"
    reversed_use = by_block.copy()
    reversed_use.loc[paged, "utilisation"] = by_block.utilisation[paged].values[::-1]
    assert not pc.memory_claims(memory, reversed_use, 16)[2].held


def test_the_prefix_claims_fail_with_caching_on_and_off_swapped_or_pools_reversed(workloads):
    _, _, on, off, pressure = workloads
    assert not pc.prefix_claims(off, on, pressure)[0].held
    reversed_pools = pressure.assign(num_blocks=pressure.num_blocks.values[::-1])
    assert not pc.prefix_claims(on, off, reversed_pools)[1].held


def test_a_fork_that_copied_nothing_or_reads_other_kv_fails_its_claim():
    assert not pc.copy_on_write_claim([], True).held
    assert not pc.copy_on_write_claim([(2, 3)], False).held


# --- what one token costs: MHA, GQA and MLA of DeepSeek-V3's dims ------------------------------
def test_mla_caches_one_latent_of_rank_plus_rope_per_token_and_layer_for_all_heads():
    assert am.cached_values_per_token_layer(am.DEEPSEEK_V3, "MLA") == 512 + 64
    # MHA of the same dims: every head's 192-wide key (128 + 64 rope) and 128-wide value
    assert am.cached_values_per_token_layer(am.DEEPSEEK_V3, "MHA") == 128 * (192 + 128)
    assert am.cached_values_per_token_layer(am.DEEPSEEK_V3, "GQA", 8) == 8 * (192 + 128)


def test_the_memory_table_gives_bytes_and_tokens_per_gib_of_each_scheme():
    table = am.attention_memory_table(am.DEEPSEEK_V3, gqa_kv_heads=8, bytes_per_value=2)
    mha, gqa, mla = table.to_dict("records")
    assert mla["bytes per token"] == 576 * 61 * 2
    assert mha["bytes per token"] == 40960 * 61 * 2 and gqa["bytes per token"] == 2560 * 61 * 2
    assert mla["tokens per GiB"] == 2**30 // (576 * 61 * 2)
    assert mha["bytes vs MLA"] == pytest.approx(40960 / 576) and mla["bytes vs MLA"] == 1
    fp8 = am.attention_memory_table(am.DEEPSEEK_V3, bytes_per_value=1)
    assert fp8["bytes per token"].tolist() == [b // 2 for b in table["bytes per token"]]


def test_a_gqa_row_whose_kv_heads_do_not_divide_the_heads_or_an_unknown_scheme_is_refused():
    with pytest.raises(ValueError, match="kv_heads=5 must divide num_attention_heads=128"):
        am.cached_values_per_token_layer(am.DEEPSEEK_V3, "GQA", 5)
    with pytest.raises(ValueError, match="scheme must be 'MHA', 'GQA' or 'MLA'"):
        am.cached_values_per_token_layer(am.DEEPSEEK_V3, "MQA")
    with pytest.raises(ValueError, match="kv_lora_rank"):
        am.AttentionDims(61, 128, 128, 64, 128, kv_lora_rank=0)


# --- fp8 scales: per tensor against per head, and a stale scale --------------------------------
@pytest.fixture(scope="module")
def granularity():
    return fp8_scales.scale_granularity(fp8_scales.heads_of_different_magnitudes(seed=3))


def test_per_head_scales_read_back_what_the_cache_calibrated_and_match_per_tensor_on_one_head():
    key = fp8_scales.heads_of_different_magnitudes(num_tokens=32, num_heads=1, seed=1)
    head, tensor = fp8_scales.per_head_scale(key), fp8_scales.per_tensor_scale(key)
    assert torch.equal(head, tensor)  # one head: the two granularities are the same scale
    back = fp8_scales.fp8_roundtrip(key, head)
    assert back.dtype == torch.float32 and back.shape == key.shape
    assert float(fp8_scales.relative_error(key, back, dims=None)) < 0.05


def test_the_granularity_claim_holds_and_fails_with_the_two_scales_swapped(granularity):
    assert pc.fp8_granularity_claim(granularity).held
    swapped = granularity.rename(columns={"error, per-tensor scale": "error, per-head scale",
                                          "error, per-head scale": "error, per-tensor scale"})
    assert not pc.fp8_granularity_claim(swapped).held


def test_the_granularity_claim_fails_when_the_heads_are_close_in_size():
    close = fp8_scales.scale_granularity(fp8_scales.heads_of_different_magnitudes(smallest=0.1))
    assert not pc.fp8_granularity_claim(close).held


def test_a_stale_scale_clips_and_the_claim_fails_with_stale_and_on_the_fly_swapped():
    table = fp8_scales.stale_scale(growth=2.0, seed=2)
    assert table["clipped share"].iloc[1] > 0.01 and table["clipped share"].iloc[2] == 0
    assert pc.stale_scale_claim(table).held
    assert not pc.stale_scale_claim(table.iloc[[0, 2, 1]].reset_index(drop=True)).held
