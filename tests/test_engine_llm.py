"""The engine end to end: ``LLM.generate`` against transformers' own greedy generation.

The LLM loads a tiny Llama that transformers built and saved (tests/engine_peer.py). Whatever
the engine does on the way (batching prompts of different lengths, prefix caching, chunked
prefill, preemption and recompute, another attention backend) the greedy tokens must be the
ones transformers generates for each prompt alone. The GPU runs: test_engine_llm_gpu.py.
"""
import logging

import pytest
import torch

from labkit.engine import LLM, ModelConfig, ModelRunner, SamplingParams, random_model
from labkit.engine.request import ScheduledStep, StepStats
from labkit.engine.runner import PAD, decode_inputs
from labkit.engine.scheduler import Scheduler, SchedulerConfig
from labkit.engine.step_metadata import build_step_metadata
from labkit.engine.sampling import sample, top_p_probs
from labkit.graphs import GraphPool
from labkit.kvcache import BlockManager

from engine_peer import (GREEDY, MAX_TOKENS, PROMPTS, TINY, assert_same_tokens,  # noqa: F401
                         expected, hf_model, make_prompts)

# --- greedy tokens equal transformers', whatever the engine does on the way ------------------

@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-prefix-cache"])
def test_batched_greedy_generation_equals_transformers(hf_model, expected, prefix_caching):
    llm = LLM(hf_model[1], device="cpu", enable_prefix_caching=prefix_caching)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert all(len(set(e)) >= 4 for e in expected), f"degenerate references: {expected}"
    assert_same_tokens(outputs, expected, f"prefix caching {prefix_caching}")
    assert [o.finish_reason for o in outputs] == ["length"] * len(PROMPTS)


@pytest.mark.parametrize("backend", ["reference", "flex"])
def test_other_attention_backends_give_the_same_tokens(hf_model, expected, backend):
    llm = LLM(hf_model[1], device="cpu", backend=backend)
    assert llm.backend == backend
    assert_same_tokens(llm.generate(PROMPTS[:3], GREEDY), expected[:3], f"backend {backend}")


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_the_peer_backends_take_the_steps_lengths_from_the_host(hf_model, expected, backend,
                                                              monkeypatch):
    """The engine hands sdpa and flex each step's lengths from its host metadata, so no layer
    reads them back from the device (a sync per layer: an unfair peer)."""
    from labkit.attention import peers

    read_back = peers._host_lengths
    calls = []

    def spy(lens_q, lens_k, given=None):
        calls.append(given is not None)
        return read_back(lens_q, lens_k, given)

    monkeypatch.setattr(peers, "_host_lengths", spy)
    llm = LLM(hf_model[1], device="cpu", backend=backend, enable_chunked_prefill=True)
    assert_same_tokens(llm.generate(PROMPTS[:3], GREEDY), expected[:3], f"backend {backend}")
    assert calls and all(calls), f"{calls.count(False)} of {len(calls)} calls read lengths back"


def test_chunked_prefill_gives_the_same_tokens(hf_model, expected):
    budget = 8
    llm = LLM(hf_model[1], device="cpu", max_num_batched_tokens=budget, max_num_seqs=4)
    outputs = llm.generate(PROMPTS, GREEDY)
    steps = [r.stats for r in llm.step_history]
    assert max(s.num_tokens for s in steps) <= budget, "a step went over the token budget"
    assert any(s.num_prefill_tokens and s.num_decode_tokens for s in steps), \
        "no step mixed a prefill chunk with decodes: chunked prefill was not exercised"
    assert_same_tokens(outputs, expected, f"chunked prefill, budget {budget}")


def test_preemption_under_block_pressure_gives_the_same_tokens(hf_model, expected):
    # 17 blocks of 8 would hold every request at full length; 7 force preemptions.
    llm = LLM(hf_model[1], device="cpu", num_blocks=7, block_size=8)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.stats.preemptions > 0, "no request was preempted: the test proves nothing"
    assert sum(o.num_preemptions for o in outputs) == llm.stats.preemptions
    assert_same_tokens(outputs, expected, "preempted and recomputed")


