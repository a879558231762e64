"""The tensor-parallel MLP: shards, serial and overlapped all-reduce, the runner, the metrics.

Float32 throughout on the CPU. Tolerances: the sharded layer sums its partials in a different
order than one full matmul, so outputs match the single-device reference to atol 1e-5 and
rtol 1e-5 (values are of order one); chunking the tokens changes no sum, so overlapped and
serial match to atol 1e-6. Processes: gloo on the CPU, 2 ranks, spawned by labkit.distributed.rank_runner.
"""
import json

import pytest
import torch

import labkit  # noqa: F401  (device set-up first)
from labkit.distributed import tensor_parallel as tp
from labkit.distributed.rank_runner import pick_backend, run_ranks
from labkit.lessons import multi_gpu_overlap as mgo
from labkit.lessons.multi_gpu_overlap import TPResult

REF_TOL = {"atol": 1e-5, "rtol": 1e-5}
CHUNK_TOL = {"atol": 1e-6, "rtol": 0}
# 13 tokens: 2 and 5 chunks are uneven, 13 chunks is one token each, 1 chunk is the serial split.
TOKENS, HIDDEN, FFN, CHUNKS = 13, 24, 40, (1, 2, 5, 13)


def _outputs_rank(ctx, tokens, hidden, ffn, chunk_counts, dtype="float32"):
    """Runs on each rank: the serial and overlapped outputs and the single-device reference."""
    cfg = tp.TPConfig(hidden, ffn, ctx.world_size, seed=3)
    w1, w2 = tp.full_weights(cfg)
    layer = tp.TensorParallelMLP(cfg, ctx.rank, device=ctx.device, dtype=tp.DTYPES[dtype])
    x = tp.make_input(tokens, hidden, seed=4, dtype=tp.DTYPES[dtype], device=ctx.device)
    out = {"reference": tp.mlp_reference(x.float().cpu(), w1, w2),
           "serial": layer.forward_serial(x)}
    for k in chunk_counts:
        out[k] = layer.forward_overlapped(x, k)
    return {key: t.float().cpu() for key, t in out.items()}


def _fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("boom on purpose")
    return "fine"


@pytest.fixture(scope="module")
def gloo_outputs():
    return run_ranks(_outputs_rank, TOKENS, HIDDEN, FFN, CHUNKS, world_size=2, backend="gloo")


@pytest.fixture(scope="module")
def gloo_experiment():
    exp = mgo.TPExperiment(tokens=64, hidden=32, ffn=64, chunk_counts=(1, 3), trace_chunks=3,
                          warmup=0, repeats=2)
    return mgo.run_experiment(exp, world_size=2, backend="gloo")


# --- the layer in one process -----------------------------------------------------------------

def test_the_shards_partial_sums_add_up_to_the_single_device_reference():
    # hidden=5 is not a multiple of world_size=2 on purpose: only ffn is split between ranks.
    cfg = tp.TPConfig(hidden=5, ffn=6, world_size=2)
    w1, w2 = tp.full_weights(cfg)
    x = torch.randn(7, 5)
    total = sum(tp.TensorParallelMLP(cfg, r).partial(x) for r in range(2))
    torch.testing.assert_close(total, tp.mlp_reference(x, w1, w2), **REF_TOL,
                               msg="each rank's gelu(x @ W1[:, s]) @ W2[s, :] must sum to y")


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 7])
def test_one_rank_overlapped_equals_the_reference_for_any_chunking(num_chunks):
    cfg = tp.TPConfig(hidden=8, ffn=12, world_size=1)
    w1, w2 = tp.full_weights(cfg)
    x = torch.randn(7, 8)
    y = tp.TensorParallelMLP(cfg, 0).forward_overlapped(x, num_chunks)
    torch.testing.assert_close(y, tp.mlp_reference(x, w1, w2), **REF_TOL,
                               msg=f"{num_chunks} chunks of 7 tokens lost or repeated rows")


