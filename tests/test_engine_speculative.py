"""Speculative decoding in the engine: n-gram and controlled drafts verified in decode rows.

The rules every test leans on: greedy verification emits exactly the tokens plain greedy
decoding would, whatever the drafts, so outputs with and without speculation must be identical,
with prefix caching, chunked prefill, preemption, stop tokens and max_tokens in play; and the
rejection rule keeps a sampled request's output distributed exactly as without speculation.
"""
import math

import pytest
import torch

from labkit.engine import LLM, ModelConfig, SamplingParams, SpeculativeConfig, random_model
from labkit.engine.config import SchedulerConfig
from labkit.engine.sampling import sampling_probs
from labkit.engine.speculative import expected_tokens_per_step

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


def test_tokens_are_forwards_plus_accepted_drafts_per_request_and_in_total():
    spec = engine(speculative=SpeculativeConfig("ngram", 4))
    done = spec.generate(PROMPTS, SamplingParams(max_tokens=24))
    for o in done:  # each forward that samples emits its accepted drafts and one token more
        assert len(o.token_ids) == o.num_forwards + o.num_spec_accepted
        assert o.num_spec_accepted <= o.num_spec_proposed
    assert sum(o.num_spec_proposed for o in done) == spec.stats.num_spec_proposed
    assert sum(o.num_spec_accepted for o in done) == spec.stats.num_spec_accepted
    assert sum(o.num_spec_verifies for o in done) == spec.stats.num_spec_verifies
    assert min(o.forwards_per_token for o in done) < 1, "no request gained from its drafts"
    assert spec.stats.mean_accepted_length == pytest.approx(
        spec.stats.num_spec_accepted / spec.stats.num_spec_verifies)
    assert all(o.forwards_per_token == 1 for o in engine().generate(PROMPTS)), "plain decoding"