def test_shared_system_prompt_is_served_from_the_prefix_cache(hf_model):
    system = make_prompts([32], seed=5)[0]  # two full blocks of 16
    prompts = [system + tail for tail in make_prompts([3, 7, 1, 12], seed=6)]
    cached = LLM(hf_model[1], device="cpu").generate(prompts, GREEDY)
    llm = LLM(hf_model[1], device="cpu")
    outputs = llm.generate(prompts, GREEDY)
    plain = LLM(hf_model[1], device="cpu", enable_prefix_caching=False).generate(prompts, GREEDY)
    assert llm.stats.prefix_hit_tokens >= 32 * (len(prompts) - 1), llm.stats
    computed = sum(len(p) for p in prompts) - llm.stats.prefix_hit_tokens
    assert llm.stats.prefill_tokens == computed, "hit tokens must not be computed again"
    assert llm.stats.prefix_hit_rate == llm.stats.prefix_hit_tokens / sum(map(len, prompts))
    assert [o.num_cached_tokens for o in outputs[1:]] == [32] * (len(prompts) - 1)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain] == \
        [o.token_ids for o in cached], "prefix hits changed the generated tokens"


# --- bad requests fail alone ------------------------------------------------------------------

def test_bad_requests_get_an_error_and_the_rest_of_the_batch_completes(hf_model, expected):
    # 6 blocks of 16 hold 96 tokens: a 60-token prompt asking for 50 more can never fit.
    llm = LLM(hf_model[1], device="cpu", num_blocks=6)
    bad = {1: ([1] * 300, "longer than max_model_len=256"),
           3: (make_prompts([60])[0], "need 7 blocks of 16, the KV cache holds 6"),
           4: ([], "empty"), 5: ([3, 999], "outside the vocabulary"),
           6: ("a text prompt", "no tokenizer")}
    prompts = [PROMPTS[0], bad[1][0], PROMPTS[1], bad[3][0], bad[4][0], bad[5][0], bad[6][0]]
    params = [GREEDY] * 3 + [SamplingParams(max_tokens=50)] + [GREEDY] * 3
    outputs = llm.generate(prompts, params)
    for i, (_, message) in bad.items():
        assert outputs[i].finish_reason == "error" and message in outputs[i].error, \
            f"prompt {i}: expected an error saying {message!r}, got {outputs[i].error!r}"
        assert outputs[i].token_ids == []
    assert_same_tokens([outputs[0], outputs[2]], expected[:2], "good requests beside bad ones")


def test_a_stop_token_ends_the_request_with_it(hf_model, expected):
    llm = LLM(hf_model[1], device="cpu")
    stop = expected[0][3]
    first = expected[0].index(stop)
    out, other = llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=MAX_TOKENS,
                                                          stop_token_ids=(stop,)), GREEDY])
    assert out.token_ids == expected[0][:first + 1] and out.finish_reason == "stop"
    assert other.token_ids == expected[1] and other.finish_reason == "length"


def test_unknown_backend_is_refused_with_the_known_ones(hf_model):
    with pytest.raises(ValueError, match=r"unknown attention backend 'flashinfer'.*'sdpa'"):
        LLM(hf_model[1], device="cpu", backend="flashinfer")


def test_a_forced_backend_that_cannot_serve_says_why(hf_model):
    with pytest.raises(ValueError, match=r"block_size 8 is not supported(.|\n)*backend='auto'"):
        LLM(hf_model[1], device="cpu", backend="triton", block_size=8)


def test_a_single_prompt_must_be_wrapped_in_a_list(hf_model):
    llm = LLM(hf_model[1], device="cpu")
    with pytest.raises(TypeError, match="wrap a single prompt in a list"):
        llm.generate([1, 2, 3])


