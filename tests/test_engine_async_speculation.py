"""Async speculation: a verify row planned before the step in flight says how many drafts it kept.

With async scheduling the host plans step N+1 while step N computes. If step N verifies drafts,
step N+1's row for that request starts wherever step N's accepted count A puts it, which only
the device knows yet. The scheduler plans the row as if A = 0, holds blocks for the longest
outcome, and gives the device a window of drafts; the device moves the row by A; ``update(N)``
resolves the row on the host the same way. The rules tested here: outputs are exactly plain
greedy decoding's, what the device ran is exactly the resolved row, no block leaks, and the
block manager's reservations check before they change anything.
"""
import random

import pytest
import torch

from labkit.engine import LLM, ModelConfig, SamplingParams, SpeculativeConfig
from labkit.engine.config import SchedulerConfig
from labkit.engine.speculative import accept_greedy
from labkit.engine.step_metadata import build_step_metadata
from labkit.kernels.rows_ahead import count_accepted, move_rows
from labkit.kvcache import BlockManager
from labkit.kvcache.refusals import OutOfBlocks

TINY = ModelConfig.tiny()
# where the Triton kernels run: the GPU where there is one, else the interpreter on the CPU
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[1, 2, 3, 4, 5] * 3 + [1, 2], [7, 8, 9], list(range(40)), [11, 12, 11, 12, 11]]


def outputs(llm, prompts=PROMPTS, **params):
    done = llm.generate(prompts, SamplingParams(**{"max_tokens": 24, **params}))
    return [o.token_ids for o in done]


def controlled(acceptance=0.7, k=3, **kw):
    return LLM(TINY, device="cpu", async_scheduling=True,
               speculative=SpeculativeConfig("controlled", k, acceptance=acceptance), **kw)


@pytest.fixture(scope="module")
def plain():
    return outputs(LLM(TINY, device="cpu"))


def watch_rows_ahead(llm):
    """Check, after every update, that what the device ran for each row planned ahead is the
    row as resolved on the host (ids, positions, slots, lengths from the block manager).
    Returns the list of accepted counts seen, one per row planned ahead."""
    seen, launched = [], {}
    runner, update = llm.runner, llm.scheduler.update
    execute = runner.execute

    def recording_execute(step, bm, *args):
        out = execute(step, bm, *args)
        launched[step.step_id] = (step, out.inputs)
        return out

    def checking_update(step, sampled):
        finished = update(step, sampled)
        if llm.scheduler.steps_in_flight:
            nxt = llm.scheduler._in_flight[0]
            planned, dev = launched[nxt.step_id]
            for i, (before, row) in enumerate(zip(planned.rows, nxt.rows)):
                if before.draft_window is None or row.request.finished:
                    continue
                seen.append(row.start - before.start)
                resolved = build_step_metadata(
                    type(nxt)(nxt.step_id, (row,), (), (), nxt.stats), llm.block_manager)
                a, b = dev.cu_seqlens_q[i].item(), dev.cu_seqlens_q[i + 1].item()
                assert dev.input_ids[a:b].tolist() == resolved.input_ids, "drafts or token"
                assert dev.positions[a:b].tolist() == resolved.positions, "positions"
                assert dev.slot_mapping[a:b].tolist() == resolved.slot_mapping, "slots"
                assert dev.seq_lens[i].item() == resolved.seq_lens[0], "length"
        return finished

    runner.execute = recording_execute
    llm.scheduler.update = checking_update
    return seen


@pytest.mark.parametrize("acceptance,k", [(0.0, 2), (0.6, 3), (1.0, 4)])
def test_greedy_outputs_are_plain_decodings_and_the_device_ran_the_resolved_rows(
        plain, acceptance, k):
    llm = controlled(acceptance, k)
    seen = watch_rows_ahead(llm)
    assert outputs(llm) == plain
    assert seen and max(seen) <= k, "no row was planned ahead"
    if acceptance > 0:
        assert max(seen) > 0, "no row moved: the shift on the device went untested"
    st = llm.stats
    assert st.num_spec_accepted == (st.num_spec_proposed if acceptance == 1 else
                                    st.num_spec_accepted)
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.seq_ids, "a block leaked"


