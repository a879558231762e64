"""The time to first token a prefix-cache hit saves (notebook 05): both engines serve the same
bursts, the cached one hits the whole system prompt's full blocks and the other nothing, and the
claim holds on timings where caching wins by the bound in every round and fails when the two
cases' timings are swapped or one round falls short."""
import pytest
import torch

from labkit.lessons.paged_kv_cache import claims as pc
from labkit.lessons.paged_kv_cache import prefix_ttft as pt
from labkit.measure.bench import Timing
from labkit.measure.rounds import Rounds


def _timing(ms: float) -> Timing:
    us = ms * 1e3
    return Timing(us, us, us, us, 4, "cpu", "engine TTFT")


def _result(cached_ms, uncached_ms, cached_tokens=None) -> pt.PrefixTTFT:
    rounds = Rounds({pt.CACHED: tuple(map(_timing, cached_ms)),
                     pt.UNCACHED: tuple(map(_timing, uncached_ms))},
                    tuple((pt.CACHED, pt.UNCACHED) for _ in cached_ms))
    return pt.PrefixTTFT(rounds, system_prompt_len=512, question_len=16, burst=2, block_size=16,
                         cached_tokens=cached_tokens or {pt.CACHED: 512, pt.UNCACHED: 0},
                         model="tiny")


@pytest.fixture(scope="module")
def measured():
    model = pt.model_for(torch.device("cpu"), quick=True, context=100)
    return pt.time_prefix_ttft(model, system_prompt_len=70, question_len=9, burst=2, rounds=3,
                               repeats=1)


def test_the_cached_engine_hits_the_system_prompts_full_blocks_and_the_other_none(measured):
    assert measured.cached_tokens == {pt.CACHED: 64, pt.UNCACHED: 0}  # 70 tokens: 4 full blocks
    assert measured.prompt_len == 79 and measured.rounds.us(pt.CACHED).rounds == 3
    for case in (pt.CACHED, pt.UNCACHED):
        assert measured.ttft_ms(case).low > 0
        assert [t.repeats for t in measured.rounds.timings[case]] == [2, 2, 2]  # 1 burst of 2
    assert list(measured.table().case) == [pt.CACHED, pt.UNCACHED]


def test_the_claim_holds_when_caching_wins_by_the_bound_in_every_round():
    assert pc.prefix_ttft_claim(_result([10, 11, 12], [40, 41, 30])).held


def test_the_claim_fails_with_the_two_timings_swapped():
    assert not pc.prefix_ttft_claim(_result([40, 41, 30], [10, 11, 12])).held


def test_the_claim_fails_when_one_round_falls_short_of_the_bound_though_the_median_clears_it():
    assert not pc.prefix_ttft_claim(_result([10, 11, 12], [40, 41, 20])).held


def test_the_claim_fails_when_the_cached_engine_missed_part_of_the_system_prompt():
    missed = {pt.CACHED: 496, pt.UNCACHED: 0}
    assert not pc.prefix_ttft_claim(_result([10, 11, 12], [40, 41, 30], missed)).held


def test_a_system_prompt_longer_than_the_models_positions_is_refused_by_name():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        pt.model_for(torch.device("cuda"), quick=False, context=10_000)


def test_the_cpu_rounds_run_on_one_thread_and_give_the_thread_count_back():
    before = torch.get_num_threads()
    with pt.one_thread_on_cpu(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), pt.one_thread_on_cpu(torch.device("cpu")):
        raise RuntimeError("a failed round")
    assert torch.get_num_threads() == before