def test_no_tokens_gives_an_empty_output():
    layer = tp.TensorParallelMLP(tp.TPConfig(hidden=8, ffn=4, world_size=1), 0)
    assert layer.forward_overlapped(torch.zeros(0, 8), 3).shape == (0, 8)


def test_chunks_cover_every_token_once_and_differ_by_at_most_one():
    sizes = [s.stop - s.start for s in tp.token_chunks(13, 5)]
    assert sizes == [3, 3, 3, 2, 2]


def test_ffn_not_divisible_by_world_size_is_refused_with_sizes_that_work():
    with pytest.raises(ValueError, match=r"ffn=10 cannot be split evenly over world_size=4.*"
                                         r"ffn=8 or 12"):
        tp.TPConfig(hidden=16, ffn=10, world_size=4)


@pytest.mark.parametrize("num_chunks", [0, -2, 1.5])
def test_a_chunk_count_below_one_or_not_an_integer_is_refused(num_chunks):
    layer = tp.TensorParallelMLP(tp.TPConfig(hidden=8, ffn=4, world_size=1), 0)
    with pytest.raises(ValueError, match="num_chunks must be an integer >= 1"):
        layer.forward_overlapped(torch.zeros(4, 8), num_chunks)


def test_more_chunks_than_tokens_is_refused_with_the_limit():
    with pytest.raises(ValueError, match="cannot split 4 tokens into 8 chunks.*num_chunks <= 4"):
        tp.token_chunks(4, 8)


def test_input_of_the_wrong_width_or_dtype_is_refused():
    layer = tp.TensorParallelMLP(tp.TPConfig(hidden=8, ffn=4, world_size=1), 0)
    with pytest.raises(ValueError, match=r"x must be \[tokens, hidden=8\], got \(4, 6\)"):
        layer.forward_serial(torch.zeros(4, 6))
    with pytest.raises(ValueError, match="move x with .to"):
        layer.forward_serial(torch.zeros(4, 8, dtype=torch.float64))


def test_two_ranks_without_a_process_group_say_how_to_start_one():
    layer = tp.TensorParallelMLP(tp.TPConfig(hidden=8, ffn=4, world_size=2), 0)
    with pytest.raises(RuntimeError, match="needs a process group.*run_ranks"):
        layer.forward_serial(torch.zeros(2, 8))


def test_an_experiment_whose_chunks_the_tokens_cannot_fill_is_refused_before_spawning():
    with pytest.raises(ValueError, match="cannot split 4 tokens into 8 chunks"):
        mgo.TPExperiment(tokens=4, hidden=8, ffn=8, chunk_counts=(1, 8))


# --- the schedule, step by step (a recording stand-in for torch.distributed) ---------------

@pytest.fixture
def schedule_log(monkeypatch):
    """A rank of 2 whose collectives only write down what was asked of them, and when."""
    log = []

    class Work:
        def __init__(self, n):
            self.n = n

        def wait(self):
            log.append(f"wait {self.n}")

    def all_reduce(t, group=None, async_op=False):
        n = sum(e.startswith("all_reduce") for e in log)
        log.append(f"all_reduce {n} {'async' if async_op else 'sync'} {t.shape[0]} rows")
        return Work(n) if async_op else None

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    layer = tp.TensorParallelMLP(tp.TPConfig(hidden=8, ffn=4, world_size=2), 0)
    partial = layer.partial
    layer.partial = lambda x, out=None: (log.append(f"compute {x.shape[0]} rows"),
                                         partial(x, out))[1]
    return layer, log


def test_overlapped_launches_each_chunk_as_it_is_computed_and_waits_only_at_the_end(
        schedule_log):
    layer, log = schedule_log
    layer.forward_overlapped(torch.zeros(7, 8), 3)
    assert log == ["compute 3 rows", "all_reduce 0 async 3 rows",
                   "compute 2 rows", "all_reduce 1 async 2 rows",
                   "compute 2 rows", "all_reduce 2 async 2 rows",
                   "wait 0", "wait 1", "wait 2"], (
        "each chunk's all-reduce must be launched before the next chunk computes, and no "
        "handle waited on before the last launch")


