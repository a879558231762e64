"""The controlled experiment (labkit.lessons.putting_it_together.experiment), the engine's steps
on a timeline (engine_steps) and their padding to graph buckets (padding): the table's shape,
refusals as rows, counts as integers, padding counted as the scheduler counts it, and record()
on tiny sizes."""
import json
import math

import pandas as pd
import pytest
import torch

import labkit  # noqa: F401  (interpreter on before triton is imported, where there is no GPU)
from labkit.attention import BACKENDS
from labkit.engine import LLM, ModelConfig, random_model
from labkit.lessons.putting_it_together import engine_steps as steps
from labkit.lessons.putting_it_together import experiment as ex
from labkit.lessons.putting_it_together import padding
from labkit.measure.profile import EVENT_COLUMNS, Trace

CPU = torch.device("cpu")
SMALL = ex.Workload(num_requests=5, prompt_len=(3, 20), output_len=(2, 9), seed=3)


@pytest.fixture(scope="module")
def tiny_model():
    return random_model(ModelConfig.tiny(), seed=0, device=CPU)


@pytest.fixture(scope="module")
def cpu_experiment(tiny_model):
    return ex.run_experiment(tiny_model, SMALL, skip=ex.slow_here(CPU), repeats=1)


def test_the_table_has_every_backend_and_auto_in_both_modes(cpu_experiment):
    t = cpu_experiment.table
    assert list(t.columns) == ex.COLUMNS
    assert sorted(zip(t.backend, t["mode"])) == sorted(
        (b, m) for b in [*BACKENDS, "auto"] for m in ex.MODES), \
        "every backend and auto, eager and graph, one row each: none dropped"


def test_the_tables_counts_are_integers_with_na_where_a_row_did_not_run(cpu_experiment):
    t = cpu_experiment.table
    for col in ex.COUNTS:
        assert str(t[col].dtype) == "Int64", f"{col} is a count, got {t[col].dtype}"
    shown = ex.compact(t)
    assert all(str(shown[c].dtype) == "Int64" for c in ("rounds", "steps", "graph_steps",
                                                         "padded_rows", "first_token_ties"))
    ran = shown[shown.status == "ran"]
    assert f" {int(ran.steps.iloc[0])} " in ran.to_string() and ".0 " not in \
        ran[["steps", "graph_steps", "padded_rows"]].to_string(), "45, never 45.0"
    assert t[t.status != "ran"].steps.isna().all(), "a row that did not run counts nothing"
    back = ex.Experiment.from_dict(json.loads(json.dumps(cpu_experiment.to_dict())))
    assert str(back.table.steps.dtype) == "Int64" and back.table.steps.equals(t.steps), \
        "a recording read back (JSON floats) shows its counts as integers too"
    with pytest.raises((TypeError, ValueError)):
        ex.with_counts(t.assign(steps=t.steps.astype(float) + 0.5))  # a count that is not whole


def test_padding_tables_count_in_integers():
    costs = padding.bucket_costs([3, 5, 5, 2], {"a": (2, 8), "b": (8,)},
                                 pd.DataFrame({"batch": [1, 8], "eager_ms": [9.0, 9.0],
                                               "graph_ms": [1.0, 1.5]}))
    assert all(costs[c].dtype == "int64" for c in padding.COUNTS), costs.dtypes
    per_step = padding.step_padding([3, 5, 9], (2, 8))
    assert per_step.to_dict("list") == {"batch": [3, 5], "bucket": [8, 8], "padded": [5, 3]}, \
        "a batch above every bucket runs eagerly: no row"
    assert all(per_step[c].dtype == "int64" for c in per_step)


def test_a_row_that_did_not_run_says_why(cpu_experiment):
    t = cpu_experiment.table
    not_run = t[t.status != "ran"]
    assert len(not_run) and (not_run.reason.str.len() > 20).all(), not_run[["backend", "mode",
                                                                            "reason"]]
    graph = t[t["mode"] == "graph"]
    assert (graph.status == "cannot run").all() and graph.reason.str.contains("CUDA").all(), \
        "without CUDA every graph row is 'cannot run', with the reason"


def test_rows_that_ran_report_one_time_and_steady_costs(cpu_experiment):
    ran = cpu_experiment.table[cpu_experiment.table.status == "ran"]
    assert set(ran.backend) == {"sdpa", "reference", "auto"}
    for col in ("build_s", "first_run_s", "steady_run_s", "decode_step_ms", "tpot_ms",
                "output_tok_s"):
        assert (ran[col] > 0).all(), f"{col} must be measured for every row that ran"
    assert (ran.same_first_token == 1.0).all(), "float32 backends must agree with the reference"
    assert (ran.graph_steps == 0).all() and (ran.graph_MiB == 0).all(), "no graphs on CPU"


