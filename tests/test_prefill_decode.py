"""Notebook 07's library: the FLOP/byte arithmetic, the measured forward, what bounds it, the
engine runs."""
import dataclasses
import json
import math

import pandas as pd
import pytest
import torch

from labkit.engine import LLM, ModelConfig, random_model
from labkit.lessons.prefill_vs_decode import bounds, cost, figures, forward, latency
from labkit.lessons.prefill_vs_decode import chunked_prefill as cp

# h 8, intermediate 16, 1 layer, 2 query heads / 1 KV head of dim 4, vocabulary 10, float32:
# q_size 8, kv_size 4; matmul weights per layer 8*(8+2*4) + 8*8 + 3*8*16 = 576.
SMALL = ModelConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=4, vocab_size=10)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Timings here are only sanity-checked, but on a small machine shared with other programs a
    second thread stalls whenever they hold a core, which multiplies these tests' time."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_model():
    return random_model(ModelConfig.tiny(), seed=0, device="cpu")


# ----------------------------------------------------------------------------- arithmetic
def test_prefill_cost_matches_the_hand_count():
    c = cost.forward_cost(SMALL, cost.prefill(3))
    assert c["linear_flops"] == 2 * 3 * 576 + 2 * 1 * 10 * 8, "2 FLOPs per weight per token, " \
        "plus the logits of the last token only"
    assert c["attention_flops"] == 4 * 2 * 4 * 6, "causal: 3 queries see 1+2+3 keys"
    assert c["weight_bytes"] == 4 * (576 + 2 * 8 + 8 + 10 * 8), "every weight read once"
    assert c["kv_bytes"] == 4 * 2 * 4 * (3 + 3), "K and V written for 3 tokens and read once"
    assert c["activation_bytes"] == 4 * (3 * 8 + 3 * (4 * 8 + 2 * 8 + 2 * 4 + 3 * 16) + 18)
    assert c["flops_per_byte"] == pytest.approx(c["flops"] / c["bytes"])


def test_decode_cost_matches_the_hand_count():
    c = cost.forward_cost(SMALL, cost.decode(2, 5))
    assert c["linear_flops"] == 2 * 2 * 576 + 2 * 2 * 10 * 8, "two rows, each sampled"
    assert c["attention_flops"] == 4 * 2 * 4 * 2 * 5, "each row's query sees its 5 keys"
    assert c["kv_bytes"] == 4 * 2 * 4 * 2 * (1 + 5), "each row writes 1 token, reads 5"
    assert c["weight_bytes"] == cost.forward_cost(SMALL, cost.prefill(3))["weight_bytes"]


def test_bf16_halves_every_byte_and_keeps_every_flop():
    f32 = cost.forward_cost(SMALL, cost.decode(4, 9), dtype_bytes=4)
    bf16 = cost.forward_cost(SMALL, cost.decode(4, 9), dtype_bytes=2)
    assert bf16["bytes"] * 2 == f32["bytes"] and bf16["flops"] == f32["flops"]


def test_batching_decode_shares_the_weight_reads():
    one, many = (cost.forward_cost(ModelConfig.bench_1b(), cost.decode(b, 256)) for b in (1, 64))
    assert many["weight_bytes"] == one["weight_bytes"], "weights are read once per step"
    assert many["flops_per_byte"] > 30 * one["flops_per_byte"], (
        "64 rows per weight read should raise decode's intensity many times over")


def test_prefill_is_compute_bound_and_decode_memory_bound_on_an_h200_ridge():
    cfg, ridge = ModelConfig.bench_1b(), 190.0
    assert cost.forward_cost(cfg, cost.prefill(2048))["flops_per_byte"] > ridge
    assert cost.forward_cost(cfg, cost.decode(1, 1024))["flops_per_byte"] < 2


def test_cost_table_reports_gflop_and_mb():
    table = cost.cost_table(SMALL, [cost.prefill(3)])
    raw = cost.forward_cost(SMALL, cost.prefill(3))
    assert table.loc["prefill S=3", "GFLOP"] == pytest.approx(raw["flops"] / 1e9)
    assert table.loc["prefill S=3", "kv_MB"] == pytest.approx(raw["kv_bytes"] / 1e6)


