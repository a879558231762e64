"""Async scheduling, failed steps and the step-by-step API of the engine.

Async scheduling plans step N+1 while step N is on the device, so the token step N samples is
PENDING on the host when step N+1 is built. Whatever the batch does (chunked prefill, prefix
hits, preemption, stop tokens), the tokens must be exactly those of the plain loop. A step that
fails must leave the engine as it was: no block held, no prefix-cache entry without KV.
"""
import random

import pytest

from labkit.engine import LLM, ModelConfig, SamplingParams
from labkit.engine.request import PENDING
from labkit.engine.scheduler import Scheduler, SchedulerConfig
from labkit.kvcache import BlockManager

CFG = ModelConfig.tiny()
SETTINGS = {
    "plain": {},
    "chunked prefill": dict(max_num_batched_tokens=32, max_num_seqs=4),
    "preemption": dict(num_blocks=14, max_num_batched_tokens=64, max_num_seqs=8),
}


def workload(seed=0, n=12):
    rng = random.Random(seed)
    shared = [rng.randrange(CFG.vocab_size) for _ in range(40)]  # prefix hits for odd requests
    prompts = [(shared if i % 2 else []) + [rng.randrange(CFG.vocab_size)
                                            for _ in range(rng.randrange(1, 60))]
               for i in range(n)]
    return prompts, [SamplingParams(max_tokens=rng.randrange(1, 30)) for _ in prompts]