def test_auto_row_names_the_backend_its_selection_log_chose(cpu_experiment):
    t = cpu_experiment.table.set_index(["backend", "mode"])
    chosen = t.loc[("auto", "eager"), "chosen"]
    log = cpu_experiment.selection_logs["auto/eager"]
    assert chosen == "sdpa" and log[0].startswith(f"attention backend '{chosen}'") \
        and "(auto)" in log[0], log
    assert t.loc[("auto", "eager"), "warm_start"], "sdpa ran in an earlier row"


def test_a_backend_that_cannot_serve_the_model_is_a_refused_row_with_the_reason():
    # head_dim 18: triton and flex take powers of two, sdpa multiples of 8; reference any.
    model = random_model(ModelConfig.tiny(hidden_size=72), seed=0, device=CPU)
    e = ex.run_experiment(model, SMALL, modes=("eager",), repeats=1)
    t = e.table.set_index("backend")
    for name in ("triton", "flex", "sdpa"):
        assert t.loc[name, "status"] == "refused" and "head_dim 18" in t.loc[name, "reason"], \
            (name, t.loc[name, "reason"])
    assert t.loc["reference", "status"] == "ran"
    assert t.loc["auto", "chosen"] == "reference", "auto falls to the one backend that fits"


def test_unknown_backends_and_modes_are_refused_up_front(tiny_model):
    with pytest.raises(ValueError, match="unknown backends"):
        ex.run_experiment(tiny_model, SMALL, backends=["flash"])
    with pytest.raises(ValueError, match="mode must be one of"):
        ex.run_one(tiny_model, SMALL, "sdpa", "compiled")