def test_knee_is_the_first_batch_at_the_ridge():
    cfg, ridge = ModelConfig.bench_1b(), 190.0
    knee = cost.knee_batch(cfg, 0, ridge)
    assert knee is not None and 100 < knee < 400, f"weights-only knee of bench_1b: {knee}"
    assert cost.decode_intensity(cfg, knee, 0) >= ridge > cost.decode_intensity(cfg, knee - 1, 0)


def test_long_contexts_never_reach_the_ridge():
    cfg = ModelConfig.bench_1b()
    assert cost.knee_batch(cfg, 4096, 190.0) is None, (
        "at 4k tokens of context each row's KV reads keep decode below the ridge")
    assert cost.knee_batch(cfg, 4096, 1.0) == 1, "a ridge below batch-1 intensity is met at once"


@pytest.mark.parametrize("bad, match", [
    (dict(kind="verify", batch=1, tokens=1, context=1), "kind"),
    (dict(kind="decode", batch=0, tokens=1, context=1), "batch"),
    (dict(kind="prefill", batch=1, tokens=8, context=4), "context"),
    (dict(kind="decode", batch=True, tokens=1, context=1), "batch"),
])
def test_a_shape_that_cannot_exist_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        cost.ForwardShape(**bad)


# ----------------------------------------------------------------------------- the forward
@pytest.mark.parametrize("batch, q_heads, kv_heads, context, dtype, tol", [
    (3, 8, 2, 37, torch.float32, 1e-5),    # GQA, a context that is no power of two
    (1, 4, 4, 1, torch.float32, 1e-5),     # MHA, one cached token
    (2, 8, 1, 64, torch.float16, 2e-3),    # MQA in half precision
])
def test_decode_attention_matches_the_reference(batch, q_heads, kv_heads, context, dtype, tol):
    g = torch.Generator().manual_seed(batch * 100 + context)
    q = torch.randn(batch, q_heads, 16, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv_heads, context, 16, generator=g).to(dtype) for _ in "kv")
    out = forward.decode_attention(q, k, v)
    ref = forward.decode_attention_ref(q, k, v)
    assert out.shape == (batch, q_heads, 16) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_prefill_step_gives_the_models_own_logits(tiny_model):
    step = forward.forward_step(tiny_model, cost.prefill(5, batch=2), seed=3)
    ids = torch.randint(0, tiny_model.config.vocab_size, (10,),
                        generator=torch.Generator().manual_seed(3))
    ref = tiny_model(ids.view(2, 5))[:, -1]  # the plain causal path of LlamaModel.forward
    torch.testing.assert_close(step(), ref, atol=1e-4, rtol=1e-4)


def test_decode_step_writes_its_token_and_returns_one_row_per_sequence(tiny_model):
    step = forward.forward_step(tiny_model, cost.decode(3, 7))
    first, again = step(), step()
    assert first.shape == (3, tiny_model.config.vocab_size) and torch.isfinite(first).all()
    torch.testing.assert_close(first, again, msg="a step on fixed tensors must be repeatable "
                               "(graph replay depends on it)")


def test_a_step_can_run_the_fused_layer_ops_without_changing_the_model(tiny_model, monkeypatch):
    from labkit.engine.model import FusedOps
    calls = []
    kernel = FusedOps.add_rms_norm
    monkeypatch.setattr(FusedOps, "add_rms_norm",
                        staticmethod(lambda *a: calls.append(1) or kernel(*a)))
    plain = forward.forward_step(tiny_model, cost.decode(2, 6), seed=1)()
    assert not calls, "the model's own choice is plain ops"
    fused = forward.forward_step(tiny_model, cost.decode(2, 6), seed=1, fused_ops=True)()
    assert calls, "fused_ops=True ran the fused kernels"
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    assert tiny_model.fused_ops is False, "the choice is the call's, not flipped on the model"


def test_measure_returns_a_point_per_shape_with_consistent_rates(tiny_model):
    points = forward.time_forwards(tiny_model, [cost.prefill(8), cost.decode(2, 8)], repeats=3)
    assert list(points["shape"]) == ["prefill S=8", "decode B=2 ctx 8"]
    assert (points.ms > 0).all() and (points["mode"] == "eager").all()
    assert points.tflops.values == pytest.approx((points.flops / (points.ms * 1e-3) / 1e12).values)
    assert (points.ms_low <= points.ms).all() and (points.ms <= points.ms_high).all()
    assert (points.rounds == 3).all(), "each shape's cases timed in interleaved rounds"
    assert (points.floor_low <= points.floor_ms).all() and (points.floor_ms > 0).all(), (
        "the op-issue floor is timed in the same rounds as each shape")