# --- sampling ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be a positive int"),
    (dict(max_tokens=2.0), "max_tokens must be a positive int"),
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(seed=-1), "seed must be None or an int"),
    (dict(stop_token_ids=["eos"]), "stop_token_ids must be ints"),
])
def test_sampling_params_refuse_what_they_cannot_mean(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    probs = torch.tensor([0.1, 0.5, 0.15, 0.25])
    kept = top_p_probs(probs, 0.7)  # 0.5 + 0.25 = 0.75 reaches 0.7: two tokens stay
    assert torch.allclose(kept, torch.tensor([0.0, 0.5, 0.0, 0.25]) / 0.75)
    assert top_p_probs(probs, 0.01).tolist() == [0.0, 1.0, 0.0, 0.0], "the top token must stay"


def test_a_tiny_top_p_samples_the_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, top_p=1e-6)] * 6
    gens = [torch.Generator().manual_seed(i) for i in range(6)]
    assert sample(logits, params, gens).tolist() == logits.argmax(-1).tolist()


def test_seeded_sampling_is_reproducible_and_follows_the_seed(hf_model):
    def run(seed):
        llm = LLM(hf_model[1], device="cpu")
        return [o.token_ids for o in llm.generate(
            PROMPTS[:3], SamplingParams(max_tokens=8, temperature=1.0, seed=seed))]
    first, again, other = run(123), run(123), run(124)
    assert first == again, "the same seed sampled different tokens"
    assert first != other, "another seed sampled the same tokens: the seed is ignored"


