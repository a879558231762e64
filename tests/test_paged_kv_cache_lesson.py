"""Notebook 05's lesson: its claims hold on its own workloads and fail when the numbers behind
them are perturbed (the schemes swapped, the pool sizes reversed, a fork that did not copy)."""
import pandas as pd
import pytest

from labkit.lessons.paged_kv_cache import claims as pc
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