def test_graph_mode_on_cpu_says_what_to_compare_instead(tiny_model):
    with pytest.raises(ValueError, match="op_issue_floor"):
        forward.time_forward(tiny_model, cost.decode(1, 4), "graph")
    with pytest.raises(ValueError, match="eager"):
        forward.time_forward(tiny_model, cost.decode(1, 4), "turbo")


def test_op_issue_floor_is_a_positive_time(tiny_model):
    floor = forward.op_issue_floor(tiny_model, "decode", repeats=3)
    assert 0 < floor < 1000, f"issuing one tiny step's ops took {floor} ms"
    with pytest.raises(ValueError, match="kind"):
        forward.op_issue_floor(tiny_model, "verify")


def _points(rows):
    return pd.DataFrame(rows, columns=["shape", "kind", "flops_per_byte", "mode", "ms"])


def test_graph_gain_divides_eager_by_replay():
    gain = bounds.graph_gain(_points([("d", "decode", 1.0, "eager", 6.0),
                                      ("d", "decode", 1.0, "graph", 2.0),
                                      ("p", "prefill", 900.0, "eager", 10.0),
                                      ("p", "prefill", 900.0, "graph", 10.0)]))
    assert list(gain.speedup) == [3.0, 1.0]


def test_overhead_share_is_the_floor_over_the_step_and_is_never_clipped():
    points = _points([("d", "decode", 1.0, "eager", 0.5),
                      ("p", "prefill", 900.0, "eager", 20.0)]).assign(floor_ms=1.0)
    table = bounds.overhead_table(points)
    assert list(table.floor_share) == [2.0, 0.05], "a floor above its step is shown, not hidden"
    assert list(table.floor_over_step) == [True, False]


def test_with_replays_an_eager_step_is_bounded_by_the_larger_of_host_and_gpu():
    points = _points([("d", "decode", 1.0, "eager", 12.0), ("d", "decode", 1.0, "graph", 2.0),
                      ("p", "prefill", 900.0, "eager", 25.0),
                      ("p", "prefill", 900.0, "graph", 24.0)]).assign(floor_ms=11.0)
    table = bounds.overhead_table(points).set_index("shape")
    assert table.model_ms.tolist() == [11.0, 24.0], "max(floor, GPU time), not their sum"
    assert table.bound.tolist() == ["host", "GPU"]
    assert table.model_error["d"] == pytest.approx(12 / 11 - 1)
    fig = figures.bound_figure(table.reset_index(), "t")
    assert [t.name for t in fig.data] == ["eager step", "host issue floor", "GPU time (replay)"]
    assert list(fig.data[0].y) == [12.0, 25.0] and list(fig.data[2].y) == [2.0, 24.0]


# ----------------------------------------------------------------------------- the engine
def _engine(model, **kwargs):
    return LLM(model, enable_prefix_caching=False, max_num_seqs=4, **kwargs)


def test_latency_sweep_measures_every_case(tiny_model):
    df = latency.latency_sweep(_engine(tiny_model), [(1, 8), (3, 8)], max_tokens=4)
    assert list(df.batch) == [1, 3]
    assert (df.ttft_ms > 0).all() and (df.tpot_ms > 0).all()
    assert (df.ttft_max_ms >= df.ttft_ms).all()
    assert (df.triton_compiles == 0).all(), "the interpreter compiles nothing"


def test_the_latency_sweep_rehearses_each_case_whole(tiny_model):
    # A rehearsal with fewer tokens out never reaches the timed run's decode batches, and a
    # GPU then compiles their kernel variants inside the clock (an H200 recording did).
    llm = _engine(tiny_model, max_num_batched_tokens=16)
    ends = []
    generate = llm.generate

    def counted(*args, **kwargs):
        out = generate(*args, **kwargs)
        ends.append(len(llm.step_history))
        return out

    llm.generate = counted
    df = latency.latency_sweep(llm, [(3, 12)], max_tokens=5, rounds=1)
    cols = ["num_prefill_tokens", "num_decode_tokens"]
    history = llm.history_table()[cols]
    rehearsal, timed = history.iloc[ends[-3]:ends[-2]], history.iloc[ends[-2]:ends[-1]]
    assert timed.num_decode_tokens.max() == 3, "the timed run decodes all three together"
    pd.testing.assert_frame_equal(rehearsal.reset_index(drop=True), timed.reset_index(drop=True))
    assert df.compiled.tolist() == [""], "the interpreter compiles nothing"


