"""The scheduler under random workloads (hypothesis): every invariant holds at every step and
every request finishes with the tokens it must generate, or is refused alone."""
import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

import labkit  # noqa: F401  (sets up Triton before anything imports it)
from labkit.engine.scheduler import Status
from scheduler_harness import EOS, VOCAB, make, prompt_of, reference_output, run

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