def run(async_scheduling, prompts, params, **kw):
    llm = LLM(CFG, device="cpu", async_scheduling=async_scheduling, seed=0, **kw)
    return llm, [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_async_scheduling_generates_the_plain_loops_tokens(setting):
    prompts, params = workload()
    _, plain = run(False, prompts, params, **SETTINGS[setting])
    llm, ahead = run(True, prompts, params, **SETTINGS[setting])
    assert ahead == plain, f"{setting}: async scheduling changed the generated tokens"
    if setting == "preemption":
        assert llm.stats.preemptions > 0, "the setting must actually preempt to test it"


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_stop_token_ends_the_request_even_with_a_row_already_scheduled(setting):
    prompts, params = workload(seed=1)
    _, plain = run(False, prompts, params, **SETTINGS[setting])
    stops = tuple({toks[len(toks) // 2] for toks, _ in plain if len(toks) > 2})
    params = [SamplingParams(max_tokens=p.max_tokens, stop_token_ids=stops) for p in params]
    _, plain = run(False, prompts, params, **SETTINGS[setting])
    llm, ahead = run(True, prompts, params, **SETTINGS[setting])
    assert ahead == plain
    assert sum(reason == "stop" for _, reason in ahead) >= 3, "the test needs early stops"
    for toks, reason in ahead:
        assert PENDING not in toks and (reason != "stop" or toks[-1] in stops)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks, "blocks leaked"


def test_seeded_sampling_is_the_same_with_async_scheduling():
    prompts, _ = workload(seed=2)
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=i)
              for i in range(len(prompts))]
    assert run(True, prompts, params)[1] == run(False, prompts, params)[1]


def test_async_scheduling_really_keeps_a_step_in_flight():
    prompts, params = workload(seed=3, n=4)
    llm = LLM(CFG, device="cpu", async_scheduling=True)
    for p, sp in zip(prompts, params):
        llm.add_request(p, sp)
    in_flight = []
    while llm.has_unfinished_requests():
        llm.step()
        in_flight.append(llm.scheduler.steps_in_flight)
    assert max(in_flight) == 1, "after step() returns, the next step should already be queued"
    assert in_flight[-1] == 0


def test_a_request_added_between_steps_is_served_and_returned_by_step():
    prompts, _ = workload(seed=4, n=3)
    for async_scheduling in (False, True):
        llm = LLM(CFG, device="cpu", async_scheduling=async_scheduling)
        first = llm.add_request(prompts[0], SamplingParams(max_tokens=8))
        outs = {}
        for _ in range(3):
            outs.update((o.request_id, o) for o in llm.step())
        late = llm.add_request(prompts[1], SamplingParams(max_tokens=5))
        bad = llm.add_request([CFG.vocab_size + 7], SamplingParams(max_tokens=5))
        while llm.has_unfinished_requests():
            outs.update((o.request_id, o) for o in llm.step())
        assert set(outs) == {first, late, bad}
        assert len(outs[first].token_ids) == 8 and len(outs[late].token_ids) == 5
        assert outs[bad].finish_reason == "error" and "vocabulary" in outs[bad].error
        alone = LLM(CFG, device="cpu").generate([prompts[1]], SamplingParams(max_tokens=5))
        assert outs[late].token_ids == alone[0].token_ids, "joining mid-way changed its tokens"


class FailingRunner:
    """Wraps the real runner; its ``fail_at``-th execute raises as a device error would."""

    def __init__(self, runner, fail_at):
        self.runner, self.fail_at, self.calls = runner, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def execute(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("simulated device failure")
        return self.runner.execute(*args, **kwargs)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("fail_at", [1, 2, 5])
def test_a_failed_step_leaves_the_engine_as_it_was(async_scheduling, fail_at):
    prompts, params = workload(seed=5, n=6)
    llm = LLM(CFG, device="cpu", async_scheduling=async_scheduling, max_num_batched_tokens=48,
              max_num_seqs=4)
    real = llm.runner
    llm.runner = FailingRunner(real, fail_at)
    with pytest.raises(RuntimeError, match="simulated device failure"):
        llm.generate(prompts, params)
    bm = llm.block_manager
    assert not llm.has_unfinished_requests() and not llm.scheduler._live
    assert bm.num_free_blocks == bm.num_blocks and not bm.seq_ids, "blocks leaked"
    # The prefix cache may keep blocks whose KV was written, never one whose step failed:
    # the same prompts must now give the tokens a fresh engine gives.
    llm.runner = real
    fresh = LLM(CFG, device="cpu", async_scheduling=async_scheduling,
                max_num_batched_tokens=48, max_num_seqs=4)
    assert [o.token_ids for o in llm.generate(prompts, params)] == \
        [o.token_ids for o in fresh.generate(prompts, params)]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_step_failing_after_its_launch_raises_its_own_error_and_leaks_nothing(
        async_scheduling, monkeypatch):
    """Reading back or updating a step's tokens can fail after the runner succeeded (a
    host copy into a buffer too small, a device error surfacing at the sync): the step is
    still in flight then, and the engine must undo it before aborting its requests, or the
    abort fails and hides the first error."""
    from labkit.engine.step_loop import StepLoop
    prompts, params = workload(seed=7, n=5)
    llm = LLM(CFG, device="cpu", async_scheduling=async_scheduling, max_num_batched_tokens=48,
              max_num_seqs=4)
    real, calls = StepLoop._complete, []

    def failing(self, done):
        calls.append(done.step.step_id)
        if len(calls) == 3:
            raise ValueError("reading the step's tokens failed")
        return real(self, done)
    monkeypatch.setattr(StepLoop, "_complete", failing)
    with pytest.raises(ValueError, match="reading the step's tokens failed"):
        llm.generate(prompts, params)
    monkeypatch.setattr(StepLoop, "_complete", real)
    bm = llm.block_manager
    assert not llm.has_unfinished_requests() and llm.scheduler.steps_in_flight == 0
    assert bm.num_free_blocks == bm.num_blocks and not bm.seq_ids, "blocks leaked"
    fresh = LLM(CFG, device="cpu", async_scheduling=async_scheduling,
                max_num_batched_tokens=48, max_num_seqs=4)
    assert [o.token_ids for o in llm.generate(prompts, params)] == \
        [o.token_ids for o in fresh.generate(prompts, params)]


def test_abort_step_undoes_admission_and_uncaches_the_blocks_it_registered():
    bm = BlockManager(16, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                      max_model_len=64), bm)
    prompt = list(range(12))  # three full blocks, registered when allocated
    req = sched.add_request("a", prompt, max_tokens=3)
    step = sched.schedule()
    assert bm.cached_prefix_len(prompt + [99]) == 12, "admission registers the full blocks"
    sched.abort_step(step)
    assert req.status.value == "waiting" and req.num_computed_tokens == 0
    assert req.output_token_ids == [] and req.num_preemptions == 0
    assert bm.num_free_blocks == 16 and bm.cached_prefix_len(prompt + [99]) == 0, (
        "blocks whose KV was never written must not be findable")
    again = sched.schedule()  # the request runs normally afterwards
    assert again.rows[0].request is req and again.rows[0].num_tokens == 12


def test_only_the_newest_step_in_flight_can_be_aborted_and_updates_go_in_order():
    bm = BlockManager(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                      max_model_len=64, async_scheduling=True), bm)
    sched.add_request("a", [1, 2, 3], max_tokens=5)
    first = sched.schedule()
    second = sched.schedule()
    assert second.rows[0].input_from == 0 and second.rows[0].token_ids == (PENDING,)
    with pytest.raises(RuntimeError, match="newest"):
        sched.abort_step(first)
    with pytest.raises(RuntimeError, match="order"):
        sched.update(second, [7])
    with pytest.raises(RuntimeError, match="not updated"):
        sched.schedule()
    sched.update(first, [7])
    assert bm.block_table("a") and not bm.has_pending("a"), "update fills the reserved slot"


def test_a_request_whose_pending_token_is_its_last_gets_no_further_row():
    bm = BlockManager(32, 4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                                      max_model_len=64, async_scheduling=True), bm)
    req = sched.add_request("a", [1, 2, 3], max_tokens=2)
    first = sched.schedule()    # prefill: samples output 1
    second = sched.schedule()   # decode on the pending output 1: samples output 2, the last
    sched.update(first, [7])
    third = sched.schedule()    # output 2 is still in flight, and it ends the request
    assert third.rows == (), "a row after the last token would be computed and thrown away"
    sched.update(second, [8])
    assert req.output_token_ids == [7, 8] and req.status.value == "finished_length"
    assert bm.num_free_blocks == 32


