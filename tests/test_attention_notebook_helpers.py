"""labkit.lessons.attention_backends.roofline, figures and the tables of compare and sass: the
arithmetic behind notebook 06's roofline and target table, and tables whose counts print as
integers."""
import dataclasses
import inspect
import math
import sys

import pandas as pd
import pytest

from labkit.attention import BACKENDS
from labkit.lessons.attention_backends import figures
from labkit.lessons.attention_backends import roofline as rl
from labkit.lessons.attention_backends import sass
from labkit.lessons.attention_backends.compare import (
    AttentionWorkload,
    registry_table,
    tile_table,
    time_registry,
)
from labkit.tools import recorded
from labkit.tools.record import ROOT


def _benchmark():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import benchmarks.attention as bench
    return bench


def _defaults(fn) -> dict:
    return {k: p.default for k, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


def test_the_roofline_uses_the_shapes_the_benchmark_measures():
    bench = _benchmark()
    p, d = _defaults(bench.prefill), _defaults(bench.decode)
    assert (p["B"], p["H"], p["S"], p["D"]) == tuple(rl.PREFILL.values()), \
        "benchmarks/attention.py prefill() changed shape: update roofline.PREFILL to match"
    assert (d["B"], d["Hq"], d["Hkv"], d["ctx"], d["D"], d["block_size"]) == \
        tuple(rl.DECODE.values()), "decode() changed shape: update roofline.DECODE"
    assert _defaults(bench.long_context)["ctx"] == rl.LONG_CONTEXT
    assert f'"{rl.TILE_BEFORE}"' in inspect.getsource(bench.long_context), \
        "the long-context rows of the earlier tile are named as decode_tile_claims reads them"


def test_decode_workload_moves_the_bytes_the_benchmark_counts():
    w = rl.decode_workload()
    kv_bytes = 2 * 64 * 4096 * 8 * 128 * 2  # K and V, bf16
    assert kv_bytes <= w.bytes_moved() < 1.01 * kv_bytes, "decode traffic is the KV cache"
    assert rl.decode_workload(kv_cache_dtype="fp8_e4m3").bytes_moved() < 0.51 * w.bytes_moved()


def test_points_come_from_the_measured_time_and_skip_peers_that_did_not_run():
    data = {"prefill": {"triton (ours)": {"us": 1000.0}, "sdpa cudnn": None},
            "decode": {"auto": {"us": 250.0}}}
    pts = rl.roofline_points(data)
    assert list(pts.backend) == ["triton (ours)", "triton (ours)"], "a None peer is left out"
    prefill = pts.iloc[0]
    w = rl.prefill_workload()
    assert prefill.tflops == pytest.approx(w.flops() / 1e-3 / 1e12)
    assert prefill.flops_per_byte == pytest.approx(w.flops() / w.bytes_moved())
    assert pts.iloc[1].flops_per_byte == pytest.approx(4.0, rel=1e-2), \
        "GQA 32/8 decode: 4 FLOPs per byte of bf16 KV"


def test_a_target_is_met_only_when_every_round_clears_it_and_never_when_unmeasured():
    def decode(rounds_us):  # 1 MB per call: 1 us is 1000 GB/s
        return {"copy_gbps": 1000.0, "decode": {"auto": {
            "us": sorted(rounds_us)[len(rounds_us) // 2], "rounds_us": rounds_us,
            "gbps": 1000.0 / sorted(rounds_us)[len(rounds_us) // 2]}}}

    name = "decode: ours, fraction of copy bandwidth"
    clear = rl.targets(decode([1.1, 1.15, 1.2])).set_index("target")  # 0.83-0.91 of copy
    assert clear.loc[name, "verdict"] == "met" and clear.loc[name, "met"]
    straddles = rl.targets(decode([1.1, 1.2, 1.4])).set_index("target")  # 0.71-0.91
    assert straddles.loc[name, "verdict"] == "within noise" and not straddles.loc[name, "met"]
    short = rl.targets(decode([1.4, 1.5, 1.6])).set_index("target")  # 0.63-0.71
    assert short.loc[name, "verdict"] == "missed"
    assert not clear.loc["prefill: ours vs FlexAttention (speed ratio)", "met"], \
        "missing data must not pass"
    assert math.isnan(clear.loc["fp8 cache vs bf16 decode (speed ratio)", "measured"])


def test_a_ratio_is_taken_within_each_round():
    a = {"us": 2.0, "rounds_us": [2.0, 4.0, 2.0]}
    b = {"us": 1.0, "rounds_us": [1.0, 2.0, 1.0]}
    assert rl.ratio_of(a, b).values == (2.0, 2.0, 2.0), "drift between rounds cancels"
    assert rl.ratio_of(a, {"error": "x"}) is None
    assert rl.ratio_of({"us": 3.0}, {"us": 1.5}).values == (2.0,), "no rounds: the medians"


def test_roof_is_bandwidth_bound_left_of_the_ridge_and_flat_right_of_it():
    pts = rl.roofline_points({"decode": {"auto": {"us": 250.0}}})
    fig = rl.roofline_figure(pts, copy_gbps=1000.0, matmul_tflops=100.0, title="t")
    roof = dict(zip(fig.data[0].x, fig.data[0].y))
    assert roof[100.0] == pytest.approx(100.0), "the ridge sits at matmul / bandwidth"
    assert min(roof.values()) < 100.0 and max(roof.values()) == pytest.approx(100.0)


def test_source_excerpt_numbers_lines_as_in_the_file():
    text = rl.source_excerpt(rl.source_excerpt, "while hasattr", "obj = obj.fn")
    first = int(text.split()[0])
    assert inspect.getsourcelines(rl.source_excerpt)[1] < first
    assert text.count("\n") == 2 and "obj = obj.fn" in text
    with pytest.raises(ValueError, match="not in the source"):
        rl.source_excerpt(rl.source_excerpt, "no such line anywhere")


def test_a_failed_benchmark_section_draws_a_note_instead_of_raising():
    fig = figures.fp8_figure({"fp8": {"error": "RuntimeError: no fp8 on this GPU"}})
    assert "not measured" in fig.layout.title.text
    assert "no fp8 on this GPU" in fig.layout.annotations[0].text


# ------------------------------------------------------ counts are integers, not 150.0
def test_the_tile_table_counts_bytes_and_flops_as_integers():
    tiles = tile_table([(16, 16), (128, 64)], head_dim=128, tried={(16, 16)})
    counts = ["BLOCK_M", "BLOCK_N", "resident_bytes", "streamed_bytes_per_tile", "flops_per_tile"]
    assert all(pd.api.types.is_integer_dtype(tiles[c]) for c in counts), tiles.dtypes
    assert tiles.streamed_bytes_per_tile.tolist() == [2 * 16 * 128 * 2, 2 * 64 * 128 * 2]
    assert tiles["tried here"].tolist() == [True, False]


def test_a_backend_that_raised_leaves_the_registry_counts_integers():
    rows = [{"workload": "w", "backend": "triton", "us": 1.0, "rounds": 3, "kernels": 21},
            {"workload": "w", "backend": "flex", "error": "NoValidChoicesError"}]
    table = registry_table(rows)
    for column in ("rounds", "kernels"):
        assert str(table[column].dtype) == "Int64", table.dtypes
    assert table.kernels.iloc[0] == 21 and pd.isna(table.kernels.iloc[1])
    assert "21.0" not in table.to_string()


def test_the_recorded_registry_reads_back_with_integer_counts():
    columns = recorded.load("attention_backends", "kernels").data["registry"]
    with_a_gap = {k: list(v) for k, v in columns.items()}
    with_a_gap["kernels"][0] = None  # a backend with no GPU lane: JSON null
    table = registry_table(with_a_gap)
    assert str(table.kernels.dtype) == "Int64" and str(table.rounds.dtype) == "Int64"


def test_the_registry_timed_here_keeps_integer_counts_beside_a_backend_that_raised(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setitem(BACKENDS, "sdpa", dataclasses.replace(BACKENDS["sdpa"], flash=broken))
    w = AttentionWorkload((1, 2), (4, 5), 2, 1, 16, paged=False, name="tiny")
    table = time_registry(w, "cpu", rounds=3, repeats=1, warmup=0, names=("sdpa", "reference"))
    assert table.backend.tolist() == ["reference", "sdpa"] and "RuntimeError" in table.error[1]
    assert str(table.rounds.dtype) == "Int64" and table.rounds.tolist()[0] == 3
    assert str(table.kernels.dtype) == "Int64" and table.kernels.isna().all(), "no GPU lane"
    both = registry_table(pd.concat([table, table], ignore_index=True))
    assert str(both.rounds.dtype) == "Int64"


def test_the_block_sweep_table_is_keyed_by_integer_block_sizes_and_contexts():
    data = recorded.load("attention_backends", "kernels").data
    table = rl.block_sweep_table(data)
    assert pd.api.types.is_integer_dtype(table.index) and \
        pd.api.types.is_integer_dtype(table.columns)
    assert table.index.tolist() == sorted(table.index.tolist())


def test_the_loop_table_counts_instructions_as_integers():
    loops = {c: {"num_warps": 4, "block_n": 64, "registers": 127, "instructions_per_warp": 615,
                 "instructions_per_key": 38.4, "kv_bytes_per_key": 512,
                 "opcodes": {"HMMA.16816.F32": 32, "LDS.U8": 128 if c == "fp8_e4m3" else 0}}
             for c in ("bf16", "fp8_e4m3")}
    del loops["bf16"]["opcodes"]["LDS.U8"]
    table = sass.loop_table(loops)
    counts = table.drop(index=["warps x BLOCK_N keys", "instructions per key (all warps)",
                               "instructions per KB of KV"])
    assert all(type(v) is int for v in counts.to_numpy().ravel()), counts
    assert table.loc["byte loads from shared memory", "bf16"] == 0
