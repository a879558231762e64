"""torch.compile lab: graph breaks and their fixes, recompiles per shape strategy, the pipeline.

Guards and graph breaks belong to Dynamo, so most tests compile with ``backend="eager"`` (no
code generation) to stay fast; one test runs Inductor for real.
"""
import json
import logging

import pytest
import torch

from labkit.lessons.torch_compile import graph_breaks as gb
from labkit.lessons.torch_compile import pipeline as cp
from labkit.lessons.torch_compile import recompiles as rc

EXAMPLE_IDS = [ex.name for ex in gb.EXAMPLES]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# --- graph breaks ---------------------------------------------------------------------------
@pytest.mark.parametrize("ex", gb.EXAMPLES, ids=EXAMPLE_IDS)
def test_each_broken_example_splits_into_two_graphs(ex):
    e = gb.explain(ex.broken, torch.randn(5, 7))
    assert e["breaks"] == 1 and e["graphs"] == 2, (
        f"{ex.name}: expected exactly one graph break, explain says {e}")
    assert e["reasons"] and e["reasons"][0], "a break must come with its reason"


@pytest.mark.parametrize("ex", gb.EXAMPLES, ids=EXAMPLE_IDS)
def test_each_fix_brings_the_break_count_to_zero(ex):
    e = gb.explain(ex.fixed, torch.randn(5, 7))
    assert e == {**e, "breaks": 0, "graphs": 1}, f"{ex.name}: the fix still breaks: {e}"


@pytest.mark.parametrize("ex", gb.EXAMPLES, ids=EXAMPLE_IDS)
@pytest.mark.parametrize("shape,sign", [((1, 1), 1), ((7, 13), 1), ((7, 13), -1), ((64, 3), -1)])
def test_each_fix_computes_what_the_broken_version_computes(ex, shape, sign):
    x = torch.randn(shape).abs() * sign  # both sides of the data-dependent branch
    assert gb.same_result(ex, x), f"{ex.name}: the fixed version changed the result for {shape}"


@pytest.mark.parametrize("ex", gb.EXAMPLES, ids=EXAMPLE_IDS)
def test_fixed_versions_compile_as_one_full_graph_matching_eager(ex):
    x = torch.randn(6, 5)
    compiled = torch.compile(ex.fixed, backend="eager", fullgraph=True)  # raises on any break
    torch.testing.assert_close(compiled(x), ex.fixed(x), rtol=0, atol=0)


def test_graphs_of_reads_one_example_and_names_the_examples_when_asked_for_another():
    table = gb.break_table(torch.randn(5, 7), gb.EXAMPLES[:1])
    assert gb.graphs_of(table, gb.EXAMPLES[0].name) == 2
    assert gb.graphs_of(table, gb.EXAMPLES[0].name, "fixed") == 1
    with pytest.raises(KeyError, match="if on a tensor value"):
        gb.graphs_of(table, "print")


def test_broken_version_is_refused_under_fullgraph():
    compiled = torch.compile(gb.branch_on_value, backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="(?i)data.dependent|generic_jump|Unsupported"):
        compiled(torch.randn(4, 4))



def test_explain_drops_only_the_graph_break_warnings_and_keeps_the_recompile_limit_one(caplog):
    tensor_log = logging.getLogger("torch._dynamo.variables.tensor")
    frame_log = logging.getLogger("torch._dynamo.convert_frame")
    level = logging.getLogger("torch._dynamo").level
    with gb.break_warnings_dropped():
        tensor_log.warning("Graph break from `Tensor.item()`, consider setting: ...")
        frame_log.warning("torch._dynamo hit config.recompile_limit (8)")
    assert "recompile_limit" in caplog.text and "Graph break" not in caplog.text
    gb.explain(gb.scale_by_item, torch.randn(4, 4))
    assert logging.getLogger("torch._dynamo").level == level, "explain leaves Dynamo's level"
    tensor_log.warning("Graph break outside explain")
    assert "Graph break outside explain" in caplog.text, "the filter is removed afterwards"


# --- guards and recompiles ------------------------------------------------------------------
def _rows(n):
    return torch.randn(n, 8)


def _per_row(x):  # rows independent, like a model's per-token layers
    return torch.nn.functional.gelu(x) * 2 + x.pow(2).mean(-1, keepdim=True)


def test_static_compiles_once_per_distinct_shape_and_says_why():
    sizes = [4, 6, 4, 9, 6]
    r = rc.run_shapes(_per_row, sizes, "static", _rows)
    assert r.compiles == 3, f"dynamic=False should compile once per distinct size; got {r.compiles}"
    assert len(r.reasons) == 2 and all("size mismatch" in why for why in r.reasons), r.reasons