def test_unseeded_requests_draw_their_seeds_from_the_llm_seed(hf_model):
    params = SamplingParams(max_tokens=8, temperature=1.0)
    a, b, c = (LLM(hf_model[1], device="cpu", seed=s).generate(PROMPTS[:2], params)
               for s in (1, 1, 2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


# --- timing, statistics, sizing, tokenizer ----------------------------------------------------

def test_ttft_and_tpot_are_measured_for_every_request(hf_model):
    llm = LLM(hf_model[1], device="cpu")
    outputs = llm.generate(PROMPTS, [GREEDY] * 4 + [SamplingParams(max_tokens=1)])
    for o in outputs[:4]:
        assert o.ttft_s > 0 and o.tpot_s > 0, (o.ttft_s, o.tpot_s)
        assert len(o.token_times_s) == MAX_TOKENS and o.token_times_s[0] == o.ttft_s
        assert o.token_times_s == sorted(o.token_times_s)
    assert outputs[4].ttft_s > 0 and outputs[4].tpot_s is None, "one token has no TPOT"
    table = llm.history_table()
    assert len(table) == llm.stats.num_steps and (table["duration_ms"] > 0).all()


def test_kv_cache_is_sized_from_a_memory_budget(hf_model):
    per_block = 2 * TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * 16 * 16 * 4
    llm = LLM(hf_model[1], device="cpu", kv_cache_memory=10 * per_block + 100)
    assert llm.runner.num_blocks == 10 == llm.block_manager.num_blocks
    with pytest.raises(ValueError, match="not both"):
        LLM(hf_model[1], device="cpu", num_blocks=4, kv_cache_memory=10 * per_block)


class ByteTokenizer:
    def encode(self, text):
        return list(text.encode())

    def decode(self, ids):
        return bytes(ids).decode(errors="replace")


def test_text_prompts_go_through_the_tokenizer(hf_model):
    llm = LLM(hf_model[1], device="cpu", tokenizer=ByteTokenizer())
    text, ids = llm.generate(["hello", list(b"hello")], SamplingParams(max_tokens=4))
    assert text.prompt_token_ids == list(b"hello") and text.token_ids == ids.token_ids
    assert text.text == ByteTokenizer().decode(text.token_ids)


# --- the runner -------------------------------------------------------------------------------

def test_auto_backend_on_cpu_logs_why_it_passed_over_the_others(caplog):
    with caplog.at_level(logging.INFO, logger="labkit.engine"):
        runner = ModelRunner(random_model(ModelConfig.tiny(), seed=0), num_blocks=4)
    assert runner.backend.name == "sdpa"
    assert any("passed over 'triton'" in r.message and "interpreter" in r.message
               for r in caplog.records), [r.message for r in caplog.records]
    assert runner.graphs is None, "no CUDA Graphs on CPU"


def test_the_runner_logs_its_backend_choice_once(caplog):
    with caplog.at_level(logging.INFO, logger="labkit.engine"), \
            caplog.at_level(logging.INFO, logger="labkit.attention"):
        runner = ModelRunner(random_model(ModelConfig.tiny(), seed=0), num_blocks=4)
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("labkit")]
    assert logged == runner.selection_log, "the choice and each reason, each line once"


def test_runner_applies_copy_on_write_copies_before_computing():
    runner = ModelRunner(random_model(ModelConfig.tiny(), seed=0), num_blocks=4)
    runner.cache.kv[:, :, 1] = 7.0
    stats = StepStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    out = runner.execute(ScheduledStep(0, (), ((1, 3),), (), stats), bm=None)
    assert out.logits.shape == (0, TINY["vocab_size"])
    assert (runner.cache.kv[:, :, 3] == 7.0).all(), "block 1 was not copied into block 3"


def test_runner_logits_equal_the_full_forward_at_every_sampled_row():
    """Mixed steps (prefill chunks beside decodes) and prefix hits, row by row: the paged
    runner's logits are the plain full-sequence forward's, whatever the step looked like."""
    model = random_model(ModelConfig.tiny(), seed=1, std=0.2)
    runner = ModelRunner(model, num_blocks=16)
    bm = BlockManager(16, 16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4,
                                      max_model_len=256), bm)
    prompts = make_prompts([20, 3, 9], seed=3)
    prompts.append(prompts[0][:16] + [7, 8])  # its first block is a prefix hit
    for i, p in enumerate(prompts):
        sched.add_request(i, p, max_tokens=4)
    mixed = 0
    while sched.has_unfinished_requests():
        step = sched.schedule()
        out = runner.execute(step, bm)
        rows = [r for r in step.rows if r.needs_logits]
        assert out.logits.shape == (len(rows), TINY["vocab_size"])
        for logits, row in zip(out.logits, rows):
            tokens = torch.tensor([row.request.token_ids(0, row.start + row.num_tokens)])
            ref = model(tokens)[0, -1]
            err = (logits - ref).abs().max().item()
            assert err <= 1e-4 * ref.abs().max().item(), (
                f"step {step.step_id}, request {row.request_id} at position {tokens.shape[1]}: "
                f"paged logits are {err:.2e} off the full forward")
        mixed += step.stats.num_prefill_seqs > 0 and step.stats.num_decode_seqs > 0
        sched.update(step, out.logits.argmax(-1))
    assert mixed and bm.stats.hit_tokens == 16, (mixed, bm.stats)


def test_to_device_gives_every_metadata_array_as_int32_in_one_buffer():
    """The one way from step metadata to tensors: each field as it was built, block tables as
    [rows, width] (padded with pad_block), and PENDING inputs taken from the previous samples."""
    runner = ModelRunner(random_model(ModelConfig.tiny(), seed=0), num_blocks=16, block_size=4)
    bm = BlockManager(16, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=4,
                                      max_model_len=64, async_scheduling=True), bm)
    for i, p in enumerate(make_prompts([6, 3], seed=5)):
        sched.add_request(i, p, max_tokens=4)
    for _ in range(2):  # the second step reads the first one's samples, still on the device
        step = sched.schedule()
        md = build_step_metadata(step, bm, max_blocks_per_seq=8, pad_block=0)
        prev = torch.tensor([11, 22]) if md.pending_dst else None
        dev = runner.to_device(md, prev)
        for name in ("positions", "slot_mapping", "cu_seqlens_q", "seq_lens", "logits_indices"):
            got = getattr(dev, name)
            assert got.dtype == torch.int32 and got.tolist() == getattr(md, name), name
        assert dev.block_tables.tolist() == md.block_tables.tolist()
        assert dev.block_tables.shape == (len(step.rows), 8)
        ids = list(md.input_ids)
        for dst, src in zip(md.pending_dst, md.pending_src):
            ids[dst] = int(prev[src])
        assert dev.input_ids.tolist() == ids
    assert md.pending_dst, "the second step must read a token still on the device"


