"""Piecewise graphs: the forward cut at attention, each piece captured per token count.

On CPU the pieces are captured by labkit's stand-in (``emulated_cuda``): a replay reruns the
recorded torch ops on the captured tensors, so it computes the step only if the pieces read
every input from the static buffers the runner fills. Greedy tokens must then equal eager's
for every mix of prefill chunks and decodes. The GPU runs of all four modes:
``test_gpu_every_cudagraph_mode_gives_the_same_tokens``.
"""
import pytest
import torch

from labkit.engine import LLM, ModelConfig, SamplingParams
from labkit.engine.runner import CUDAGRAPH_MODES, resolve_cudagraph_mode
from labkit.graphs import emulated_cuda
from labkit.graphs.piecewise import PiecewiseGraphs, default_token_buckets

from engine_peer import GREEDY, PROMPTS, assert_same_tokens, hf_model, make_prompts  # noqa: F401

CPU = torch.device("cpu")
SMALL = (1, 2, 4, 8, 16, 32)  # capture sizes for CPU tests: every step below 33 tokens replays


# --- the token buckets -------------------------------------------------------------------------
def test_default_token_buckets_are_dense_where_steps_are_common():
    b = default_token_buckets(4096)
    assert b[:5] == (1, 2, 4, 8, 16) and b[-1] == 2048, "the largest capture is 2048 tokens"
    steps = [y - x for x, y in zip(b, b[1:])]
    assert set(steps[3:b.index(256)]) == {8}, "every 8 tokens from 8 to 256"
    assert set(steps[b.index(256):b.index(512)]) == {16}, "every 16 tokens up to 512"
    assert set(steps[b.index(512):b.index(1024)]) == {64}
    assert set(steps[b.index(1024):]) == {128}
    assert 576 in b, "a 512-token chunk beside 63 decodes pads by one token"


@pytest.mark.parametrize("top", [1, 3, 5, 100, 300])
def test_the_largest_token_bucket_is_the_step_budget_when_that_is_smaller(top):
    b = default_token_buckets(top)
    assert b[-1] == top and all(x < top for x in b[:-1]) and list(b) == sorted(set(b))


def test_token_buckets_refuse_a_budget_that_is_not_a_positive_int():
    with pytest.raises(ValueError, match="max_tokens"):
        default_token_buckets(0)
    with pytest.raises(TypeError, match="max_tokens"):
        default_token_buckets(2.5)


# --- the modes ---------------------------------------------------------------------------------
def test_cudagraph_mode_defaults_and_refusals():
    cuda = torch.device("cuda")
    assert resolve_cudagraph_mode(None, False, CPU) == "none"
    assert resolve_cudagraph_mode(None, False, cuda) in CUDAGRAPH_MODES[1:]
    assert resolve_cudagraph_mode(None, True, cuda) == "none"
    assert resolve_cudagraph_mode("piecewise", False, CPU) == "piecewise"
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        resolve_cudagraph_mode("full", False, cuda)
    with pytest.raises(ValueError, match="enforce_eager=True means cudagraph_mode='none'"):
        resolve_cudagraph_mode("piecewise", True, cuda)
    for full in ("full_decode_only", "full_and_piecewise"):
        with pytest.raises(ValueError, match="needs a CUDA device.*'piecewise'"):
            resolve_cudagraph_mode(full, False, CPU)


def test_piecewise_on_cpu_refuses_fused_triton_ops_it_cannot_record():
    with pytest.raises(ValueError, match="fused_ops=False"):
        LLM(ModelConfig.tiny(), device="cpu", cudagraph_mode="piecewise", fused_ops=True,
            cudagraph_capture_sizes=SMALL)


# --- the pool of pieces ------------------------------------------------------------------------
def test_pieces_replay_in_order_with_the_eager_work_between_them():
    order, buf = [], torch.zeros(8)

    def piece(i):
        def run(n):
            buf[:n].mul_(10).add_(i)   # recorded: replays redo it on the same buffer
        return run

    pool = PiecewiseGraphs([piece(1), piece(2), piece(3)], [2, 4, 8], cuda=emulated_cuda)
    stats = pool.capture()
    assert stats.num_graphs == 9 and list(stats.buckets) == [2, 4, 8]
    buf.zero_()
    assert pool.run(3, lambda i: order.append((i, buf[0].item()))) == 4
    assert order == [(0, 1.0), (1, 12.0)], "between(i) runs after piece i, before piece i + 1"
    assert buf[:4].tolist() == [123.0] * 4 and buf[4:].tolist() == [0.0] * 4
    assert (stats.replays, stats.padded_tokens) == (1, 1)
    assert pool.bucket_for(9) is None
    with pytest.raises(ValueError, match="larger than the largest captured bucket 8"):
        pool.run(9, lambda i: None)


def test_a_piece_that_reads_a_value_back_fails_capture_and_captures_nothing():
    x = torch.ones(4)

    def host_read(n):
        if x[:n].sum() > 0:  # a Python branch on a device value: illegal in a capture
            x.add_(1)

    pool = PiecewiseGraphs([lambda n: x.mul_(2), host_read], [1, 4], cuda=emulated_cuda)
    with pytest.raises(RuntimeError, match="reads a value back to the host"):
        pool.capture()
    assert not pool.stats.buckets
    with pytest.raises(RuntimeError, match="capture"):
        pool.run(1, lambda i: None)