def test_dynamic_true_recompiles_fewer_times_than_static_on_the_same_shapes():
    sizes = [4, 6, 9, 12, 5]
    static = rc.run_shapes(_per_row, sizes, "static", _rows)
    dynamic = rc.run_shapes(_per_row, sizes, "dynamic", _rows)
    assert dynamic.compiles == 1 and static.compiles == len(set(sizes)), (
        f"static {static.compiles}, dynamic {dynamic.compiles}")
    assert dynamic.max_abs_err < 1e-5


def test_batch_of_one_gets_its_own_graph_even_with_dynamic_shapes():
    r = rc.run_shapes(_per_row, [4, 6, 1], "dynamic", _rows)
    assert r.compiles == 2 and "size" in r.reasons[-1], r.reasons


def test_static_falls_back_to_eager_past_the_recompile_limit():
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    with torch._dynamo.config.patch({name: 2}):
        r = rc.run_shapes(_per_row, [3, 4, 5, 6], "static", _rows)
    assert r.compiles == 2 and r.eager_fallbacks == 2, r.calls
    assert r.max_abs_err < 1e-5, "the eager fallback still computes the right thing"


def test_buckets_compile_once_per_bucket_and_padding_never_leaks():
    sizes = [3, 1, 7, 4, 8, 13, 2, 16]
    r = rc.run_shapes(_per_row, sizes, "buckets", _rows, buckets=(4, 8, 16))
    assert r.compiles == 3, f"three buckets used, {r.compiles} compiles"
    assert list(r.calls.ran_as) == [4, 4, 8, 4, 8, 16, 4, 16]
    assert r.max_abs_err < 1e-5, "padded rows changed the real rows"


def test_a_batch_beyond_the_largest_bucket_is_refused_before_compiling():
    with pytest.raises(ValueError, match="larger than the largest bucket 8"):
        rc.run_shapes(_per_row, [3, 9], "buckets", _rows, buckets=(4, 8))


def test_unknown_strategy_and_unknown_log_artifact_are_errors():
    with pytest.raises(ValueError, match="strategy must be one of"):
        rc.run_shapes(_per_row, [3], "sometimes", _rows)
    with pytest.raises(RuntimeError, match="no logging artifact"), \
            rc.captured_logs("not_an_artifact_xyz"):
        pass


# --- the pipeline ---------------------------------------------------------------------------
def test_block_config_says_what_is_wrong():
    with pytest.raises(ValueError, match="dim and hidden must be >= 1"):
        cp.BlockConfig(dim=0)


def test_dynamo_and_aot_stages_show_torch_then_aten_ops():
    block, x = cp.make_block(cp.BlockConfig(16, 32)), torch.randn(3, 16)
    dyn, aot = cp.dynamo_graph(block, x), cp.aot_graph(block, x)
    assert dyn.graphs == 1 and "rsqrt" in dyn.code and "linear" in dyn.ops
    assert aot.graphs == 1 and "torch.ops.aten" in aot.code
    assert sum(op.startswith("addmm") for op in aot.ops) == 2, aot.ops


def test_a_graph_break_inside_the_block_gives_two_graphs():
    block, x = cp.make_block(cp.BlockConfig(16, 32)), torch.randn(3, 16)
    assert cp.dynamo_graph(cp.with_break(block), x).graphs == 2


def test_inductor_fuses_the_block_into_fewer_kernels_than_eager_launches():
    block, x = cp.make_block(cp.BlockConfig(16, 32)), torch.randn(5, 16)
    stage = cp.inductor_code(block, x)
    eager = cp.eager_launches(cp.aot_graph(block, x))
    assert stage.language == ("Triton" if x.is_cuda else "C++")
    assert stage.kernels and stage.extern_calls, "expected generated kernels and matmul calls"
    assert len(stage.kernels) + len(stage.extern_calls) < len(eager), (stage.kernels, eager)
    assert any("rsqrt" in k for k in stage.kernels), "the norm's ops should fuse into one kernel"
    assert stage.max_abs_err < 1e-5
    assert "kernel" in stage.kernel_source(0)


# --- reduce-overhead (GPU) --------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_reduce_overhead_helpers_refuse_without_a_gpu_and_point_to_the_recording():
    with pytest.raises(RuntimeError, match="recorded GPU result"):
        rc.output_overwritten()


@pytest.mark.gpu
def test_reduce_overhead_output_is_overwritten_by_the_next_call_unless_cloned():
    r = rc.output_overwritten()
    assert r["overwritten"], f"the kept output should be stale or refused: {r}"
    assert r["clone_is_right"], r


@pytest.mark.gpu
def test_mutated_input_skips_cuda_graphs_and_the_functional_version_does_not():
    r = rc.mutated_input_skips_graphs(repeats=5)
    assert r["mutating_skipped"] and not r["functional_skipped"], r
    json.dumps(r)
