"""Async speculation under random workloads (hypothesis), with a fake device that knows only
what a device knows.

The fake device stores in each slot a key chained from the key of the position before (read
through the block table) and the token it was given, and samples from the key at each position:
so its tokens depend on exactly the KV it read. A row planned ahead reaches it as the host
planned it (as if no draft was kept); it is moved by the engine's own code
(``metadata_to_device`` with the previous step's counts from ``count_accepted``), never by
the host's later knowledge. Steps are launched before the previous step is updated, as the
engine's async loop does. Every request must generate the chained greedy continuation, every
block invariant must hold after every update, and no block may be left at the end, across
over a thousand rollbacks a run, preemptions, prefix hits and stop tokens.
"""
import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, given, settings

import labkit  # noqa: F401  (sets up Triton before anything imports it)
from labkit.engine.device_metadata import metadata_to_device
from labkit.engine.scheduler import Scheduler, SchedulerConfig, Status
from labkit.engine.speculative import SpeculativeConfig
from labkit.engine.step_metadata import build_step_metadata
from labkit.kernels.rows_ahead import count_accepted
from labkit.kvcache import BlockManager
from scheduler_harness import EOS, VOCAB, check_blocks, copy_blocks, prompt_of

ROOT = 12345


def chain(key: int, token: int) -> int:
    return hash((key, token))


def sample(key: int) -> int:
    return key % VOCAB


def greedy(prompt, max_tokens, max_model_len, eos=(EOS,)):
    """The continuation a request must generate: each token sampled from the chained key of
    everything before it."""
    key = ROOT
    for t in prompt:
        key = chain(key, t)
    out, n = [], len(prompt)
    limit = max(max_model_len, n + 1)
    while True:
        t = sample(key)
        out.append(t)
        key = chain(key, t)
        if t in eos or len(out) >= max_tokens or n + len(out) >= limit:
            return out


class FakeDevice:
    """Runs a step from its device metadata alone; returns the samples and what
    ``count_accepted`` counts from them (for the next step, planned ahead)."""

    def __init__(self, bm: BlockManager):
        self.bm, self.memory = bm, {}

    def __call__(self, step, prev):
        bs = self.bm.block_size
        copy_blocks(self.memory, step.block_copies, bs)
        md = build_step_metadata(step, self.bm)
        dev = metadata_to_device(md, None, *(prev or (None, None)), block_size=bs)
        ids, pos, slots = dev.input_ids.tolist(), dev.positions.tolist(), dev.slot_mapping.tolist()
        cu, tables = dev.cu_seqlens_q.tolist(), dev.block_tables.tolist()
        keys = [None] * len(ids)
        for i in range(len(step.rows)):  # store first, then read, as each layer does
            for t in range(cu[i], cu[i + 1]):
                p = pos[t]
                if t > cu[i]:
                    parent = keys[t - 1]
                elif p == 0:
                    parent = ROOT
                else:
                    parent = self.memory.get(tables[i][(p - 1) // bs] * bs + (p - 1) % bs)
                keys[t] = chain(parent, ids[t])
                self.memory[slots[t]] = keys[t]
        for i in range(len(step.rows)):  # every row reads its context back through its table
            n = dev.seq_lens[i].item()
            assert n == pos[cu[i + 1] - 1] + 1, f"row {i}'s length is not its last position + 1"
            for t in range(cu[i], cu[i + 1]):
                p = pos[t]
                assert p < n and self.memory[tables[i][p // bs] * bs + p % bs] == keys[t], \
                    f"step {step.step_id}: row {i} reads a slot another row overwrote"
        samples = torch.tensor([sample(keys[t]) for t in dev.logits_indices.tolist()])
        most = max(r.num_logits for r in step.rows)
        accepted, nxt = count_accepted(samples, dev.input_ids, dev.logits_indices,
                                       dev.sample_starts, most)
        return samples, nxt, accepted


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4]))
    budget = draw(st.integers(4, 20))
    cfg = dict(max_num_batched_tokens=budget, max_num_seqs=draw(st.integers(1, 4)),
               max_model_len=draw(st.integers(10, 48)),
               enable_chunked_prefill=draw(st.booleans()), vocab_size=VOCAB,
               async_scheduling=True,
               speculative=SpeculativeConfig(
                   "controlled", draw(st.integers(1, 4)),
                   acceptance=draw(st.sampled_from([0.0, 0.5, 0.8, 1.0])),
                   seed=draw(st.integers(0, 3))))
    shared = prompt_of(8, 11)
    requests = {}
    for rid in range(draw(st.integers(1, 8))):
        prompt = (shared if draw(st.booleans()) else []) + draw(
            st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=12))
        requests[rid] = (draw(st.integers(0, 6)), prompt, draw(st.integers(1, 20)))
    return block_size, draw(st.integers(6, 24)), draw(st.booleans()), cfg, requests


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_async_speculation_generates_the_greedy_continuation_and_keeps_every_invariant(w):
    block_size, num_blocks, caching, cfg, requests = w
    bm = BlockManager(num_blocks, block_size, caching)
    sched = Scheduler(SchedulerConfig(**cfg), bm)
    device, added = FakeDevice(bm), {}
    launched = None  # (step, samples, next tokens, accepted counts): on the device, not read
    limit, last_arrival = cfg["max_model_len"], max(at for at, _, _ in requests.values())
    for i in range(3000):
        for rid, (at, prompt, max_tokens) in requests.items():
            if at == i:
                added[rid] = sched.add_request(
                    rid, prompt, max_tokens=max_tokens, eos_token_ids=[EOS],
                    reference=greedy(prompt, max_tokens, limit))
        if i > last_arrival and launched is None and not sched.has_unfinished_requests():
            break
        queued = None
        if sched.has_unfinished_requests():
            step = sched.schedule()
            assert step.num_tokens <= cfg["max_num_batched_tokens"], "over the step's budget"
            if step.rows:
                queued = (step, *device(step, launched and launched[2:]))
        if launched is not None:  # read only now: the next step is queued already
            sched.update(launched[0], launched[1])
            check_blocks(sched, bm)
        launched = queued
    else:
        raise AssertionError("requests still unfinished after 3000 steps: livelock?")
    assert bm.stats.blocks_in_use == 0 and not bm.seq_ids
    for rid, (_, prompt, max_tokens) in requests.items():
        req = added[rid]
        if req.status is Status.FINISHED_ERROR:
            continue  # refused alone: the synchronous tests cover who is refused
        assert req.output_token_ids == greedy(prompt, max_tokens, limit), rid