@pytest.mark.parametrize("options", [
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16, max_num_seqs=4),            # chunked prefill, tight budget
    dict(num_blocks=20, block_size=4, max_num_seqs=4),          # preemption under block pressure
    dict(cudagraph_mode="piecewise"),                           # attention eager between pieces
], ids=["no-prefix-cache", "chunked", "preemption", "piecewise"])
def test_async_speculation_keeps_outputs_under_the_engines_other_mechanisms(plain, options):
    llm = controlled(0.7, 3, **options)
    seen = watch_rows_ahead(llm)
    assert outputs(llm) == plain
    assert seen, "no row was planned ahead"
    if "num_blocks" in options:
        assert llm.stats.preemptions > 0, "the pressure test preempted nothing"
    bm = llm.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not bm.seq_ids, "a block leaked"


def test_rows_planned_ahead_take_the_verify_graphs(plain):
    """A uniform verify step of rows planned ahead goes through the verify graphs' inputs (on
    CPU the pool checks the captured shapes and runs the function eagerly), moved first."""
    llm = controlled(0.8, 3)
    llm.runner.capture_verify_graphs(3)
    seen = watch_rows_ahead(llm)
    assert outputs(llm) == plain and max(seen) > 0
    assert llm.graph_steps["full verify"] > 0, llm.graph_steps
    assert llm.runner.verify_graphs.stats.eager_calls == llm.graph_steps["full verify"]


def test_stop_tokens_and_max_tokens_inside_accepted_drafts(plain):
    """A request that stops inside a verify row's accepted drafts already has a row planned
    ahead: that row's tokens are dropped, its held blocks go back."""
    stop = plain[2][5]
    for params in (dict(stop_token_ids=[stop]), dict(max_tokens=7), dict(max_tokens=1)):
        want = outputs(LLM(TINY, device="cpu"), **params)
        llm = controlled(1.0, 4)
        assert outputs(llm, **params) == want, params
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_more_tokens_per_step_than_async_plain_decoding_and_the_loop_stays_async(plain):
    """Every step after the first is launched before the previous step's tokens are read (the
    step in flight), and a verify row emits up to k + 1 tokens: fewer steps than plain async
    decoding at acceptance 1."""
    base = LLM(TINY, device="cpu", async_scheduling=True)
    outputs(base)
    llm = controlled(1.0, 4)
    in_flight = []
    schedule = llm.scheduler.schedule

    def recording_schedule():
        in_flight.append(llm.scheduler.steps_in_flight)
        return schedule()
    llm.scheduler.schedule = recording_schedule
    assert outputs(llm) == plain
    assert llm.stats.num_steps < base.stats.num_steps / 2
    assert in_flight.count(1) >= len(in_flight) - 2, "the loop waited for the device"


def test_a_failed_step_with_rows_planned_ahead_leaves_the_engine_as_it_was(plain):
    for fail_at in (3, 4, 6):
        llm = controlled(0.8, 3, max_num_seqs=4)
        execute, calls = llm.runner.execute, []

        def failing(*args, **kw):
            calls.append(1)
            if len(calls) == fail_at:
                raise RuntimeError("simulated device failure")
            return execute(*args, **kw)
        llm.runner.execute = failing
        with pytest.raises(RuntimeError, match="simulated device failure"):
            outputs(llm)
        bm = llm.block_manager
        assert not llm.has_unfinished_requests() and llm.scheduler.steps_in_flight == 0
        assert bm.num_free_blocks == bm.num_blocks and not bm.seq_ids, "blocks leaked"
        llm.runner.execute = execute
        assert outputs(llm) == plain, "the prefix cache kept a block whose step failed"


