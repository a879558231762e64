"""A model-free harness for driving the scheduler (tests/test_engine_scheduler*.py).

A fake runner stands in for the model: it stores, in every slot the step's metadata names, a key
of the whole prefix that token ends (what real KV depends on), reads each row's context back
through its block table, and samples from the key it read. So a wrong prefix hit, a block freed
too early or a token computed twice shows up as a row reading the wrong context, and as a
different generation, not only as a broken count.
"""
from collections import Counter

import labkit  # noqa: F401  (sets up Triton before anything imports it)
from labkit.engine.scheduler import Scheduler, SchedulerConfig
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


def copy_blocks(memory: dict, block_copies, block_size: int) -> None:
    """Apply a step's copy-on-write ``(src, dst)`` block copies to a fake cache (slot -> key)."""
    for src, dst in block_copies:
        for i in range(block_size):
            if src * block_size + i in memory:
                memory[dst * block_size + i] = memory[src * block_size + i]


class FakeRunner:
    def __init__(self, bm: BlockManager):
        self.bm = bm
        self.memory: dict[int, int] = {}  # slot -> prefix key of the token stored there

    def __call__(self, step) -> list[int]:
        bs = self.bm.block_size
        copy_blocks(self.memory, step.block_copies, bs)
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
