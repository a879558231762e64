"""Appendix 06a's claims: the L2 reuse behind prefill's place on the roofline, the registry call
against the bare kernel, the fp8 decode loop's SASS counts and the fp8 cache's accuracy, and the
block-size sweep. Each holds on the committed H200 recording (or on a synthetic input shaped like
the real case) and fails when its input is perturbed."""
import copy

import pandas as pd
import pytest

from labkit.lessons.attention_backends import roofline as rl
from labkit.lessons.attention_backends.claims_fp8 import (
    FP8_ERROR_BOUND,
    fp8_accuracy_claims,
    sass_claims,
)
from labkit.lessons.attention_backends.claims_registry import (
    registry_claims,
    registry_limits,
    registry_split,
)
from labkit.lessons.attention_backends.claims_speed import block_sweep_claims, l2_reuse_claims
from labkit.lessons.attention_backends.compare import (
    AttentionWorkload,
    attention_io,
    registry_table,
    tile_io,
)
from labkit.lessons.attention_backends.fp8_accuracy import fp8_cache_error
from labkit.tools import recorded

MATMUL = 802.0  # the tour's recorded matmul ceiling on the same H200, TFLOP/s
TILE = tile_io(128, 64, 128)["flops_per_byte"]
IO = attention_io(4096, 4096, 32, 128)["tiled_flops_per_byte"]


@pytest.fixture
def data():
    return copy.deepcopy(recorded.load("attention_backends", "kernels").data)


def held(made):
    return [c.held for c in made]


def slower(result: dict, factor: float) -> None:
    """Every timing of a benchmark result ``factor`` times longer, in every round."""
    result["us"] *= factor
    if "rounds_us" in result:
        result["rounds_us"] = [v * factor for v in result["rounds_us"]]


# ------------------------------------------------------------------------------ L2 reuse
def test_the_l2_claim_holds_on_the_recording(data):
    assert held(l2_reuse_claims(data, MATMUL, TILE, IO)) == [True]


def test_the_l2_claim_fails_when_no_prefill_peer_beats_the_no_reuse_cap(data):
    for result in data["prefill"].values():  # every peer a third slower: all under the HBM
        slower(result, 1.5)                    # cap of the tile model
    assert held(l2_reuse_claims(data, MATMUL, TILE, IO)) == [False]


def test_the_l2_claim_says_so_when_one_round_dips_under_the_cap(data):
    for result in data["prefill"].values():  # one slow round each: the range reaches under the
        result["rounds_us"][-1] *= 1.5        # cap, the median (of five) stays above it
    made = l2_reuse_claims(data, MATMUL, TILE, IO)
    assert held(made) == [True]
    assert "do not settle" in made[0].text and "every round above" not in made[0].text


def test_the_l2_claim_says_every_round_when_every_round_clears_the_cap(data):
    made = l2_reuse_claims(data, MATMUL, TILE, IO)
    assert "every round above that cap" in made[0].text


def test_the_l2_claim_is_not_made_without_prefill(data, capsys):
    del data["prefill"]
    assert l2_reuse_claims(data, MATMUL, TILE, IO) == []
    assert "re-record" in capsys.readouterr().out


# ------------------------------------------------------- the registry against the benchmark
def _registry(triton_gpu_us: float, wall_us: float = 700.0) -> pd.DataFrame:
    return registry_table([
        {"workload": "decode B64 ctx 4096", "backend": "triton", "us": wall_us,
         "us_low": wall_us * 0.98, "us_high": wall_us * 1.02, "rounds": 3,
         "gpu_us": triton_gpu_us, "kernels": 3, "error": None},
        {"workload": "decode B64 ctx 4096", "backend": "flex",
         "error": "NoValidChoicesError: no choices to select"}])


def test_registry_claims_hold_on_the_recorded_registry_section(data):
    made = registry_claims(registry_table(data["registry"]), data)
    assert len(made) == 6 and all(held(made))


def test_registry_claims_split_the_wall_time_and_fail_when_the_split_is_inconsistent(data):
    bare = data["decode"]["auto"]["us"]
    (made,) = registry_claims(_registry(bare * 1.02), data)
    assert made.held and "host time" in made.text.lower()
    (faster,) = registry_claims(_registry(bare * 0.5), data)  # less GPU work than the kernel
    assert not faster.held
    (over,) = registry_claims(_registry(bare * 1.02, wall_us=bare * 0.5), data)
    assert not over.held, "the GPU time cannot exceed the wall time"


