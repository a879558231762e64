"""Speculative decoding in the engine: n-gram drafts verified in decode rows, greedy.

The rule every test leans on: greedy verification emits exactly the tokens plain greedy decoding
would, whatever the drafts, so outputs with and without speculation must be identical, with
prefix caching, chunked prefill, preemption, stop tokens and max_tokens in play.
"""
import pytest
import torch

from labkit.engine import LLM, ModelConfig, SamplingParams, SpeculativeConfig
from labkit.engine.config import SchedulerConfig

TINY = ModelConfig.tiny()
# A prompt that repeats (n-gram lookups find it), one the model tends to loop on, a plain one
PROMPTS = [[1, 2, 3, 4, 5] * 3 + [1, 2], [7, 8, 9], list(range(40)), [11, 12, 11, 12, 11]]


def outputs(llm, prompts=PROMPTS, **params):
    done = llm.generate(prompts, SamplingParams(**{"max_tokens": 24, **params}))
    return [o.token_ids for o in done]


def engine(**kw):
    return LLM(TINY, device="cpu", **kw)


@pytest.fixture(scope="module")
def plain():
    return outputs(engine())


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_outputs_are_those_of_plain_decoding_and_drafts_are_accepted(plain, k):
    llm = engine(speculative=SpeculativeConfig("ngram", num_speculative_tokens=k))
    assert outputs(llm) == plain, f"k={k} changed a greedy output"
    stats = llm.stats
    assert stats.num_spec_proposed > 0 and 0 < stats.num_spec_accepted <= stats.num_spec_proposed
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "a block leaked"


@pytest.mark.parametrize("options", [
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16, max_num_seqs=4),           # chunked prefill, tight budget
    dict(num_blocks=20, block_size=4, max_num_seqs=4),         # preemption under block pressure
], ids=["no-prefix-cache", "chunked", "preemption"])
def test_speculation_keeps_greedy_outputs_under_the_engines_other_mechanisms(plain, options):
    spec = engine(speculative=SpeculativeConfig("ngram", num_speculative_tokens=3), **options)
    assert outputs(spec) == outputs(engine(**options)) == plain
    if "num_blocks" in options:
        assert spec.stats.preemptions > 0, "the pressure test preempted nothing"


def test_fewer_steps_when_drafts_are_accepted_and_every_token_gets_a_time(plain):
    base, spec = engine(), engine(speculative=SpeculativeConfig("ngram", 4))
    outputs(base)
    done = spec.generate(PROMPTS, SamplingParams(max_tokens=24))
    assert spec.stats.num_steps < base.stats.num_steps
    assert all(len(o.token_times_s) == len(o.token_ids) for o in done)


def test_a_stop_token_inside_the_accepted_drafts_ends_the_request_there(plain):
    stop = plain[0][5]  # a token the looping request emits in its sixth position
    expected = [o[:o.index(stop) + 1] if stop in o else o for o in plain]
    spec = engine(speculative=SpeculativeConfig("ngram", 4))
    got = outputs(spec, stop_token_ids=[stop])
    assert got == expected == outputs(engine(), stop_token_ids=[stop])


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_holds_when_a_verify_could_emit_past_it(plain, max_tokens):
    spec = engine(speculative=SpeculativeConfig("ngram", 4))
    assert outputs(spec, max_tokens=max_tokens) == [o[:max_tokens] for o in plain]


def test_sampled_requests_decode_without_drafts_beside_greedy_ones(plain):
    spec = engine(speculative=SpeculativeConfig("ngram", 4))
    params = [SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=0.8,
                                                            seed=3)]
    done = spec.generate(PROMPTS[:2], params)
    assert done[0].token_ids == plain[0]
    sampled = engine().generate(PROMPTS[1:2], params[1:])[0].token_ids
    assert done[1].token_ids == sampled, "a sampled request was speculated on"


def test_a_verify_step_is_not_a_decode_only_step_and_counts_its_drafts():
    spec = engine(speculative=SpeculativeConfig("ngram", 4))
    steps, schedule = [], spec.scheduler.schedule
    spec.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]  # keep each step
    spec.generate(PROMPTS[:1], SamplingParams(max_tokens=8))
    verify = [s for s in steps if any(r.num_draft for r in s.rows)]
    assert verify, "no step verified a draft"
    for s in verify:
        assert not s.is_decode_only, "a full decode graph replays one token per row"
        row = next(r for r in s.rows if r.num_draft)
        assert s.stats.num_spec_proposed == row.num_draft
        assert s.stats.num_decode_tokens == row.num_tokens == row.num_draft + 1
        assert s.num_sampled == row.num_draft + 1


@pytest.mark.parametrize("kw,error,words", [
    (dict(speculative=SpeculativeConfig("controlled", 4)), ValueError, "method='ngram'"),
    (dict(speculative=SpeculativeConfig("ngram", 4), async_scheduling=True), ValueError,
     "async_scheduling off"),
    (dict(speculative={"method": "ngram"}), TypeError, "SpeculativeConfig"),
])
def test_what_the_engine_cannot_speculate_with_is_refused(kw, error, words):
    with pytest.raises(error, match=words):
        engine(**kw)


def test_the_scheduler_config_refuses_speculation_with_async_scheduling():
    with pytest.raises(ValueError, match="async_scheduling"):
        SchedulerConfig(async_scheduling=True, speculative=SpeculativeConfig("ngram", 2))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["full_and_piecewise", "full_decode_only", "none"])
def test_gpu_greedy_outputs_are_those_of_plain_decoding_in_every_graph_mode(mode):
    def run(**kw):
        llm = LLM(TINY, device="cuda", dtype=torch.float32, cudagraph_mode=mode, **kw)
        return outputs(llm), llm

    base, _ = run(async_scheduling=False)
    got, spec = run(speculative=SpeculativeConfig("ngram", 4))
    assert got == base and spec.stats.num_spec_accepted > 0
