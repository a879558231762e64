"""The scheduler, driven without a model (the fake runner: tests/scheduler_harness.py): token
budget and chunked prefill, prefix caching, preemption, finishing, bad input, step metadata."""
import pytest
import torch

import labkit  # noqa: F401  (sets up Triton before anything imports it)
from labkit.engine.scheduler import SchedulerConfig, Status
from labkit.engine.step_metadata import build_step_metadata
from scheduler_harness import EOS, VOCAB, FakeRunner, make, prompt_of, reference_output, run


# ---------------------------------------------------------------- budget and chunked prefill
def test_a_step_never_exceeds_the_token_budget_or_the_running_cap():
    sched, bm = make(max_num_batched_tokens=16, max_num_seqs=4)
    reqs = [sched.add_request(i, prompt_of(5 + 7 * i, i), max_tokens=6) for i in range(8)]
    steps = run(sched, bm)
    assert max(s.num_tokens for s in steps) == 16, "the budget should be used in full sometimes"
    for s in steps:
        assert s.num_tokens <= 16, f"step {s.step_id} schedules {s.num_tokens} tokens > 16"
        assert len(s.rows) <= 4 and s.stats.num_running <= 4
    assert all(r.finished for r in reqs)


def test_a_long_prompt_is_prefilled_in_ceil_len_over_budget_steps():
    sched, bm = make(max_num_batched_tokens=16)
    req = sched.add_request("long", prompt_of(50, 1), max_tokens=3)
    steps = run(sched, bm)
    prefill = [s.stats.num_prefill_tokens for s in steps]
    assert prefill[:4] == [16, 16, 16, 2] and sum(prefill) == 50, \
        f"50 tokens under a budget of 16 are 4 chunks, got {prefill}"
    assert req.token_steps[0] == 3, "the first token comes when the last chunk is computed"
    assert len(req.output_token_ids) == 3


def test_without_chunked_prefill_a_prompt_is_computed_in_one_step():
    sched, bm = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a = sched.add_request("a", prompt_of(10, 1), max_tokens=4)
    b = sched.add_request("b", prompt_of(12, 2), max_tokens=4)
    steps = run(sched, bm)
    rows = [(r.request_id, r.num_tokens) for s in steps for r in s.rows if r.is_prefill]
    assert rows == [("a", 10), ("b", 12)], f"whole prompts only, got {rows}"
    assert a.finished and b.finished


def test_decodes_are_scheduled_before_new_prefills():
    sched, bm = make(max_num_batched_tokens=16)
    sched.add_request("a", prompt_of(4, 1), max_tokens=10)
    runner = FakeRunner(bm)
    step = sched.schedule()
    sched.update(step, runner(step))
    sched.add_request("b", prompt_of(40, 2), max_tokens=2)
    step = sched.schedule()
    assert [(r.request_id, r.is_prefill, r.num_tokens) for r in step.rows] == \
        [("a", False, 1), ("b", True, 15)], \
        "a's decode goes first; b's prefill gets what is left of the budget"


# ---------------------------------------------------------------- prefix caching
def test_a_shared_prefix_is_served_from_the_cache_and_not_computed_again():
    sched, bm = make(max_num_batched_tokens=64, block_size=4)
    system = prompt_of(32, 5)
    runner = FakeRunner(bm)
    first = sched.add_request("first", system + [3, 4, 5], max_tokens=2)
    run(sched, bm, runner=runner)
    second = sched.add_request("second", system + [9, 9], max_tokens=2)
    steps = run(sched, bm, runner=runner)
    admitted = steps[0].rows[0]
    assert second.num_cached_tokens == 32 and steps[0].stats.prefix_hit_tokens == 32
    assert (admitted.start, admitted.num_tokens) == (32, 2), \
        "only the 2 tokens after the cached 32-token system prompt are computed"
    assert first.finished and second.output_token_ids == reference_output(
        system + [9, 9], 2, 128, [EOS])


def test_prefix_hits_reach_past_the_first_chunk():
    sched, bm = make(max_num_batched_tokens=8, block_size=4)
    system = prompt_of(24, 3)
    runner = FakeRunner(bm)
    sched.add_request("first", system + [1], max_tokens=1)
    run(sched, bm, runner=runner)
    second = sched.add_request("second", system + [2], max_tokens=1)
    steps = run(sched, bm, runner=runner)
    assert second.num_cached_tokens == 24, "hits are looked up over the whole prompt"
    assert sum(s.stats.num_prefill_tokens for s in steps) == 1