def test_the_split_counts_kernels_as_integers_and_host_time_never_below_zero(data):
    bare = data["decode"]["auto"]["us"]
    split = registry_split(_registry(bare * 1.02, wall_us=bare * 0.5), data)
    assert str(split.kernels.dtype) == "Int64" and split.kernels.tolist() == [3]
    assert split.host_us.tolist() == [0.0]
    assert split.extra_gpu_us.iloc[0] == pytest.approx(bare * 0.02)


def test_registry_claims_are_not_made_without_a_registry_section(data, capsys):
    assert registry_claims(None, data) == []
    assert "re-record" in capsys.readouterr().out


def test_a_backend_that_raised_is_listed_as_a_limit(data):
    data["decode"]["flex"] = {"error": "NoValidChoicesError: no choices to select"}
    limits = registry_limits(_registry(300.0), data)
    assert list(limits.backend) == ["flex", "flex"]
    assert limits.error.str.contains("NoValidChoicesError").all()


# ----------------------------------------------------------------------------- fp8 in depth
def _loops(fp8_per_key=41.6, fp8_byte_loads=128):
    return {"bf16": {"instructions_per_key": 40.0, "kv_bytes_per_key": 4096,
                     "opcodes": {"HMMA.16816.F32.BF16": 64, "LDSM.16.MT88.4": 32}},
            "fp8_e4m3": {"instructions_per_key": fp8_per_key, "kv_bytes_per_key": 2048,
                         "opcodes": {"HMMA.16816.F32": 64, "LDS.U8": fp8_byte_loads,
                                     "F2FP.F16.E4M3.UNPACK_B": 128}}}


def test_sass_claims_fail_when_fp8_costs_twice_per_key_or_transposes_without_byte_loads():
    assert held(sass_claims(_loops())) == [True, True]
    assert held(sass_claims(_loops(fp8_per_key=80.0, fp8_byte_loads=0))) == [False, False]


def test_fp8_accuracy_claims_hold_on_the_reference_path_and_fail_when_fp8_is_not_worse():
    w = AttentionWorkload((1, 1, 1, 4), (512, 200, 33, 17), 8, 2, 128)
    table = fp8_cache_error(w, "cpu", seeds=range(3))
    assert list(table.path.unique()) == ["reference"], "the kernel runs fp8 on a GPU only"
    assert held(fp8_accuracy_claims(table, "cpu")) == [True]
    assert (table.fp8_vs_float64 > table.bf16_vs_float64).all()
    as_bf16 = table.assign(fp8_vs_float64=table.bf16_vs_float64 * 0.9)
    assert held(fp8_accuracy_claims(as_bf16, "cpu")) == [False], "fp8 no worse than bf16"
    assert held(fp8_accuracy_claims(table, "cpu", bound=1e-3)) == [False], "over the bound"
    one_bad_seed = table.copy()
    one_bad_seed.loc[0, "fp8_vs_float64"] = FP8_ERROR_BOUND * 1.5
    assert held(fp8_accuracy_claims(one_bad_seed, "cpu")) == [False], "every seed counts"


# ------------------------------------------------------------------------ the block sweep
def test_the_block_sweep_claim_holds_on_the_recording(data):
    (made,) = block_sweep_claims(rl.block_sweep_table(data), 16)
    assert made.held and "block size 16 to 256" in made.text


def test_the_block_sweep_claim_fails_when_one_block_size_falls_off(data):
    table = rl.block_sweep_table(data)
    table.loc[16, table.columns.max()] /= 2  # block 16 at the longest context: half the rate
    (made,) = block_sweep_claims(table, 16)
    assert not made.held


def test_the_block_sweep_claim_is_not_made_without_a_sweep(data, capsys):
    data["block_sweep"] = {"error": "RuntimeError: out of memory"}
    assert rl.block_sweep_table(data) is None
    assert block_sweep_claims(None, 16) == []
    assert "re-record" in capsys.readouterr().out
