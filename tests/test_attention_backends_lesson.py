"""Notebook 06's claims (labkit.lessons.attention_backends.claims_io, claims_selection,
claims_speed, claims_fp8): each holds on the committed H200 recording (or on a synthetic input
shaped like the real case) and fails when its input is perturbed: two timings swapped, a bound
exceeded, a range widened. The appendix's claims are in test_attention_deep_dives.py."""
import copy

import pandas as pd
import pytest

from labkit.attention import AttentionSpec, example_specs
from labkit.lessons.attention_backends import roofline as rl
from labkit.lessons.attention_backends.claims_fp8 import fp8_claims, same_decode
from labkit.lessons.attention_backends.claims_io import causal_memory_claims, tiling_claims
from labkit.lessons.attention_backends.claims_selection import (
    correctness_claim,
    mla_claims,
    selection_claims,
)
from labkit.lessons.attention_backends.claims_speed import (
    decode_tile_claims,
    launch_claims,
    long_context_claims,
    roofline_claims,
    targets_claim,
)
from labkit.lessons.attention_backends.compare import attention_io, mla_cache_bytes, tile_io
from labkit.tools import recorded


@pytest.fixture
def data():
    return copy.deepcopy(recorded.load("attention_backends", "kernels").data)


MATMUL = 802.0  # the tour's recorded matmul ceiling on the same H200, TFLOP/s


def held(made):
    return [c.held for c in made]


def slower(result: dict, factor: float) -> None:
    """Every timing of ``result`` ``factor`` times longer, every rate that much lower, in every
    round (the benchmark's format keeps both)."""
    for key in ("us", "us_range", "rounds_us"):
        if key in result:
            result[key] = (result[key] * factor if not isinstance(result[key], list)
                           else [v * factor for v in result[key]])
    for key in ("tflops", "gbps", "tflops_range", "gbps_range", "fraction_of_copy"):
        if key in result:
            result[key] = (result[key] / factor if not isinstance(result[key], list)
                           else [v / factor for v in result[key]])