# ---------------------------------------------------------------- controlled draft
# What it shows is the upper bound for a draft of that acceptance rate, on random weights: its
# proposals cost nothing, and its right tokens are the target's own.
@pytest.mark.parametrize("acceptance", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("k", [1, 3])
def test_controlled_greedy_outputs_are_those_of_plain_decoding(plain, acceptance, k):
    spec = engine(speculative=SpeculativeConfig("controlled", k, acceptance=acceptance))
    done = spec.generate(PROMPTS, SamplingParams(max_tokens=24))
    assert [o.token_ids for o in done] == plain
    stats = spec.stats
    assert stats.num_spec_proposed > 0
    if acceptance == 1:  # drafts never run past max_tokens, so none is truncated there
        assert stats.num_spec_accepted == stats.num_spec_proposed
        assert all(o.num_spec_accepted == o.num_spec_proposed for o in done)
    if acceptance == 0:
        assert stats.num_spec_accepted == 0
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks, "a block leaked"


def test_the_controlled_reference_run_is_invisible_to_the_timed_engine():
    """At acceptance 0 every verify emits one token, as a decode step would: same steps, same
    prefill, same prefix hits as plain decoding, so nothing of the reference run is counted."""
    base = engine()
    outputs(base)
    spec = engine(speculative=SpeculativeConfig("controlled", 2, acceptance=0.0))
    outputs(spec)
    a, b = base.stats, spec.stats
    assert (b.num_steps, b.prefill_tokens, b.prefix_hit_tokens) == \
        (a.num_steps, a.prefill_tokens, a.prefix_hit_tokens)
    assert len(spec.step_history) == b.num_steps
    assert spec.block_manager.num_free_blocks == spec.block_manager.num_blocks


def test_the_controlled_reference_comes_from_verify_steps_of_an_engine_configured_alike():
    """The reference run takes the timed run's step shape: an engine with this one's options
    whose own controlled draft (acceptance 0) proposes k tokens at every step until the
    request's end leaves less room; it is built once and kept while its cache is big enough,
    and engines over the same model with the same options and k share it."""
    k, max_tokens = 3, 24
    spec = engine(speculative=SpeculativeConfig("controlled", k, acceptance=0.5),
                  max_num_batched_tokens=64, block_size=8)
    spec.generate([[5, 6, 7]], SamplingParams(max_tokens=max_tokens))
    ref = spec._reference_llm
    assert ref.options == spec.options and ref.options["block_size"] == 8
    ref_spec = ref.scheduler.config.speculative
    assert (ref_spec.method, ref_spec.num_speculative_tokens, ref_spec.acceptance) == \
        ("controlled", k, 0.0)
    proposed = [r.stats.num_spec_proposed for r in ref.step_history
                if not r.stats.num_prefill_tokens]
    assert proposed == [min(k, max_tokens - 1 - n) for n in range(1, max_tokens)], proposed
    spec.generate([[5, 6, 7]], SamplingParams(max_tokens=max_tokens))
    assert spec._reference_llm is ref, "a second call rebuilt the reference engine"
    spec.generate([[5, 6, 7]] * 6, SamplingParams(max_tokens=max_tokens))
    bigger = spec._reference_llm
    assert bigger.block_manager.num_blocks > ref.block_manager.num_blocks
    twin = LLM(spec.model, device="cpu", max_num_batched_tokens=64, block_size=8,
               speculative=SpeculativeConfig("controlled", k, acceptance=0.9))
    twin.generate([[5, 6, 7]], SamplingParams(max_tokens=max_tokens))
    assert twin._reference_llm is bigger, "an engine configured alike shares the reference engine"
    other_k = LLM(spec.model, device="cpu", max_num_batched_tokens=64, block_size=8,
                  speculative=SpeculativeConfig("controlled", k + 1, acceptance=0.9))
    other_k.generate([[5, 6, 7]], SamplingParams(max_tokens=max_tokens))
    assert other_k._reference_llm is not bigger
    assert other_k._reference_llm.scheduler.config.speculative.num_speculative_tokens == k + 1


def test_a_token_that_depends_on_the_step_shape_still_follows_the_reference(monkeypatch):
    """A model whose one-row steps pick another token than its verify steps (as bf16 GEMV and
    tl.dot tiles can round a near tie apart): a reference from plain decoding would be wrong at
    every position; one from verify-shaped steps is right, so acceptance 1 accepts every draft."""
    spec = engine(speculative=SpeculativeConfig("controlled", 3, acceptance=1.0))
    logits = spec.model.compute_logits

    def shape_dependent(hidden):
        out = logits(hidden)
        if hidden.shape[0] == 1:  # a decode-shaped step at batch 1 (and a prefill's last row)
            out[:, 5] += 1e4
        return out
    monkeypatch.setattr(spec.model, "compute_logits", shape_dependent)
    done = spec.generate([[9, 10, 11]], SamplingParams(max_tokens=24))
    assert set(done[0].token_ids[1:-1]) != {5}, "the verify steps' own tokens, not the bias"
    stats = spec.stats
    assert stats.num_spec_proposed > 15 and stats.num_spec_accepted == stats.num_spec_proposed


def test_controlled_mean_accepted_length_follows_the_formula():
    """Accepted drafts per verify: a + a^2 + ... + a^k (each right with probability a, until the
    first wrong one). The coins are fixed per (seed, request, position), so this cannot flake;
    4 standard errors of ~300 verifies (sd ~1.6) leave room for another seed too."""
    a, k = 0.8, 4
    spec = engine(speculative=SpeculativeConfig("controlled", k, acceptance=a))
    prompts = [[i, i + 1, i + 2] for i in range(0, 160, 10)]
    done = spec.generate(prompts, SamplingParams(max_tokens=64))
    stats = spec.stats
    assert stats.num_spec_verifies > 250
    expected = expected_tokens_per_step(a, k) - 1  # 2.36
    assert stats.mean_accepted_length == pytest.approx(expected, abs=0.4)
    forwards = sum(o.num_forwards for o in done) / sum(len(o.token_ids) for o in done)
    assert forwards == pytest.approx(1 / (1 + expected), abs=0.05)  # the prefill's: +0.016


def test_a_sampled_request_gets_no_controlled_drafts_its_reference_is_greedy(plain):
    spec = engine(speculative=SpeculativeConfig("controlled", 4, acceptance=1.0))
    params = [SamplingParams(max_tokens=24), SamplingParams(max_tokens=24, temperature=0.8,
                                                            seed=3)]
    done = spec.generate(PROMPTS[:2], params)
    assert done[0].token_ids == plain[0] and done[0].num_spec_proposed > 0
    assert done[1].num_spec_proposed == 0
    assert done[1].token_ids == engine().generate(PROMPTS[1:2], params[1:])[0].token_ids


# ---------------------------------------------------------------- sampled requests
def test_a_sampled_request_is_verified_and_reproducible_from_its_seed():
    # the random model's logits lie close together: a low temperature gives drafts a chance
    params = SamplingParams(max_tokens=24, temperature=0.01, seed=3)
    alone = engine(speculative=SpeculativeConfig("ngram", 4)).generate(PROMPTS[:1], params)[0]
    crowd = engine(speculative=SpeculativeConfig("ngram", 4)).generate(
        PROMPTS, [params] + [SamplingParams(max_tokens=24, temperature=0.5, seed=9)] * 3)[0]
    assert alone.num_spec_proposed > 0 and alone.num_spec_accepted > 0
    assert crowd.token_ids == alone.token_ids, "its tokens depend on its seed, not the batch"
    other = engine(speculative=SpeculativeConfig("ngram", 4)).generate(
        PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0.01, seed=4))[0]
    assert other.token_ids != alone.token_ids