def test_serial_computes_everything_then_all_reduces_once(schedule_log):
    layer, log = schedule_log
    layer.forward_serial(torch.zeros(7, 8))
    assert log == ["compute 7 rows", "all_reduce 0 sync 7 rows"]


def test_compute_only_timing_variant_launches_no_collective(schedule_log):
    layer, log = schedule_log
    layer.forward_overlapped(torch.zeros(7, 8), 3, communicate=False)
    assert log == ["compute 3 rows", "compute 2 rows", "compute 2 rows"]


# --- the arithmetic of overlap ------------------------------------------------------------

def test_efficiency_speedup_and_hidden_fraction_on_hand_made_numbers():
    m = mgo.overlap_metrics(serial_us=10.0, overlapped_us=8.0, compute_us=6.0, comm_us=4.0)
    assert m["ideal_us"] == 6.0, "the best overlap can do is the longer of the two"
    assert m["efficiency"] == pytest.approx(6 / 8)
    assert m["speedup"] == pytest.approx(10 / 8)
    assert m["hidden_fraction"] == pytest.approx((6 + 4 - 8) / 4), "2 of comm's 4 us were hidden"


def test_perfect_overlap_scores_one_and_none_scores_the_serial_ratio():
    perfect = mgo.overlap_metrics(serial_us=10.0, overlapped_us=6.0, compute_us=6.0, comm_us=4.0)
    none = mgo.overlap_metrics(serial_us=10.0, overlapped_us=10.0, compute_us=6.0, comm_us=4.0)
    assert (perfect["efficiency"], perfect["hidden_fraction"]) == (1.0, 1.0)
    assert (none["efficiency"], none["hidden_fraction"], none["speedup"]) == (0.6, 0.0, 1.0)


def test_the_pipeline_bound_leaves_one_chunk_of_the_shorter_side_exposed():
    # 4 chunks, compute 8 us, comm 4 us: chunk 1 computes (2 us) before anything is sent, then
    # compute and comm run side by side, and the last chunk's 1 us of comm runs alone: 8 + 1.
    m = mgo.overlap_metrics(serial_us=12.0, overlapped_us=10.0, compute_us=8.0, comm_us=4.0,
                           num_chunks=4)
    assert (m["ideal_us"], m["pipeline_us"]) == (8.0, 9.0)
    assert m["of_pipeline"] == pytest.approx(0.9)
    one = mgo.overlap_metrics(12.0, 12.0, 8.0, 4.0, num_chunks=1)
    assert one["pipeline_us"] == 12.0, "one chunk cannot overlap: its bound is the serial sum"
    with pytest.raises(ValueError, match="num_chunks must be an integer >= 1"):
        mgo.overlap_metrics(12.0, 10.0, 8.0, 4.0, num_chunks=0)


def test_times_that_are_not_positive_are_refused():
    with pytest.raises(ValueError, match="positive microseconds.*comm_us"):
        mgo.overlap_metrics(10.0, 8.0, 6.0, 0.0)


# --- what needs two GPUs says so -------------------------------------------------------------

def test_record_refuses_with_fewer_than_two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(RuntimeError, match="needs 2 GPUs.*this machine has 1"):
        mgo.record()


def test_nccl_without_a_gpu_per_rank_is_refused_with_the_alternative(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs one GPU per rank.*backend='gloo'"):
        pick_backend("nccl", world_size=2)
    assert pick_backend("auto", world_size=2) == "gloo"


# --- two processes over gloo ----------------------------------------------------------------

@pytest.mark.parametrize("num_chunks", CHUNKS)
def test_overlapped_output_equals_serial_on_every_rank(gloo_outputs, num_chunks):
    for rank, out in enumerate(gloo_outputs):
        torch.testing.assert_close(out[num_chunks], out["serial"], **CHUNK_TOL, msg=(
            f"rank {rank}: {num_chunks} chunks of {TOKENS} tokens differ from the serial step"))


def test_serial_output_equals_the_single_device_reference(gloo_outputs):
    for rank, out in enumerate(gloo_outputs):
        torch.testing.assert_close(out["serial"], out["reference"], **REF_TOL, msg=(
            f"rank {rank}: the all-reduced partial sums are not the full layer's output"))


def test_every_rank_ends_with_the_same_output(gloo_outputs):
    # With two ranks each sums the same two partials (a + b == b + a): bit-identical.
    assert torch.equal(gloo_outputs[0][2], gloo_outputs[1][2]), "the ranks disagree"


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)rank 1 of 2 failed.*boom on purpose"):
        run_ranks(_fail_on_rank_one, world_size=2, backend="gloo", timeout_s=60)