def test_blocks_being_prefilled_in_this_step_are_shared_in_the_same_step():
    """A's last chunk and B's admission share a step: B may hit A's newest blocks because the
    runner stores every token's KV before attention reads the cache."""
    sched, bm = make(max_num_batched_tokens=16, block_size=4)
    prompt = prompt_of(40, 4)
    a = sched.add_request("a", prompt, max_tokens=2)
    b = sched.add_request("b", prompt, max_tokens=2)
    steps = run(sched, bm)
    assert [(r.request_id, r.start, r.num_tokens) for r in steps[2].rows] == \
        [("a", 32, 8), ("b", 36, 4)], "b is admitted beside a's last chunk, 36 tokens cached"
    assert a.output_token_ids == b.output_token_ids == reference_output(prompt, 2, 128, [EOS])


def test_with_prefix_caching_off_nothing_is_served_from_the_cache():
    sched, bm = make(caching=False)
    sched.add_request("a", prompt_of(20, 1), max_tokens=2)
    run(sched, bm)
    b = sched.add_request("b", prompt_of(20, 1), max_tokens=2)
    steps = run(sched, bm)
    assert b.num_cached_tokens == 0 and sum(s.stats.num_prefill_tokens for s in steps) == 20


# ---------------------------------------------------------------- preemption
def workload(n=6):
    return {0: [(i, prompt_of(6 + 3 * i, i), 12) for i in range(n)]}


def test_under_block_pressure_requests_are_preempted_and_finish_with_the_same_tokens():
    roomy, tight = {}, {}
    run(*make(num_blocks=64), workload(), added=roomy)
    sched, bm = make(num_blocks=12)
    steps = run(sched, bm, workload(), added=tight)
    assert sum(s.stats.num_preempted for s in steps) > 0, "12 blocks should force preemptions"
    assert any(r.num_preemptions for r in tight.values())
    for rid, prompt, max_tokens in workload()[0]:
        assert tight[rid].output_token_ids == roomy[rid].output_token_ids == \
            reference_output(prompt, max_tokens, 128, [EOS]), \
            f"request {rid} (preempted {tight[rid].num_preemptions}x) generated other tokens"
    assert bm.stats.blocks_in_use == 0, "every block is released at the end"


def test_preemption_takes_the_newest_running_request_and_frees_its_blocks():
    sched, bm = make(num_blocks=6, block_size=4, max_num_batched_tokens=16)
    runner = FakeRunner(bm)
    old = sched.add_request("old", prompt_of(8, 1), max_tokens=12)
    new = sched.add_request("new", prompt_of(8, 2), max_tokens=12)
    preempted = []
    while not preempted:
        step = sched.schedule()
        preempted = list(step.preempted)
        sched.update(step, runner(step))
    assert preempted == ["new"], f"the newest request should give way, got {preempted}"
    assert "new" not in bm and new.status is Status.WAITING and new.num_computed_tokens == 0
    assert sched.waiting[0] is new, "a preempted request goes back to the front of the queue"
    assert old.status is Status.RUNNING


def test_a_preempted_request_is_recomputed_in_chunks_prompt_and_output_alike():
    sched, bm = make(num_blocks=16, block_size=2, caching=False, max_num_batched_tokens=4,
                     max_num_seqs=2)
    prompts = {"a": prompt_of(6, 1), "b": prompt_of(6, 2)}
    steps = run(sched, bm, {0: [(k, p, 20) for k, p in prompts.items()]})
    again = [r for s in steps for r in s.rows if r.is_prefill and r.request.num_preemptions]
    assert again, "16 blocks of 2 cannot hold both requests to the end: one is preempted"
    assert again[0].start == 0 and list(again[0].token_ids) == \
        again[0].request.token_ids(0, again[0].num_tokens), "recompute starts from position 0"
    assert max(r.start + r.num_tokens for r in again) > 6, "its output is recomputed too"
    for rid, prompt in prompts.items():
        req = next(r.request for s in steps for r in s.rows if r.request_id == rid)
        assert req.output_token_ids == reference_output(prompt, 20, 128, [EOS])


def test_token_ids_span_prompt_and_output():
    sched, _ = make()
    req = sched.add_request("r", [1, 2, 3], max_tokens=5)
    req.output_token_ids += [7, 8]
    assert req.token_ids(0, 2) == [1, 2] and req.token_ids(2, 5) == [3, 7, 8]
    assert req.token_ids(3, 4) == [7] and req.token_ids(0, 5) == [1, 2, 3, 7, 8]