def test_bad_pieces_and_buckets_are_refused_by_name():
    with pytest.raises(TypeError, match="pieces"):
        PiecewiseGraphs([], [1])
    with pytest.raises(ValueError, match=r"buckets\[1\]"):
        PiecewiseGraphs([lambda n: None], [1, 0])


# --- the engine: piecewise replays give eager's tokens -----------------------------------------
def _engines(path, **kwargs):
    eager = LLM(path, device="cpu", cudagraph_mode="none", **kwargs)
    graphs = LLM(path, device="cpu", cudagraph_mode="piecewise", cudagraph_capture_sizes=SMALL,
                 **kwargs)
    return eager, graphs


@pytest.mark.parametrize("budget", [8, 32, 2048], ids=["chunked-8", "chunked-32", "whole"])
def test_piecewise_replays_give_eager_tokens_for_every_mix(hf_model, budget):
    eager, graphs = _engines(hf_model[1], max_num_batched_tokens=budget, max_num_seqs=4)
    a, b = eager.generate(PROMPTS, GREEDY), graphs.generate(PROMPTS, GREEDY)
    assert_same_tokens(b, [o.token_ids for o in a], f"piecewise, budget {budget}")
    table = graphs.history_table()
    piecewise = table[table.graph == "piecewise"]
    assert len(piecewise) > 0 and graphs.stats.num_piecewise_steps == len(piecewise)
    mixed = piecewise[(piecewise.num_prefill_tokens > 0) & (piecewise.num_decode_tokens > 0)]
    if budget < 2048:
        assert len(mixed) > 0, "no mixed step replayed: the test proves nothing for mixes"
    # a step of more tokens than the largest capture size runs eagerly, and says so
    too_big = table[table.num_prefill_tokens + table.num_decode_tokens > SMALL[-1]]
    assert (too_big.graph == "eager").all() and (too_big.graph_tokens.isna()).all()
    assert (piecewise.padded_tokens == piecewise.graph_tokens - piecewise.num_prefill_tokens
            - piecewise.num_decode_tokens).all()
    assert graphs.stats.padded_tokens == int(table.padded_tokens.sum()) > 0


def test_piecewise_with_prefix_hits_preemption_and_async_scheduling(hf_model):
    shared = make_prompts([24], seed=3)[0]
    prompts = [shared + p for p in make_prompts([5, 9, 2, 13], seed=4)]
    kwargs = dict(num_blocks=9, block_size=8, max_num_batched_tokens=16, max_num_seqs=4,
                  async_scheduling=True)
    eager, graphs = _engines(hf_model[1], **kwargs)
    params = SamplingParams(max_tokens=10)
    a, b = eager.generate(prompts, params), graphs.generate(prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert graphs.stats.prefix_hit_tokens > 0 and graphs.stats.preemptions > 0, graphs.stats
    assert graphs.stats.num_piecewise_steps > 0


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_piecewise_serves_backends_that_full_graphs_cannot_capture(hf_model, backend):
    eager, graphs = _engines(hf_model[1], backend=backend, max_num_batched_tokens=16,
                             max_num_seqs=4)
    assert graphs.backend == backend and graphs.cudagraph_mode == "piecewise"
    prompts = PROMPTS[:3]
    assert [o.token_ids for o in graphs.generate(prompts, GREEDY)] == \
        [o.token_ids for o in eager.generate(prompts, GREEDY)]


# --- on a GPU: all four modes ------------------------------------------------------------------
@pytest.mark.gpu
def test_gpu_every_cudagraph_mode_gives_the_same_tokens(hf_model):
    prompts = make_prompts([3, 40, 1, 17, 9, 64, 2], seed=9)
    params = SamplingParams(max_tokens=24)
    tokens, engines = {}, {}
    for mode in CUDAGRAPH_MODES:
        llm = LLM(hf_model[1], device="cuda", cudagraph_mode=mode, max_num_batched_tokens=32,
                  max_num_seqs=8)
        assert llm.cudagraph_mode == mode
        tokens[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        engines[mode] = llm.stats
    assert all(t == tokens["none"] for t in tokens.values()), tokens
    assert engines["none"].num_graph_steps == engines["none"].num_piecewise_steps == 0
    assert engines["full_decode_only"].num_graph_steps > 0
    assert engines["full_decode_only"].num_piecewise_steps == 0
    assert engines["piecewise"].num_piecewise_steps == engines["piecewise"].num_steps
    both = engines["full_and_piecewise"]
    assert both.num_graph_steps > 0 and both.num_piecewise_steps > 0, both


@pytest.mark.gpu
def test_gpu_graph_memory_is_predicted_before_capture_within_a_quarter(hf_model):
    llm = LLM(hf_model[1], device="cuda", cudagraph_mode="full_and_piecewise",
              max_num_batched_tokens=256, max_num_seqs=16)
    rows = {m["graphs"]: m for m in llm.runner.graph_memory()}
    assert set(rows) == {"full", "piecewise"}
    for kind, m in rows.items():
        assert m["count"] > 0 and m["capture_ms"] > 0 and m["measured_bytes"] > 0, m
        err = abs(m["predicted_bytes"] - m["measured_bytes"]) / m["measured_bytes"]
        assert err <= 0.25, (kind, m)