def test_a_backend_that_raises_mid_run_is_a_failed_row_with_the_error(tiny_model, monkeypatch):
    def broken(self, *args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(LLM, "generate", broken)
    row, _log, tokens = ex.run_one(tiny_model, SMALL, "sdpa", "eager")
    assert (row["status"], row["chosen"], tokens) == ("failed", "sdpa", None)
    assert row["reason"] == "RuntimeError: kernel exploded"


def test_workload_lengths_do_not_depend_on_the_vocabulary():
    # 08a plans the schedule without a model; on a GPU the engine ran bench_1b's vocabulary,
    # and drawing token ids from the lengths' stream gave it other lengths than the plan's.
    small, large = SMALL.requests(256), SMALL.requests(128_256)
    assert [len(p) for p in small[0]] == [len(p) for p in large[0]] == SMALL.lengths()[0]
    assert [p.max_tokens for p in small[1]] == [p.max_tokens for p in large[1]] == \
        SMALL.lengths()[1]
    assert small[0] != large[0], "the token ids do follow the vocabulary"


def test_workload_is_reproducible_and_validates_its_ranges():
    a, b = SMALL.requests(256), SMALL.requests(256)
    assert a == b, "one seed, the same prompts and output lengths"
    prompts, params = a
    assert all(3 <= len(p) <= 20 for p in prompts)
    assert all(2 <= p.max_tokens <= 9 and p.greedy and not p.stop_token_ids for p in params)
    with pytest.raises(ValueError, match="prompt_len"):
        ex.Workload(prompt_len=(10, 5))
    with pytest.raises(ValueError, match="num_requests"):
        ex.Workload(num_requests=0)


def test_the_simulated_schedule_is_the_engines_schedule(tiny_model):
    llm = LLM(tiny_model, backend="sdpa", **ex.engine_options(SMALL))
    llm.generate(*SMALL.requests(tiny_model.config.vocab_size))
    engine = llm.history_table()
    sim = padding.simulate_schedule(SMALL)
    cols = ["num_prefill_tokens", "num_decode_seqs", "num_prefill_seqs"]
    assert engine[cols].equals(sim[cols]), "the scheduler alone must plan the engine's steps"


def test_padded_rows_counted_from_decode_batches_equal_the_schedulers():
    w = ex.Workload(num_requests=12, prompt_len=(4, 40), output_len=(2, 30), seed=5)
    seen = padding.decode_batches(padding.simulate_schedule(w))
    costs = padding.bucket_costs(seen, padding.bucket_sets(seen)).set_index("buckets")
    for name, buckets in padding.bucket_sets(seen).items():
        reported = padding.simulate_schedule(w, buckets).padded_rows.sum()
        assert costs.loc[name, "padded_rows"] == reported, (name, buckets)
    assert costs.loc["one per size", "padded_rows"] == 0
    assert 0 < costs.loc["powers of two", "padded_rows"] < costs.loc["max only", "padded_rows"]


def test_vllm_sizes_are_1_2_4_then_every_8_to_256_then_every_16_cut_at_the_largest_batch():
    assert padding.vllm_sizes(3) == (1, 2, 4)
    assert padding.vllm_sizes(20) == (1, 2, 4, 8, 16, 24)
    sizes = padding.vllm_sizes(300)
    assert sizes[-3:] == (272, 288, 304) and 248 in sizes and 252 not in sizes
    assert set(padding.bucket_sets([1, 7, 20])) >= {"vLLM default sizes", "powers of two"}


def test_bucket_costs_price_padding_and_gain_from_step_times():
    times = pd.DataFrame({"batch": [1, 8], "eager_ms": [10.0, 10.0], "graph_ms": [1.0, 1.7]})
    costs = padding.bucket_costs([3], {"exact": (3,), "padded": (8,)}, times).set_index("buckets")
    # graph time interpolates 1.0 + 0.1 per row: batch 3 -> 1.2 ms, padded to 8 -> 1.7 ms
    assert costs.loc["exact", "padding_ms"] == pytest.approx(0.0)
    assert costs.loc["padded", "padded_rows"] == 5
    assert costs.loc["padded", "padding_ms"] == pytest.approx(0.5)
    assert costs.loc["padded", "gain_ms"] == pytest.approx(10.0 - 1.7)
    assert costs.loc["padded", "gain_eaten"] == pytest.approx(0.5 / (0.5 + 8.3))
    assert costs.loc["padded", "padding_share"] == pytest.approx(0.5 / 1.2), \
        "padding against the same step replayed at its exact size, whatever eager costs"


def _events(rows):
    return pd.DataFrame(rows, columns=EVENT_COLUMNS)


def test_step_overlap_counts_metadata_copies_under_compute_and_graph_launches():
    ev = _events([
        ("CPU thread 1", "annotation", "engine step 0", 0, 100, 0, -1),
        ("CPU thread 1", "annotation", "engine step 1", 100, 100, 0, -1),
        ("CPU thread 1", "runtime", "cudaGraphLaunch", 120, 5, 1, 7),
        ("GPU 0 stream 7", "kernel", "gemm", 10, 50, 0, 3),
        ("GPU 0 stream 7", "kernel", "attn", 130, 60, 0, 7),
        ("GPU 0 stream 9", "memcpy", "Memcpy HtoD (Pinned -> Device)", 40, 10, 0, 4),   # under gemm
        ("GPU 0 stream 9", "memcpy", "Memcpy HtoD (Pinned -> Device)", 95, 4, 0, 5),    # idle GPU
        ("GPU 0 stream 7", "memcpy", "Memcpy DtoH (Device -> Pinned)", 191, 2, 0, 8),
    ])
    n = steps.step_overlap(ev)
    assert n["steps"] == 2 and n["graph_launches"] == 1
    assert n["compute_lane"] == "GPU 0 stream 7"
    assert (n["h2d_copies"], n["h2d_on_copy_stream"], n["h2d_overlapping_compute"]) == (2, 2, 1)
    assert n["h2d_overlapped_us"] == pytest.approx(10.0)


def test_a_cpu_trace_has_one_annotation_per_engine_step(tiny_model):
    w = ex.Workload(num_requests=2, prompt_len=(4, 8), output_len=(3, 3), seed=1)
    llm = LLM(tiny_model, **ex.engine_options(w))
    t = steps.trace_engine(llm, *w.requests(tiny_model.config.vocab_size))
    n = steps.step_overlap(t.events)
    assert n["steps"] == 3 == len(llm.step_history) // 4, \
        "one prefill and two decode steps, annotated in the kept run (trace runs fn 4 times)"
    numbers = steps.timeline_numbers(t)
    assert numbers["top_level_ops"] > 0 and 0 < numbers["cpu_busy_fraction"] < 1, \
        "with the step annotations unwrapped, the model's ops are the top-level ops"


def test_decode_step_times_on_cpu_time_eager_only(tiny_model):
    llm = LLM(tiny_model, enforce_eager=True, num_blocks=4, max_num_seqs=4, max_model_len=48)
    times = padding.decode_step_times(llm, [1, 3], context_len=40, repeats=2)
    assert list(times.batch) == [1, 3] and (times.eager_ms > 0).all()
    assert (times.eager_low_ms <= times.eager_ms).all() and (times.eager_ms <= times.eager_high_ms).all()
    assert all(len(r) == 3 for r in times.eager_rounds_ms), "three interleaved rounds per case"
    assert times.graph_ms.isna().all(), "no graphs without CUDA"
    with pytest.raises(ValueError, match="context_len 80 needs 5 blocks"):
        padding.decode_step_times(llm, [1], context_len=80)


def test_record_with_tiny_sizes_on_cpu_is_json_and_round_trips():
    out = ex.record(ModelConfig.tiny(), SMALL, skip=ex.slow_here(CPU), repeats=1, device="cpu",
                    timeline=ex.Workload(2, (4, 8), (2, 2), seed=1),
                    server=ex.Workload(16, (4, 16), (2, 12), seed=2), batches=(1, 2, 4),
                    context_len=32)
    text = json.dumps(out, allow_nan=False)  # NaN must not reach the recording
    back = json.loads(text)
    assert {"table", "selection_logs", "model", "workload", "rounds", "trace", "trace_numbers",
            "step_times", "bucket_costs", "server_decode_batches", "seconds"} <= set(back)
    e = ex.Experiment.from_dict(back)
    assert len(e.table) == 2 * (len(BACKENDS) + 1) and list(e.table.columns) == ex.COLUMNS
    assert Trace.from_dict(back["trace"]).events.shape[0] > 0
    assert back["trace_numbers"]["steps"] == 2
    assert pd.DataFrame(back["step_times"]).batch.tolist() == [1, 2, 4]
    assert set(pd.DataFrame(back["bucket_costs"]).buckets) >= {"powers of two", "max only"}


def test_figures_draw_from_a_table_and_from_costs(cpu_experiment):
    fig = ex.experiment_figure(cpu_experiment.table, "t")
    assert len(fig.data) == 2 and len(fig.data[0].x) == len(cpu_experiment.table)
    costs = padding.bucket_costs([1, 3, 3], {"a": (1, 4), "b": (4,)})
    assert len(padding.bucket_figure(costs, "t").data) == 1
    shown = ex.compact(cpu_experiment.table)
    assert "reason" in shown and len(shown) == len(cpu_experiment.table)


# ------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_graph_rows_pad_as_the_scheduler_reports_and_refusals_say_why():
    w = ex.Workload(num_requests=8, prompt_len=(8, 64), output_len=(2, 24), seed=5)
    assert padding.simulate_schedule(w, (1, 2, 4, 8)).padded_rows.sum() > 0, "workload must pad"
    model = random_model(ModelConfig.tiny(), seed=0, device=torch.device("cuda"),
                         dtype=torch.float16)
    t = ex.run_experiment(model, w, backends=["triton", "sdpa", "reference", "auto"],
                          repeats=1).table.set_index(["backend", "mode"])
    graph = t.loc[("triton", "graph")]
    assert graph.status == "ran" and graph.graph_steps > 0 and graph.capture_ms > 0
    assert graph.padded_rows == graph.pool_padded_rows > 0, \
        "rows the scheduler says it pads are the rows the graph pool padded"
    for name in ("sdpa", "reference"):  # flex too, but it compiles per shape: minutes
        assert t.loc[(name, "graph"), "status"] == "refused"
        assert "graph" in t.loc[(name, "graph"), "reason"]
    assert t.loc[("auto", "graph"), "chosen"] == "triton"


@pytest.mark.gpu
def test_gpu_record_with_tiny_sizes_shows_copies_and_graph_replays():
    out = ex.record(ModelConfig.tiny(), ex.Workload(4, (8, 32), (2, 8)), repeats=1, device="cuda",
                    skip={"flex": "not in this test: compiles per shape"},
                    batches=(1, 2, 4, 8), context_len=64,
                    server=ex.Workload(32, (4, 32), (2, 24), seed=2))
    json.dumps(out, allow_nan=False)
    n = out["trace_numbers"]
    assert n["graph_launches"] > 0 and n["h2d_on_copy_stream"] > 0, n
    times = pd.DataFrame(out["step_times"])
    assert times.graph_ms.notna().all() and not math.isnan(times.eager_ms.sum())
    assert (times.eager_gpu_ms < times.eager_ms).all(), "the eager step's kernels beside its wall time"
    assert (times.eager_kernels > 0).all()
    assert (times.host_us_per_kernel * times.eager_kernels / 1e3 - times.eager_ms).abs().max() < 1e-6
    assert {"rounds", "first_token_tie_max"} <= set(out) and len(out["rounds"]["round"]) > 0