def test_an_mla_model_planned_ahead_keeps_its_greedy_tokens():
    from mla_cases import mla_model, tiny_mla
    model = mla_model(tiny_mla(), 3)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12], list(range(20, 50))]
    want = outputs(LLM(model, device="cpu"), prompts, max_tokens=12)
    llm = LLM(model, device="cpu", async_scheduling=True,
              speculative=SpeculativeConfig("controlled", 3, acceptance=0.7))
    seen = watch_rows_ahead(llm)
    assert outputs(llm, prompts, max_tokens=12) == want and max(seen) > 0


def test_only_position_based_drafts_can_be_planned_ahead():
    with pytest.raises(ValueError, match="method 'controlled'"):
        SchedulerConfig(async_scheduling=True, speculative=SpeculativeConfig("ngram", 2),
                        vocab_size=TINY.vocab_size)
    SchedulerConfig(async_scheduling=True, vocab_size=TINY.vocab_size,
                    speculative=SpeculativeConfig("controlled", 2))


# ---------------------------------------------------------------- counting on the device
@pytest.mark.parametrize("use_kernel", [False, True], ids=["torch", "triton"])
def test_count_accepted_is_accept_greedy_row_by_row(use_kernel):
    rng = random.Random(3)
    for _ in range(60 if use_kernel else 200):
        ids, logits_indices, starts, samples, want = [], [], [0], [], []
        for _ in range(rng.randrange(1, 6)):
            if rng.random() < 0.3:  # a prefill chunk or decode: one sample after its last token
                ids += [rng.randrange(4) for _ in range(rng.randrange(1, 5))]
                logits_indices.append(len(ids) - 1)
                samples.append(rng.randrange(4))
                want.append((0, samples[-1]))
            else:
                k = rng.randrange(1, 5)
                drafts = [rng.randrange(3) for _ in range(k)]
                target = [rng.randrange(3) for _ in range(k + 1)]
                ids += [rng.randrange(4)] + drafts
                logits_indices += range(len(ids) - k - 1, len(ids))
                samples += target
                want.append(accept_greedy(drafts, target))
            starts.append(len(samples))
        dev = KERNEL_DEVICE if use_kernel else "cpu"
        t = lambda x, d=torch.int32: torch.tensor(x, dtype=d, device=dev)  # noqa: E731
        accepted, nxt = count_accepted(t(samples, torch.int64), t(ids), t(logits_indices),
                                       t(starts), 5, use_kernel=use_kernel)
        assert list(zip(accepted.tolist(), nxt.tolist())) == want