def test_latency_sweep_refuses_an_empty_case(tiny_model):
    with pytest.raises(ValueError, match="batch and prompt_len"):
        latency.latency_sweep(_engine(tiny_model), [(0, 8)])


@pytest.fixture(scope="module")
def two_runs(tiny_model):
    return cp.interference_pair(tiny_model, num_running=2, running_tokens=10, long_prompt=60,
                                chunk_budget=16, arrive_after=3)


def test_the_pair_in_rounds_keeps_every_rounds_figures_and_the_median_run(tiny_model):
    on, off = cp.interference_pair(tiny_model, num_running=2, running_tokens=10, long_prompt=60,
                                   chunk_budget=16, arrive_after=3, rounds=3)
    for run in (on, off):
        ttfts = run.per_round("long_ttft_ms")
        assert len(ttfts) == 3 and run.long_ttft_ms == sorted(ttfts)[1], "the median round's run"
    again = cp.Interference.from_dict(on.to_dict())
    assert again.round_figures == on.round_figures
    with pytest.raises(ValueError, match="rounds must be 1 or at least 3"):
        cp.interference_pair(tiny_model, rounds=2)


def test_modes_run_a_pair_per_mode_in_the_same_rounds(tiny_model):
    runs = cp.interference_modes(tiny_model, modes=("none", "piecewise"), num_running=2,
                                 running_tokens=10, long_prompt=60, chunk_budget=16,
                                 arrive_after=3, rounds=3)
    assert [(r.cudagraph_mode, r.chunked) for r in runs] == [
        ("none", True), ("none", False), ("piecewise", True), ("piecewise", False)]
    chunked = runs[2]
    assert chunked.steps.graph[chunked.mixed].eq("piecewise").all(), "mixed steps replayed"
    assert (runs[0].steps.graph == "eager").all()
    assert all(len(r.per_round("mixed_step_ms")) == 3 for r in runs)
    assert "piecewise" in chunked.label and "piecewise" in set(cp.summary_table(runs).cudagraph_mode)
    again = cp.Interference.from_dict(chunked.to_dict())
    assert again.cudagraph_mode == "piecewise" and again.round_figures == chunked.round_figures
    with pytest.raises(ValueError, match="modes must name"):
        cp.interference_modes(tiny_model, modes=())


def test_the_pair_runs_chunked_then_whole_each_step_synchronised(two_runs):
    on, off = two_runs
    assert (on.chunked, on.budget) == (True, 16)
    assert (off.chunked, off.budget) == (False, 60 + 2), "room for the prompt beside the decodes"
    assert not on.async_scheduling and not off.async_scheduling


def test_the_untimed_rehearsal_runs_the_same_step_shapes_as_the_timed_run(tiny_model):
    # The rehearsal exists so that every kernel variant the timed run needs is compiled
    # before the clock: it is only worth that if its steps have the timed run's shapes.
    llm = _engine(tiny_model, max_num_batched_tokens=16)
    run = cp.interference_run(llm, num_running=2, running_tokens=10, long_prompt_len=60,
                              arrive_after_steps=3)
    history = llm.history_table()
    cols = ["num_prefill_tokens", "num_decode_tokens"]
    timed = run.steps[cols].reset_index(drop=True)
    rehearsal = history.iloc[len(history) - 2 * len(timed):len(history) - len(timed)][cols]
    pd.testing.assert_frame_equal(rehearsal.reset_index(drop=True), timed)
    assert run.triton_compiles == 0, "the interpreter compiles nothing"
    again = cp.Interference.from_dict(json.loads(json.dumps(run.to_dict())))
    assert again.triton_compiles == 0 and len(again.steps) == len(run.steps)


def test_without_chunking_one_step_holds_the_whole_prompt(two_runs):
    _, off = two_runs
    assert off.steps.num_prefill_tokens.max() == 60
    stall = off.steps[off.steps.num_prefill_tokens == 60]
    assert (stall.num_decode_tokens == 2).all(), "the running requests' decodes share that step"


def test_with_chunking_no_step_passes_the_budget_and_steps_mix(two_runs):
    on, _ = two_runs
    assert (on.steps.num_prefill_tokens + on.steps.num_decode_tokens).max() <= 16
    mixed = (on.steps.num_prefill_tokens > 0) & (on.steps.num_decode_tokens > 0)
    assert mixed.sum() >= 3, "60 prompt tokens, at most 14 a step beside 2 decodes: 5 chunks"