def with_rounds(result: dict, rounds_us: list[float]) -> dict:
    return {**result, "us": sorted(rounds_us)[len(rounds_us) // 2], "rounds_us": rounds_us}


# ----------------------------------------------------------------- tiling and selection
def test_tiling_claims_hold_on_the_tile_arithmetic_and_fail_when_tiles_stop_paying():
    tiles = pd.DataFrame([{"BLOCK_M": m, "BLOCK_N": n} | tile_io(m, n, 128)
                          for m, n in [(64, 64), (128, 64)]])
    io = attention_io(4096, 4096, 32, 128)
    assert held(tiling_claims(tiles, io, 4096)) == [True, True]
    flat = tiles.assign(flops_per_byte=[128.0, 64.0])  # the larger tile no longer pays
    worse = {**io, "tiled_bytes": io["naive_bytes"] * 2}
    assert held(tiling_claims(flat, worse, 4096)) == [False, False]


LENGTHS = [512, 1024, 2048, 4096, 8192, 16384]


def test_causal_memory_claims_hold_on_the_kernels_tile_counts():
    ios = {n: attention_io(n, n, 32, 128) for n in LENGTHS}
    assert held(causal_memory_claims(ios)) == [True, True]


def test_the_causal_claim_fails_when_the_loop_runs_past_the_diagonal():
    ios = {n: attention_io(n, n, 32, 128) for n in LENGTHS}
    unskipped = {n: {**io, "causal_tiled_bytes": io["tiled_bytes"],
                     "causal_flops_computed": io["tiled_flops_computed"]}
                 for n, io in ios.items()}
    assert held(causal_memory_claims(unskipped)) == [False, True]


def test_the_memory_claim_fails_when_the_tiled_kernel_holds_the_scores():
    ios = {n: attention_io(n, n, 32, 128) for n in LENGTHS}
    holding = {n: {**io, "tiled_memory_bytes": io["naive_memory_bytes"]} for n, io in ios.items()}
    assert held(causal_memory_claims(holding)) == [True, False]


def test_causal_tiles_follow_the_diagonal():
    io = attention_io(256, 256, 1, 64, block_m=128, block_n=64)
    # query tile 0 reads keys [0, 128), tile 1 keys [0, 256): 384 of 512 keys
    assert io["causal_tiled_bytes"] - 2 * 256 * 64 * 2 == 2 * 384 * 64 * 2
    assert io["causal_flops_computed"] / io["tiled_flops_computed"] == 384 / 512
    assert io["tiled_memory_bytes"] == 4 * 256 * 64 * 2, "Q, K, V, O"


def test_mla_claim_holds_on_the_example_spec_and_fails_on_per_head_kv():
    cache = mla_cache_bytes(128, 512, 64, qk_nope=128, v_head=128)
    assert cache["mla_bytes"] == 576 * 2 and cache["per_head_bytes"] == 128 * (192 + 128) * 2
    spec = example_specs()["MLA (DeepSeek-V3)"]
    assert held(mla_claims(spec, cache)) == [True]
    sixteen_heads = AttentionSpec(128, 16, 576, mla=True)
    assert held(mla_claims(sixteen_heads, cache)) == [False]


def test_selection_claims_hold_on_the_notebooks_decisions_and_fail_on_other_ones():
    mla_passed = {"flex": ["model: MLA attention is not supported"],
                  "sdpa": ["model: MLA attention is not supported"],
                  "reference": ["compatible, but after 'triton' in the priority order"]}
    chosen = {"GQA + fp8 KV cache on an A100": ("reference", {}),
              "head_dim 96 (Phi-3-mini-like)": ("sdpa", {}),
              "MLA (DeepSeek-V3)": ("triton", mla_passed)}
    assert all(held(selection_claims(chosen, {})))
    wrong = {"GQA + fp8 KV cache on an A100": ("triton", {}),
             "head_dim 96 (Phi-3-mini-like)": ("triton", {}),
             "MLA (DeepSeek-V3)": ("triton", {**mla_passed, "sdpa": ["head_dim too large"]})}
    assert held(selection_claims(wrong, {})) == [False, False, False]
    served_by_a_peer = {**chosen, "MLA (DeepSeek-V3)": ("sdpa", {"flex": ["MLA"]})}
    assert held(selection_claims(served_by_a_peer, {}))[2] is False


def test_correctness_claim_fails_when_one_backend_is_off_the_reference():
    ok = pd.DataFrame({"backend": ["triton", "sdpa"], "compatible": [True, True],
                       "relative_error": [1e-6, 2e-6], "passed": [True, True]})
    assert held(correctness_claim({"a": ok}, "cpu")) == [True]
    off = ok.assign(passed=[True, False], relative_error=[1e-6, 0.3])
    assert held(correctness_claim({"a": ok, "b": off}, "cpu")) == [False]


# -------------------------------------------------------------------- the recorded GPU run
def test_roofline_claims_hold_on_the_recording(data):
    assert all(held(roofline_claims(data, MATMUL)))


def test_the_placement_claims_fail_above_the_roof_and_far_off_the_copy_rate(data):
    slower(data["prefill"]["sdpa cudnn"], 0.5)  # 1,200 TFLOP/s: above an 802 TFLOP/s ceiling
    slower(data["decode"]["auto"], 3)  # a third of copy: not on the sloped roof
    under_roof, decode = roofline_claims(data, MATMUL)
    assert not under_roof.held and not decode.held


def test_long_context_claims_hold_and_fail_with_batches_or_modes_swapped(data):
    assert all(held(long_context_claims(data)))
    batches, modes = copy.deepcopy(data), copy.deepcopy(data)
    lc = batches["long_context"]
    lc["B1 split (auto)"], lc["B4 split (auto)"] = lc["B4 split (auto)"], lc["B1 split (auto)"]
    assert held(long_context_claims(batches))[0] is False
    lc = modes["long_context"]
    lc["B1 split (auto)"], lc["B1 no split"] = lc["B1 no split"], lc["B1 split (auto)"]
    assert held(long_context_claims(modes))[1] is False


def test_decode_tile_claim_holds_on_the_recording_and_fails_when_the_old_tile_wins(data):
    assert held(decode_tile_claims(data)) == [True]
    lc = data["long_context"]
    old = f"B2 {rl.TILE_BEFORE}"
    lc["B2 split (auto)"], lc[old] = lc[old], lc["B2 split (auto)"]
    assert held(decode_tile_claims(data)) == [False]
    del lc[old]  # a recording made before the tile changed: nothing claimed
    assert held(decode_tile_claims(data)) == []


def test_decode_tile_claim_allows_one_slow_round_at_batch_1_or_2_and_no_more(data):
    """As on H200 runs: at batch 2 the old tile won one round of five, the new one the median."""
    lc = data["long_context"]
    new, old = lc["B2 split (auto)"], lc[f"B2 {rl.TILE_BEFORE}"]
    old["rounds_us"] = [73.0, 73.1, 73.0, 73.0, 73.2]
    new["rounds_us"] = [70.0, 70.0, 70.5, 76.0, 70.2]
    assert held(decode_tile_claims(data)) == [True]
    new["rounds_us"] = [70.0, 74.0, 70.5, 76.0, 70.2]  # two slow rounds of five
    assert held(decode_tile_claims(data)) == [False]
    new["rounds_us"] = [74.0, 74.0, 70.5, 70.0, 74.2]  # slower in the median
    assert held(decode_tile_claims(data)) == [False]
    new["rounds_us"] = [70.0] * 5
    b4_new, b4_old = lc["B4 split (auto)"], lc[f"B4 {rl.TILE_BEFORE}"]
    b4_new["rounds_us"] = [u * 1.02 for u in b4_old["rounds_us"]]  # batch 4: 2% slower
    assert held(decode_tile_claims(data)) == [False]


def test_long_context_ordering_needs_the_whole_range_apart(data):
    lc = data["long_context"]
    b1, b4 = lc["B1 split (auto)"]["us"], lc["B4 split (auto)"]["us"]
    lc["B1 split (auto)"] = with_rounds(lc["B1 split (auto)"], [b1, b1, b4 / 4.2])  # one round
    first, _ = long_context_claims(data)  # where batch 1 read faster per byte than batch 4
    assert not first.held


def test_launch_claims_hold_and_fail_when_python_is_slower_at_b64_or_free_at_b1(data):
    assert all(held(launch_claims(data)))
    auto = data["decode"]["auto"]["us"]
    data["decode"]["auto, launched from Python"] = with_rounds(
        data["decode"]["auto, launched from Python"], [auto * 1.02, auto * 1.03, auto * 1.2])
    data["decode"]["auto"] = with_rounds(data["decode"]["auto"], [auto, auto, auto])
    lc = data["long_context"]
    lc["B1 split, launched from Python"] = dict(lc["B1 split (auto)"])
    assert held(launch_claims(data)) == [False, False]


def test_fp8_claim_holds_and_fails_when_fp8_is_not_faster(data):
    speed, same = fp8_claims(data)  # fp8 timed in the decode section's own rounds
    assert speed.held and same.held and "one measurement" in same.text
    d = data["decode"]
    d["auto"], d["fp8_e4m3"] = d["fp8_e4m3"], d["auto"]
    assert not fp8_claims(data)[0].held


def _one_set_of_rounds(data):
    """The decode section as the benchmark now records it: fp8 inside it, auto with rounds."""
    d = data["decode"]
    d["auto"] = with_rounds(d["auto"], data["fp8"]["bf16"]["rounds_us"])
    d["fp8_e4m3"] = data["fp8"]["fp8_e4m3"]
    d["fp8_e4m3_no_prefetch"] = data["fp8"]["fp8_e4m3_no_prefetch"]
    return data


def test_the_bf16_decode_is_one_measurement_in_the_benchmarks_format(data):
    made = fp8_claims(_one_set_of_rounds(data))
    assert len(made) == 2 and all(held(made))
    assert "one measurement" in made[1].text


def test_two_bf16_decodes_must_agree_within_their_ranges(data):
    d = data["decode"]  # the format that timed bf16 twice: in the decode and the fp8 sections
    for name in ("fp8_e4m3", "fp8_e4m3_no_prefetch"):
        data["fp8"][name] = d.pop(name)
    data["fp8"]["bf16"] = with_rounds(d["auto"], [257.0, 257.4, 258.0])
    d["auto"] = with_rounds(d["auto"], [288.8, 289.5, 290.1])  # the fp8 section read 257
    assert not same_decode(data)("", None).held
    d["auto"] = with_rounds(d["auto"], [257.0, 258.0, 259.0])
    assert same_decode(data)("", None).held


def test_targets_claim_names_a_missed_target_and_fails_when_one_went_unmeasured(data):
    assert all(held(targets_claim(rl.targets(data))))
    slower(data["decode"]["auto"], 2)  # half the copy rate: decode misses its target
    (made,) = targets_claim(rl.targets(data))
    missed = made.text.split("missed: ")[1]
    assert made.held and "decode: ours, fraction of copy bandwidth" in missed
    del data["decode"]["sdpa flash"]  # a peer that did not run: its target is not measured
    (made,) = targets_claim(rl.targets(data))
    assert not made.held and "not measured: decode: ours vs SDPA flash" in made.text


def test_targets_are_the_kernel_issues_and_a_range_clearing_one_is_met(data):
    score = rl.targets(data).set_index(["target", "kind"])
    assert score.loc[("long context B1, split: fraction of copy bandwidth", "must"),
                     "required"] == 0.8
    assert score.loc[("long context B4, split: fraction of copy bandwidth", "must"),
                     "required"] == 0.88
    assert score.loc[("fp8 cache vs bf16 decode (speed ratio): aim", "aim"), "required"] == 1.9
    fp8 = score.loc[("fp8 cache vs bf16 decode (speed ratio)", "must")]
    assert fp8.required == 1.75 and fp8.verdict == ("met" if fp8.low >= 1.75 else fp8.verdict)
    def b4_row(fraction_low=None, fraction_high=None):
        result = copy.deepcopy(data)
        b4 = result["long_context"]["B4 split (auto)"]
        frac = rl.fraction_of_copy(b4, data["copy_gbps"])
        slower(b4, frac.low / fraction_low if fraction_low else frac.high / fraction_high)
        return rl.targets(result).set_index("target").loc[
            "long context B4, split: fraction of copy bandwidth"]
    assert b4_row(fraction_low=0.885).verdict == "met"
    assert b4_row(fraction_high=0.875).verdict == "missed"


def test_a_straddled_target_is_said_to_be_within_noise_and_not_called_met(data):
    lc = data["long_context"]
    b1 = lc["B1 split (auto)"]
    slower(b1, rl.fraction_of_copy(b1, data["copy_gbps"]).median / 0.82)  # at 0.82 of copy
    us = b1["us"]
    lc["B1 split (auto)"] = with_rounds(b1, [us, us * 1.01, us * 1.2])  # 0.83, 0.82, 0.69
    score = rl.targets(data).set_index("target")
    row = score.loc["long context B1, split: fraction of copy bandwidth"]
    assert row.verdict == "within noise" and not row.met
    (made,) = targets_claim(score.reset_index())
    assert made.held and "within noise" in made.text and "long context B1" in made.text