def test_decode_graph_function_ignores_its_padding_rows():
    """What a CUDA Graph captures, run eagerly: a decode batch padded with PAD rows (as the
    graph pool pads up to a bucket) writes only the real rows' slots and gives their logits."""
    model = random_model(ModelConfig.tiny(), seed=1, std=0.2)
    runner = ModelRunner(model, num_blocks=16)
    bm = BlockManager(16, 16)
    sched = Scheduler(SchedulerConfig(max_model_len=256), bm)
    for i, p in enumerate(make_prompts([5, 20], seed=4)):
        sched.add_request(i, p, max_tokens=4)
    prefill = sched.schedule()
    sched.update(prefill, runner.execute(prefill, bm).logits.argmax(-1))
    step = sched.schedule()
    assert step.is_decode_only
    md = build_step_metadata(step, bm, max_blocks_per_seq=runner.max_blocks_per_seq)
    padded = [torch.cat([x, torch.full((3, *x.shape[1:]), PAD, dtype=x.dtype)])
              for x in decode_inputs(runner.to_device(md))]
    before = runner.cache.kv.clone()
    graph_logits = runner.decode_forward(*padded)
    changed = (runner.cache.kv != before).flatten(2, 3).any(-1).any(-1).any(0).any(0)
    assert changed.nonzero().flatten().tolist() == sorted(md.slot_mapping), \
        "the padded batch wrote slots other than its real rows'"
    eager = runner.execute(step, bm).logits
    assert graph_logits.shape == (5, TINY["vocab_size"])
    torch.testing.assert_close(graph_logits[:2], eager, rtol=1e-5, atol=1e-5)


def test_decode_steps_take_the_graph_branch_with_the_same_tokens(hf_model, expected):
    """The runner's graph branch on CPU: a GraphPool that cannot capture here calls the same
    decode function eagerly, so the branch (fixed-width block tables, the decode inputs) runs
    and must generate transformers' tokens."""
    llm = LLM(hf_model[1], device="cpu")
    llm.runner.graphs = GraphPool(llm.runner.decode_forward, (1, 2, 4, 8), pad_value=PAD,
                                  enabled=False)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert llm.stats.num_graph_steps == MAX_TOKENS - 1, llm.stats
    assert llm.runner.graphs.stats.eager_calls == MAX_TOKENS - 1
    assert_same_tokens(outputs, expected, "decode through the graph branch")


def test_triton_backend_runs_end_to_end_under_the_interpreter(hf_model, expected):
    # Few tokens (each kernel call takes up to 0.1 s in the interpreter), a budget of 4 so
    # that prefill chunks and decodes share steps.
    llm = LLM(hf_model[1], device="cpu", backend="triton", max_num_batched_tokens=4,
              max_num_seqs=2)
    assert llm.backend == "triton" and llm.runner.store_kernel
    outputs = llm.generate([PROMPTS[2], PROMPTS[0]], SamplingParams(max_tokens=3))
    assert any(s.num_prefill_tokens and s.num_decode_tokens
               for s in (r.stats for r in llm.step_history)), "no mixed step"
    assert_same_tokens(outputs, [expected[2][:3], expected[0][:3]], "triton backend")