def test_pending_tokens_in_the_block_manager_are_sealed_only_when_known():
    bm = BlockManager(8, 4)
    bm.allocate("a", [1, 2, 3])
    bm.append_token("a", None)  # fills the block with a token still being sampled
    assert bm.has_pending("a") and bm.cached_prefix_len([1, 2, 3, 4, 5]) == 0
    with pytest.raises(ValueError, match="pending"):
        bm.append_token("a", 5)
    with pytest.raises(ValueError, match="pending"):
        bm.fork("a", "b")
    bm.set_token("a", 4)
    assert not bm.has_pending("a") and bm.cached_prefix_len([1, 2, 3, 4, 5]) == 4
    with pytest.raises(ValueError, match="no pending"):
        bm.set_token("a", 4)
    before = bm.snapshot()
    bm.free("a", uncache=True)
    assert bm.cached_prefix_len([1, 2, 3, 4, 5]) == 0 and bm.num_free_blocks == 8
    assert before != bm.snapshot()


def test_generate_refuses_to_run_over_requests_added_by_hand():
    llm = LLM(CFG, device="cpu")
    rid = llm.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="add_request"):
        llm.generate([[4, 5]])
    outs = []
    while llm.has_unfinished_requests():  # the refusal left the queued request untouched
        outs += llm.step()
    assert [o.request_id for o in outs] == [rid] and len(outs[0].token_ids) == 2


# --- on a GPU: graphs, pinned copies, and the overlap itself ----------------------------------

def copies_overlapping_compute(events):
    """Of the host-to-device copies, the share whose interval meets a kernel on another stream."""
    kernels = events[events.kind == "kernel"]
    copies = events[(events.kind == "memcpy") & events.name.str.contains("HtoD")]
    hits = 0
    for c in copies.itertuples():
        other = kernels[kernels.lane != c.lane]
        hits += bool(((other.start_us < c.start_us + c.dur_us)
                      & (other.start_us + other.dur_us > c.start_us)).any())
    return hits / max(len(copies), 1), len(copies)


@pytest.mark.gpu
def test_gpu_async_scheduling_with_graphs_generates_the_plain_loops_tokens():
    prompts, params = workload(seed=6)
    cfg = ModelConfig.tiny(torch_dtype="float32")
    outs = {}
    for async_scheduling in (False, True):
        llm = LLM(cfg, device="cuda", async_scheduling=async_scheduling, seed=0)
        outs[async_scheduling] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.stats.num_graph_steps > 0
    assert outs[True] == outs[False]


@pytest.mark.gpu
def test_gpu_metadata_copies_overlap_the_previous_steps_compute():
    from labkit.measure.profile import trace

    # Wide enough that a step's GPU time exceeds the host's time to plan the next one.
    # (about 1 ms of weights to read per decode step against a few hundred us of Python).
    cfg = ModelConfig.tiny(hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                           num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                           max_position_embeddings=1024, torch_dtype="bfloat16")
    prompts = [[(7 * i + j) % 32000 for j in range(200 + 37 * i)] for i in range(8)]
    share = {}
    for async_scheduling in (False, True):
        llm = LLM(cfg, device="cuda", async_scheduling=async_scheduling, max_num_seqs=8,
                  max_num_batched_tokens=512)
        t = trace(llm.generate, prompts, SamplingParams(max_tokens=12), device="cuda")
        share[async_scheduling], n = copies_overlapping_compute(t.events)
        assert n >= 10, f"expected a metadata copy per step, found {n}"
    assert share[True] >= 0.5 and share[False] < 0.2, (
        f"copies overlapping compute: async {share[True]:.0%}, plain loop {share[False]:.0%}")