def chi2_critical(df: int, z: float = 5.0) -> float:
    """The chi-square exceeded with the probability of a z-sigma normal tail (z = 5: 3e-7),
    by the Wilson-Hilferty approximation."""
    c = 2 / (9 * df)
    return df * (1 - c + z * math.sqrt(c)) ** 3


def test_sampled_outputs_with_speculation_follow_the_targets_distribution():
    """Vocabulary 4, 2000 seeds, 4 tokens each: the joint distribution of the 4-token outputs,
    counted, against the exact one from the model's plain forward (chi-square, cells with
    fewer than 5 expected pooled). Tokens 2-4 come from verify rows with 2 n-gram drafts."""
    n, temperature = 2000, 0.05  # a low temperature: a peaked p, drafts accepted and rejected
    llm = LLM(ModelConfig.tiny(vocab_size=4), device="cpu", max_num_seqs=512,
              max_num_batched_tokens=8192, speculative=SpeculativeConfig("ngram", 2))
    prompt = [0, 1, 2, 3, 2, 1, 0, 3, 1]
    params = SamplingParams(max_tokens=4, temperature=temperature)
    exact = {(): 1.0}
    for _ in range(4):  # P(t1..tj) = P(t1..tj-1) * p(tj | prompt, t1..tj-1)
        prefixes = list(exact)
        logits = llm.model.forward(torch.tensor([prompt + list(t) for t in prefixes]))[:, -1]
        exact = {t + (x,): exact[t] * float(q) for t, row in zip(prefixes, logits)
                 for x, q in enumerate(sampling_probs(row, params))}
    done = llm.generate([prompt] * n, [SamplingParams(max_tokens=4, temperature=temperature,
                                                      seed=s) for s in range(n)])
    assert llm.stats.num_spec_verifies > n and 0 < llm.stats.num_spec_accepted
    counts = {t: 0 for t in exact}
    for o in done:
        counts[tuple(o.token_ids)] += 1
    big = [t for t in exact if exact[t] * n >= 5]
    observed = [counts[t] for t in big] + [n - sum(counts[t] for t in big)]
    expected = [exact[t] * n for t in big] + [n - sum(exact[t] * n for t in big)]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    assert len(big) > 10
    assert stat < chi2_critical(len(big)), f"chi-square {stat:.1f} over {len(big)} cells"


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
    (dict(speculative=SpeculativeConfig("draft", 4, draft_model=random_model(
        ModelConfig.tiny(vocab_size=128)))), ValueError, "vocabulary \\(128 tokens\\)"),
    (dict(speculative=SpeculativeConfig("ngram", 4), async_scheduling=True), ValueError,
     "async_scheduling off"),
    (dict(speculative={"method": "ngram"}), TypeError, "SpeculativeConfig"),
])
def test_what_the_engine_cannot_speculate_with_is_refused(kw, error, words):
    with pytest.raises(error, match=words):
        engine(**kw)