def test_experiment_outputs_match_the_reference_on_both_ranks(gloo_experiment):
    errors = gloo_experiment.errors
    assert list(errors.columns) == ["rank 0", "rank 1"]
    assert (errors < 1e-5).all().all(), f"relative errors too large:\n{errors}"


def test_experiment_table_has_a_row_per_chunk_count_with_its_metrics(gloo_experiment):
    table = gloo_experiment.table
    assert table.num_chunks.tolist() == [1, 3]
    assert {"serial_us", "overlapped_us", "compute_us", "comm_us", "efficiency",
            "speedup"} <= set(table.columns)
    assert (table[["serial_us", "overlapped_us", "compute_us", "comm_us"]] > 0).all().all()


def test_sweep_summary_reports_the_best_chunk_count_and_the_comm_stretch(gloo_experiment):
    from labkit.lessons.multi_gpu_overlap import sweep_summary

    row = sweep_summary([gloo_experiment, gloo_experiment]).iloc[1]
    table = gloo_experiment.table.set_index("num_chunks")
    assert row.best_chunks == 3, "one chunk overlaps nothing: the best is chosen among the others"
    best = table.loc[3]
    assert (row.speedup, row.speedup_low, row.speedup_high) == (
        best.speedup, best.speedup_low, best.speedup_high)
    assert row.of_pipeline == best.of_pipeline and row.ffn == 64
    one = table.loc[1]
    assert row.compute_over_comm == pytest.approx(one.compute_us / one.comm_us)
    serial, overlapped = (gloo_experiment.trace(m).summary for m in ("serial", "overlapped"))
    stretch = [overlapped[r]["comm_us"] / serial[r]["comm_us"] for r in ("rank 0", "rank 1")]
    assert row.comm_stretch == pytest.approx(sum(stretch) / 2)


def test_every_case_is_timed_once_per_round_in_the_same_shuffled_order_on_both_ranks(
        gloo_experiment):
    orders = [r["orders"] for r in gloo_experiment.ranks]
    assert orders[0] == orders[1], "the ranks must run each collective together"
    assert len(orders[0]) == gloo_experiment.experiment.rounds == 3
    cases = {"serial", "overlapped 1", "overlapped 3", "sequential 1", "sequential 3"}
    assert all(set(o) == cases and len(o) == len(cases) for o in orders[0])
    assert len({tuple(o) for o in orders[0]}) > 1, "every round the same order: not shuffled"
    for rank in gloo_experiment.ranks:
        assert all(len(v) == 3 for v in rank["rounds"].values()), rank["rounds"]


def test_the_sequential_steps_halves_add_up_to_its_step(gloo_experiment):
    # compute and comm are the two halves of one timed step (the medians of each half).
    for rank in gloo_experiment.ranks:
        for k in (1, 3):
            for step, c, m in zip(*(rank["rounds"][f"{w} {k}"]
                                    for w in ("sequential", "compute", "comm"))):
                assert 0 < c < step and 0 < m < step
                assert c + m == pytest.approx(step, rel=0.5)


def test_serial_trace_launches_its_all_reduce_after_the_last_matmul(gloo_experiment):
    s = gloo_experiment.trace("serial").summary
    for rank in (0, 1):
        assert s[f"rank {rank}"]["collectives"] == 1, s
        assert s[f"rank {rank}"]["launched_early"] == 0, s