# ---------------------------------------------------------------- finishing and bad input
def test_a_request_stops_at_eos_and_keeps_the_eos_token():
    prompt = next(prompt_of(5, s) for s in range(1000)
                  if EOS in reference_output(prompt_of(5, s), 20, 128, [EOS]))
    sched, bm = make()
    req = sched.add_request("r", prompt, max_tokens=20, eos_token_ids=[EOS])
    run(sched, bm)
    assert req.status is Status.FINISHED_STOPPED and req.output_token_ids[-1] == EOS
    assert len(req.output_token_ids) < 20


def test_generation_stops_at_max_model_len():
    sched, bm = make(max_model_len=20)
    req = sched.add_request("r", prompt_of(16, 8), max_tokens=50, eos_token_ids=[])
    run(sched, bm)
    assert req.status is Status.FINISHED_LENGTH and req.num_tokens == 20


@pytest.mark.parametrize("prompt_len, max_tokens, why", [
    (200, 4, "longer than max_model_len=128"),
    (60, 60, "the KV cache holds 16"),
    (0, 4, "empty"),
    (-1, 4, "outside the vocabulary [0, 20)"),
])
def test_a_request_that_can_never_be_served_is_rejected_alone(prompt_len, max_tokens, why):
    sched, bm = make(num_blocks=16, block_size=4, vocab_size=VOCAB)
    good = [sched.add_request(i, prompt_of(9, i), max_tokens=4) for i in range(3)]
    prompt = [3, VOCAB, 4] if prompt_len == -1 else prompt_of(prompt_len, 9)
    bad = sched.add_request("bad", prompt, max_tokens=max_tokens)
    assert bad.status is Status.FINISHED_ERROR and why in bad.error, bad.error
    run(sched, bm)
    assert all(r.status is Status.FINISHED_LENGTH and len(r.output_token_ids) == 4
               for r in good), "the rest of the batch goes on"


def test_misuse_is_an_error_that_says_what_to_do():
    sched, bm = make()
    a = sched.add_request("a", [1, 2], max_tokens=2)
    with pytest.raises(ValueError, match="already queued"):
        sched.add_request("a", [1, 2], max_tokens=2)
    with pytest.raises(ValueError, match="max_tokens"):
        sched.add_request("b", [1, 2], max_tokens=0)
    step = sched.schedule()
    with pytest.raises(RuntimeError, match="call update"):
        sched.schedule()
    with pytest.raises(ValueError, match="samples 1 token"):
        sched.update(step, [])
    sched.update(step, torch.tensor([5]))  # a runner may hand back its sampled tensor
    assert a.output_token_ids == [5]
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=8)


# ---------------------------------------------------------------- statistics and metadata
def test_decode_only_steps_count_rows_padded_to_their_bucket():
    sched, bm = make(decode_buckets=(1, 2, 4, 8))
    for i in range(3):
        sched.add_request(i, prompt_of(4, i), max_tokens=3)
    steps = run(sched, bm)
    decode_only = [s for s in steps if s.is_decode_only]
    assert decode_only and all(s.stats.padded_rows == 1 for s in decode_only), \
        "3 decodes replay the graph of bucket 4: one padded row"
    assert all(s.stats.padded_rows == 0 for s in steps if not s.is_decode_only)
    table = sched.history_table()
    assert len(table) == len(steps) and table.padded_rows.sum() == len(decode_only)


def test_metadata_agrees_with_the_block_tables():
    sched, bm = make(max_num_batched_tokens=12, block_size=4)
    for i in range(4):
        sched.add_request(i, prompt_of(7 + 5 * i, i), max_tokens=3)
    runner = FakeRunner(bm)
    while sched.has_unfinished_requests():
        step = sched.schedule()
        md = build_step_metadata(step, bm, max_blocks_per_seq=16)
        t = 0
        for i, row in enumerate(step.rows):
            table = bm.block_table(row.request_id)
            assert md.block_tables[i][:len(table)].tolist() == table and len(md.block_tables[i]) == 16
            assert md.cu_seqlens_q[i + 1] - md.cu_seqlens_q[i] == row.num_tokens
            assert md.seq_lens[i] == row.start + row.num_tokens
            for p in row.positions:
                assert md.positions[t] == p
                assert md.slot_mapping[t] == table[p // 4] * 4 + p % 4, \
                    f"slot of position {p} must follow block_table[{p // 4}]"
                t += 1
        assert md.logits_indices == [md.cu_seqlens_q[i + 1] - 1
                                     for i, r in enumerate(step.rows) if r.needs_logits]
        sched.update(step, runner(step))