def test_a_draft_config_needs_a_model_and_only_a_draft_config_takes_one():
    with pytest.raises(ValueError, match="needs draft_model"):
        SpeculativeConfig("draft", 4)
    with pytest.raises(ValueError, match="method 'draft' only"):
        SpeculativeConfig("ngram", 4, draft_model=random_model(TINY))


def test_a_draft_model_keeps_greedy_outputs_and_the_target_as_its_own_draft_is_accepted():
    """A smaller random model proposes its own tokens: outputs stay plain decoding's, whatever
    it proposes. The target proposing for itself is accepted nearly always (its plain forward
    and the engine's paged one round differently only in near ties)."""
    target = random_model(TINY, seed=0)
    plain_out = outputs(LLM(target, device="cpu"))
    small = random_model(ModelConfig.tiny(num_hidden_layers=1, hidden_size=32,
                                          intermediate_size=64), seed=5)
    for draft, k in ((small, 3), (target, 4)):
        llm = LLM(target, device="cpu",
                  speculative=SpeculativeConfig("draft", k, draft_model=draft))
        assert outputs(llm) == plain_out
        assert llm.stats.num_spec_proposed > 0
    rate = llm.stats.num_spec_accepted / llm.stats.num_spec_proposed
    assert rate > 0.9, f"the target's own proposals were accepted {rate:.0%} of the time"


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


@pytest.mark.gpu
def test_gpu_a_full_batch_of_verify_rows_fits_the_pinned_token_buffers():
    """Every running request verifying k drafts samples (k + 1) x max_num_seqs tokens in one
    step: the pinned buffers its tokens are read back through must hold that many."""
    def run(**kw):
        llm = LLM(TINY, device="cuda", dtype=torch.float32, max_num_seqs=len(PROMPTS), **kw)
        return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=24))], llm

    base, _ = run()
    got, spec = run(speculative=SpeculativeConfig("controlled", 4, acceptance=1.0))
    assert got == base
    assert max(s.num_decode_tokens for s in spec.scheduler.history) > len(PROMPTS), \
        "a step sampled more tokens than there are rows: the case the buffers must hold"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_drafts_leave_every_later_decode_row_its_token_within_the_budget(async_scheduling):
    """Four requests verifying k = 4 under a budget of 8 tokens: the first rows' drafts must
    leave one token for each decode row after them, so no step exceeds the budget."""
    from labkit.kvcache import BlockManager
    from labkit.engine.scheduler import Scheduler
    sched = Scheduler(SchedulerConfig(
        max_num_batched_tokens=8, max_num_seqs=4, max_model_len=64, vocab_size=20,
        async_scheduling=async_scheduling,
        speculative=SpeculativeConfig("controlled", 4, acceptance=1.0)), BlockManager(64, 4))
    for i in range(4):
        sched.add_request(i, [1, 2], max_tokens=30, reference=[5] * 30)
    sizes, in_flight = [], None
    while sched.has_unfinished_requests() or in_flight is not None:
        step = sched.schedule() if sched.has_unfinished_requests() else None
        if step is not None and step.rows:
            sizes.append((step.num_tokens, len(step.rows), step.stats.num_spec_proposed))
        if not async_scheduling:
            if step is not None and step.rows:
                sched.update(step, [5] * step.num_sampled)
            continue
        if in_flight is not None:
            sched.update(in_flight, [5] * in_flight.num_sampled)
        in_flight = step if step is not None and step.rows else None
    assert max(n for n, _, _ in sizes) <= 8, sizes
    assert any(rows == 4 and drafts > 0 for _, rows, drafts in sizes), "drafts still proposed"