def test_overlapped_trace_launches_all_but_the_last_all_reduce_before_the_last_matmul(
        gloo_experiment):
    s = gloo_experiment.trace("overlapped").summary
    for rank in (0, 1):
        assert s[f"rank {rank}"]["collectives"] == 3, f"3 chunks should give 3 all-reduces: {s}"
        assert s[f"rank {rank}"]["launched_early"] == 2, (
            f"chunks 1 and 2 must be reduced while later chunks compute: {s}")


def test_the_merged_timeline_names_each_ranks_lanes(gloo_experiment):
    lanes = set(gloo_experiment.trace("overlapped").events.lane)
    for rank in (0, 1):
        assert any(lane.startswith(f"CPU rank {rank}") and lane.endswith("comm")
                   for lane in lanes), f"no communication lane for rank {rank}: {lanes}"


def test_a_result_survives_a_json_round_trip(gloo_experiment):
    again = TPResult.from_dict(json.loads(json.dumps(gloo_experiment.to_dict())))
    assert again.experiment == gloo_experiment.experiment
    assert again.table.equals(gloo_experiment.table)


# --- NCCL, on a host with two GPUs --------------------------------------------------------

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL tensor parallelism needs 2 GPUs (one rank per GPU); run by `make gpu-check` "
           "on a 2-GPU host")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("dtype, atol", [("float32", 1e-4), ("bfloat16", 3e-2)])
def test_nccl_overlapped_equals_serial_and_the_reference(dtype, atol):
    # cuBLAS may pick other kernels for other chunk sizes: only equal within dtype precision.
    outs = run_ranks(_outputs_rank, 1000, 512, 1024, (1, 3, 7), dtype, world_size=2,
                     backend="nccl")
    for rank, out in enumerate(outs):
        for key in (1, 3, 7, "serial"):
            torch.testing.assert_close(out[key], out["reference"], atol=atol, rtol=atol,
                                       msg=f"rank {rank}, {key} ({dtype}) over NCCL")


@pytest.mark.gpu
@two_gpus
def test_nccl_timeline_shows_nccl_kernels_beside_the_matmuls():
    # Chunks of 2,048 tokens: each matmul long enough that the previous chunk's all-reduce
    # has one to run beside (at 1,024-token chunks of a 4,096-wide layer, H200 rank 0 once ran
    # all four all-reduces after its last matmul).
    exp = mgo.TPExperiment(tokens=8192, hidden=8192, ffn=8192, dtype="bfloat16",
                          chunk_counts=(1, 4), trace_chunks=4, warmup=2, repeats=5)
    s = mgo.run_experiment(exp, world_size=2, backend="nccl").trace("overlapped").summary
    for rank in (0, 1):
        assert s[f"rank {rank}"]["collectives"] == 4, f"expected 4 NCCL all-reduce kernels: {s}"
        assert s[f"rank {rank}"]["comm_hidden_fraction"] > 0, (
            f"no NCCL kernel ran beside a matmul on rank {rank}: nothing overlapped: {s}")


@pytest.mark.gpu
@two_gpus
def test_nccl_rounds_time_the_sequential_halves_inside_one_step_at_decode_size():
    # 8 tokens: the decode-sized steps the recorder adds; every chunk is one NCCL message.
    exp = mgo.TPExperiment(tokens=8, hidden=4096, ffn=8192, dtype="bfloat16",
                           chunk_counts=(1, 2, 8), trace_chunks=4, warmup=3, repeats=10)
    result = mgo.run_experiment(exp, world_size=2, backend="nccl")
    assert result.ranks[0]["orders"] == result.ranks[1]["orders"]
    for rank in result.ranks:
        for k in (1, 2, 8):
            for step, c, m in zip(*(rank["rounds"][f"{w} {k}"]
                                    for w in ("sequential", "compute", "comm"))):
                assert c > 0 and m > 0 and c + m == pytest.approx(step, rel=0.2), (k, step, c, m)
    assert len(result.round_table) == 3 * exp.rounds