def test_move_rows_kernel_is_its_reference_on_random_rows():
    """Rows planned ahead, moved by random accepted counts: positions, slots through the block
    table, the next token at offset 0, drafts from the window, each row's length once."""
    rng = random.Random(5)
    t = lambda x, d=torch.int32: torch.tensor(x, dtype=d, device=KERNEL_DEVICE)  # noqa: E731
    for _ in range(20):
        bs, rows = rng.choice([2, 4, 16]), rng.randrange(1, 5)
        ks = [rng.randrange(0, 5) for _ in range(rows)]        # drafts of each planned row
        prev = [rng.randrange(0, 5) for _ in range(rows)]       # drafts its source row had
        width = 12
        tables = torch.randperm(rows * width).int().view(rows, width).to(KERNEL_DEVICE)
        ids, pos, lens, dst, src, off, row, win, window = [], [], [], [], [], [], [], [], []
        for r in range(rows):
            start = rng.randrange(0, 4 * bs)
            for j in range(ks[r] + 1):
                dst.append(len(ids))
                ids.append(-1 if j == 0 else 99)
                pos.append(start + j)
                src.append(r)
                off.append(j)
                row.append(r)
                win.append(-1 if j == 0 else len(window) + j - 1)
            window += [rng.randrange(50) for _ in range(prev[r] + ks[r])]
            lens.append(start + ks[r] + 1)
        window.append(0)
        win = [len(window) - 1 if w < 0 else w for w in win]
        accepted = t([rng.randrange(p + 1) for p in prev], torch.int64)
        nxt = t([rng.randrange(50) for _ in range(rows)], torch.int64)
        out = []
        for use_kernel in (False, True):
            meta = [t(ids), t(pos), t([0] * len(ids)), t(lens)]
            move_rows(*meta, tables, t(dst), t(src), t(off), t(row), t(win), t(window), nxt,
                      accepted, bs, use_kernel=use_kernel)
            out.append(meta)
        assert all(torch.equal(a, b) for a, b in zip(*out))
        ids_, pos_, slots_, lens_ = (m.tolist() for m in out[0])
        for i, (p0, r, j) in enumerate(zip(pos, row, off)):
            a = int(accepted[r])
            assert pos_[i] == p0 + a and slots_[i] == int(tables[r, (p0 + a) // bs]) * bs + \
                (p0 + a) % bs
            assert ids_[i] == (int(nxt[r]) if j == 0 else window[win[i] + a])
        assert lens_ == [n + int(a) for n, a in zip(lens, accepted)]


# ---------------------------------------------------------------- the block manager
def test_reserve_holds_blocks_that_later_tokens_take_in_order_and_release_gives_back():
    bm = BlockManager(8, 4)
    bm.allocate("a", [1, 2, 3, 4, 5])               # 2 blocks
    bm.append_draft("a", [6, 7, 8, 9])              # 9 tokens: 3 blocks
    bm.reserve("a", 9 + 1 + 4)                      # the longest outcome: 14 tokens, 4 blocks
    table = bm.block_table("a")
    assert len(table) == 4 and bm.num_free_blocks == 4
    bm.accept_draft("a", 1)                         # 6 tokens; the held blocks stay
    assert bm.block_table("a") == table
    bm.append_token("a", 10)
    bm.append_draft("a", [11, 12, 13])              # 10 tokens, into the held blocks
    assert bm.block_table("a") == table and bm.num_free_blocks == 4, "took new blocks"
    assert bm.slots("a", 6, 10) == [table[p // 4] * 4 + p % 4 for p in range(6, 10)]
    bm.release_reserve("a")
    assert bm.block_table("a") == table[:3] and bm.num_free_blocks == 5
    bm.accept_draft("a", 3)
    bm.free("a")
    assert bm.num_free_blocks == 8


def test_a_refused_reserve_changes_nothing():
    bm = BlockManager(3, 4)
    bm.allocate("a", [1, 2, 3, 4, 5])
    before = bm.snapshot()
    with pytest.raises(OutOfBlocks):
        bm.reserve("a", 13)
    with pytest.raises(ValueError, match="capacity"):
        bm.reserve("a", 4)
    assert bm.snapshot() == before
    assert bm.can_reserve("a", 12) and not bm.can_reserve("a", 13)


def test_blocks_filled_through_a_reservation_are_found_by_the_prefix_cache():
    bm = BlockManager(8, 4)
    bm.allocate("a", [1, 2, 3])
    bm.reserve("a", 9)
    for t in (4, 5, 6, 7, 8):
        bm.append_token("a", t)
    bm.release_reserve("a")
    assert bm.cached_prefix_len([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["full_and_piecewise", "none"])
def test_gpu_async_speculation_replays_verify_graphs_and_keeps_greedy_outputs(mode):
    def run(**kw):
        llm = LLM(TINY, device="cuda", dtype=torch.float32, cudagraph_mode=mode, **kw)
        return llm, outputs(llm)
    _, want = run(async_scheduling=False)
    llm, got = run(async_scheduling=True,
                   speculative=SpeculativeConfig("controlled", 3, acceptance=0.8))
    assert got == want
    if mode != "none":
        assert llm.graph_steps["full verify"] > 0, llm.graph_steps