def test_gaps_cover_every_token_of_every_running_request(two_runs):
    for run in two_runs:
        assert len(run.gaps) == 2 * 9, "10 tokens each, so 9 gaps each"
        assert (run.gaps.gap_ms > 0).all() and run.long_ttft_ms > 0
        assert not math.isnan(run.prefill_gap_ms)


def test_an_interference_run_survives_a_json_round_trip(two_runs):
    on, _ = two_runs
    back = cp.Interference.from_dict(json.loads(json.dumps(on.to_dict(), allow_nan=False)))
    assert back.worst_gap_ms == pytest.approx(on.worst_gap_ms)
    assert list(back.steps.num_prefill_tokens) == list(on.steps.num_prefill_tokens)


def test_an_arrival_too_late_to_show_a_stall_is_refused(tiny_model):
    with pytest.raises(ValueError, match="arrive_after_steps"):
        cp.interference_run(_engine(tiny_model), running_tokens=6, arrive_after_steps=5)


def test_interference_needs_an_idle_engine(tiny_model):
    llm = _engine(tiny_model)
    llm.add_request([1, 2, 3])
    with pytest.raises(RuntimeError, match="idle"):
        cp.interference_run(llm)


def test_figures_draw_from_the_runs(two_runs):
    assert len(cp.gaps_figure(two_runs, "t").data) == 2
    assert len(cp.composition_figure(two_runs, "t").data) == 6


def is_int(col) -> bool:
    return pd.api.types.is_integer_dtype(col)


def test_the_run_tables_count_in_integers(two_runs):
    on, off = two_runs
    steps = cp.step_table(on)
    assert all(is_int(steps[c]) for c in cp.STEP_COUNTS), steps.dtypes
    assert steps.graph_batch.isna().all(), "a CPU engine replays no graph: <NA>, not NaN"
    assert (steps.step_ms == on.step_ms).all()
    uncounted = dataclasses.replace(off, triton_compiles=None)
    summary = cp.summary_table([on, uncounted])
    for col in ("token budget", "steps", "mixed steps", "Triton compiles in the run"):
        assert is_int(summary[col]), (col, summary[col].dtype)
    assert pd.isna(summary["Triton compiles in the run"].iloc[1])
    shown = summary.round(2).to_html() + steps.round(2).to_string()
    assert ".000000" not in shown and f">{on.budget}<" in shown


def test_the_kernel_census_counts_in_integers():
    gpu = {"kernel_count": 688.0, "launches": 704, "mean_kernel_us": 2.499,
           "gpu_busy_fraction": 0.121, "events": 3851}
    cpu = {"top_level_ops": 138, "mean_op_us": 33.0, "cpu_busy_fraction": 0.79}
    table = bounds.kernel_table({"decode (GPU)": gpu, "decode (CPU)": cpu})
    assert list(table.columns) == ["kernels", "launches", "mean kernel (us)", "GPU busy",
                                   "op calls", "mean op (us)", "CPU busy"]
    assert is_int(table.kernels) and is_int(table["op calls"]) and is_int(table.launches)
    assert table.kernels.iloc[0] == 688 and pd.isna(table.kernels.iloc[1])
    shown = table.round(3).to_html() + repr(table.round(3))
    assert "688" in shown and "688.0" not in shown


def test_knee_and_bandwidth_tables_keep_batches_as_integers():
    knees = cost.knee_table([0, 4096], {"bench_1b": (ModelConfig.bench_1b(), 190.0)})
    first, last = knees["bench_1b"]
    assert type(first) is int and last == "never" and is_int(knees.context)
    points = pd.DataFrame({"shape": ["d1", "d8", "p"], "kind": ["decode", "decode", "prefill"],
                           "mode": "graph", "batch": [1.0, 8.0, 1.0], "ms": [2.0, 4.0, 9.0],
                           "bytes": [1e6, 2e6, 3e6], "gbps": [0.5, 0.5, 0.33]})
    floor = bounds.bandwidth_floor(points, copy_gbps=1.0)
    assert floor["shape"].tolist() == ["d1", "d8"] and is_int(floor.batch)
    assert floor["bandwidth floor (ms)"].tolist() == [1.0, 2.0], "bytes over the copy rate"
