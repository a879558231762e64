"""The scheduler, driven without a model.

A fake runner stands in for the model: it stores, in every slot the step's metadata names, a key
of the whole prefix that token ends (what real KV depends on), reads each row's context back
through its block table, and samples from the key it read. So a wrong prefix hit, a block freed
too early or a token computed twice shows up as a row reading the wrong context, and as a
different generation, not only as a broken count.
"""
from collections import Counter

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import labkit  # noqa: F401  (sets up Triton before anything imports it)
from labkit.engine.scheduler import Scheduler, SchedulerConfig, Status
from labkit.engine.step_metadata import build_step_metadata
from labkit.kvcache import BlockManager

VOCAB = 20
EOS = 0


def prefix_key(tokens) -> int:
    return hash(tuple(tokens))


def fake_token(key: int) -> int:
    return key % VOCAB


def reference_output(prompt, max_tokens, max_model_len, eos=()):
    """What a request must generate, whatever the scheduling: the sampler reads only its prefix."""
    tokens, out = list(prompt), []
    limit = max(max_model_len, len(prompt) + 1)
    while True:
        t = fake_token(prefix_key(tokens))
        out.append(t)
        tokens.append(t)
        if t in eos or len(out) >= max_tokens or len(tokens) >= limit:
            return out


class FakeRunner:
    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.memory: dict[int, int] = {}  # slot -> prefix key of the token stored there

    def __call__(self, step) -> list[int]:
        bs = self.bm.block_size
        for src, dst in step.block_copies:
            for i in range(bs):
                if src * bs + i in self.memory:
                    self.memory[dst * bs + i] = self.memory[src * bs + i]
        md = build_step_metadata(step, self.bm)
        t = 0
        for row in step.rows:  # store every new token's KV first, as each layer does
            tokens = row.request.token_ids(0, row.start + row.num_tokens)
            for p in row.positions:
                self.memory[md.slot_mapping[t]] = prefix_key(tokens[:p + 1])
                t += 1
        sampled = []
        for i, row in enumerate(step.rows):
            n, table = md.seq_lens[i], md.block_tables[i]
            tokens = row.request.token_ids(0, n)
            read = [self.memory.get(table[p // bs] * bs + p % bs) for p in range(n)]
            want = [prefix_key(tokens[:p + 1]) for p in range(n)]
            bad = [p for p in range(n) if read[p] != want[p]]
            assert not bad, (f"step {step.step_id}: request {row.request_id} reads a wrong "
                             f"context at positions {bad[:5]} through its block table")
            if row.needs_logits:
                sampled.append(fake_token(read[-1]))
        return sampled


def check_blocks(sched: Scheduler, bm: BlockManager) -> None:
    """Every block is held exactly by the running requests' tables, and the counts add up."""
    running = {r.request_id for r in sched.running}
    assert set(bm.seq_ids) == running, "the block manager and the scheduler disagree on who runs"
    holders = Counter()
    for rid in running:
        table = bm.block_table(rid)
        assert len(set(table)) == len(table), f"request {rid} holds a block twice"
        holders.update(table)
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == \
        [holders[b] for b in range(bm.num_blocks)], "ref counts differ from the tables' holders"
    s = bm.stats
    assert s.blocks_in_use == len(holders)
    assert s.blocks_in_use + s.blocks_cached + s.blocks_free == bm.num_blocks


def run(sched, bm, arrivals=None, max_steps=5000, on_step=None, runner=None, added=None):
    """Drive schedule/update to the end. ``arrivals``: {step: [(id, prompt, max_tokens)]}, the
    requests made are put in ``added`` by id. Pass the same ``runner`` to runs that share a
    cache: it holds the cache's contents."""
    runner, steps, arrivals = runner or FakeRunner(bm), [], dict(arrivals or {})
    added = {} if added is None else added
    for i in range(max_steps):
        for rid, prompt, max_tokens in arrivals.pop(i, []):
            added[rid] = sched.add_request(rid, prompt, max_tokens=max_tokens,
                                           eos_token_ids=[EOS])
        if not sched.has_unfinished_requests() and not arrivals:
            return steps
        step = sched.schedule()
        if on_step:
            on_step(step)
        sched.update(step, runner(step))
        steps.append(step)
        check_blocks(sched, bm)
    raise AssertionError(f"requests still unfinished after {max_steps} steps: livelock?")


def make(num_blocks=64, block_size=4, caching=True, **cfg):
    cfg = {"max_num_batched_tokens": 16, "max_num_seqs": 8, "max_model_len": 128, **cfg}
    bm = BlockManager(num_blocks, block_size, caching)
    return Scheduler(SchedulerConfig(**cfg), bm), bm


def prompt_of(n, seed):
    return [1 + (seed * 31 + 7 * p) % (VOCAB - 1) for p in range(n)]


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
            assert md.block_tables[i][:len(table)] == table and len(md.block_tables[i]) == 16
            assert md.cu_seqlens_q[i + 1] - md.cu_seqlens_q[i] == row.num_tokens
            assert md.seq_lens[i] == row.start + row.num_tokens
            for p in row.positions:
                assert md.positions[t] == p
                assert md.slot_mapping[t] == table[p // 4] * 4 + p % 4, \
                    f"slot of position {p} must follow block_table[{p // 4}]"
                t += 1
        assert md.logits_indices == [md.cu_seqlens_q[i + 1] - 1
                                     for i, r in enumerate(step.rows) if r.needs_logits]
        tensors = md.to_tensors()
        assert tensors["block_tables"].shape == (len(step.rows), 16)
        assert tensors["cu_seqlens_q"].tolist() == md.cu_seqlens_q
        sched.update(step, runner(step))


# ---------------------------------------------------------------- random workloads
SYSTEMS = [[], prompt_of(8, 11), prompt_of(12, 12)]


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4]))
    budget = draw(st.integers(2, 16))
    cfg = dict(max_num_batched_tokens=budget, max_num_seqs=draw(st.integers(1, min(6, budget))),
               max_model_len=draw(st.integers(8, 48)),
               enable_chunked_prefill=draw(st.booleans()),
               decode_buckets=(1, 2, 4))
    requests = {}
    for rid in range(draw(st.integers(1, 10))):
        prompt = draw(st.sampled_from(SYSTEMS)) + draw(
            st.lists(st.integers(1, VOCAB - 1), max_size=16))
        requests[rid] = (draw(st.integers(0, 8)), prompt, draw(st.integers(1, 16)))
    # Few blocks for the traffic, so that preemption and eviction are common.
    return block_size, draw(st.integers(3, 20)), draw(st.booleans()), cfg, requests


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_invariant_and_finish_every_request(w):
    block_size, num_blocks, caching, cfg, requests = w
    sched, bm = make(num_blocks, block_size, caching, **cfg)
    arrivals, got = {}, {}
    for rid, (at, prompt, max_tokens) in requests.items():
        arrivals.setdefault(at, []).append((rid, prompt, max_tokens))

    def on_step(step):
        assert step.num_tokens <= cfg["max_num_batched_tokens"]
        ids = [r.request_id for r in step.rows]
        assert len(ids) == len(set(ids)), f"a request is scheduled twice in step {step.step_id}"
        assert len(ids) <= cfg["max_num_seqs"]
        for r in step.rows:
            assert bm.num_tokens(r.request_id) == r.start + r.num_tokens, \
                "the cache holds slots for exactly the tokens computed so far"

    run(sched, bm, arrivals, on_step=on_step, added=got)
    assert bm.stats.blocks_in_use == 0
    for rid, (_, prompt, max_tokens) in requests.items():
        req, n = got[rid], len(prompt)
        total = min(n + max_tokens, max(cfg["max_model_len"], n + 1))
        unservable = (n == 0 or n > cfg["max_model_len"]
                      or (not cfg["enable_chunked_prefill"] and n > cfg["max_num_batched_tokens"])
                      or -(-(total - 1) // block_size) > num_blocks)
        assert (req.status is Status.FINISHED_ERROR) == unservable, (req.status, req.error)
        if not unservable:
            assert req.output_token_ids == reference_output(prompt, max_tokens,
                                                            cfg["max_model_len"], [EOS])
