"""Notebook 10's lesson code (labkit/lessons/mla/): the byte and FLOP arithmetic against
independent counts, the absorption identity, the kernel check, and the claims' verdicts on
measured figures made up to fall on either side."""
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labkit.engine import random_model
from labkit.lessons import mla
from labkit.lessons.mla import cache_bytes
from labkit.lessons.paged_kv_cache.attention_memory import DEEPSEEK_V3, GIB
from labkit.teaching import reset_claims


@pytest.fixture(autouse=True)
def fresh_claims():
    reset_claims()
    yield
    reset_claims()


def test_scheme_table_counts_deepseek_v3s_cache_per_scheme():
    t = mla.scheme_table(cache_gib=64.0, context=4096).set_index("values per token and layer")
    assert list(t.index) == [128 * (192 + 128), 8 * (192 + 128), 192 + 128, 512 + 64]
    mla_row = t.loc[576]
    assert mla_row["KiB per token"] == 576 * 61 * 2 / 1024
    assert mla_row["requests that fit"] == 64 * GIB // (576 * 61 * 2 * 4096)
    assert t.loc[2560, "bytes vs MLA"] == pytest.approx(2560 / 576)


def test_decode_intensity_is_flops_over_bytes():
    assert mla.decode_intensity(DEEPSEEK_V3, "MHA", kv_heads=128) == 1.0
    assert mla.decode_intensity(DEEPSEEK_V3, "MHA", kv_heads=8) == 16.0
    ctx = 10
    per_call = mla.mla_flops(1, 128, ctx) / (ctx * 576 * 2)
    assert mla.decode_intensity(DEEPSEEK_V3, "MLA") == pytest.approx(per_call)
    assert mla.decode_intensity(DEEPSEEK_V3, "MLA", heads=16) == pytest.approx(per_call / 8)


def test_the_flop_count_is_what_the_matmuls_of_a_decode_step_do():
    """Scores over the 576-wide rows and the output over their first 512 columns, as torch
    counts them."""
    batch, heads, ctx = 2, 4, 8
    q = torch.randn(batch, heads, mla.RANK + mla.ROPE)
    latent = torch.randn(batch, ctx, mla.RANK + mla.ROPE)
    with FlopCounterMode(display=False) as counter:
        p = torch.softmax(q @ latent.transpose(1, 2), -1)
        p @ latent[..., :mla.RANK]
    assert mla.mla_flops(batch, heads, ctx) == counter.get_total_flops()
    # 1,000 bytes at 1,000 GB/s take 1 ns; 10^6 FLOPs at 1 TFLOP/s take 1 us: the larger wins
    assert mla.roof_us(1000, 10**6, 1000.0, 1.0) == pytest.approx(1.0)
    assert mla.roof_us(10**7, 1, 1000.0, 1.0) == pytest.approx(10.0)


def test_absorbed_and_decompressed_attention_agree_on_a_real_layer():
    model = random_model(mla.tiny_mla_config(), seed=1, std=0.15)
    attention = model.model.layers[0].self_attn
    check = mla.absorption_check(attention)
    assert check["score_diff"] < 1e-12 and check["output_diff"] < 1e-12
    assert check["output_scale"] > 0.1, "outputs near zero would agree for any weights"
    assert (check["heads"], check["nope"], check["rank"]) == (4, 24, 32)
    claims = mla.absorption_claims(check, mla.decode_step_flops(context=4096), 4096)
    assert all(c.held for c in claims)


def test_decompressing_every_step_costs_the_up_projection_of_the_whole_cache():
    f = mla.decode_step_flops(context=4096)
    assert f.loc["decompressed", "up-projections"] == 2 * 4096 * 128 * (128 + 128) * 512
    assert f.loc["absorbed", "attention"] == mla.mla_flops(1, 128, 4096)
    assert f.loc["decompressed", "total GFLOP"] > 100 * f.loc["absorbed", "total GFLOP"]


def test_the_kernel_check_runs_the_kernel_on_a_mixed_batch():
    check = mla.kernel_check(torch.device("cpu"))
    assert check["rel_err"] < check["tol"] and check["lens_q"] == [1, 3, 0, 21]
    assert mla.kernel_claim(check).held
    source = mla.kernel_loop_source()
    assert source.startswith("for n in range(lo, hi, BLOCK_N):") and "tl.dot" in source


def measured(share16=(0.55, 0.60), share128=(0.20, 0.25), us16=100.0, us128=300.0,
             rows16=None):
    """A made-up measurement in the shape measure_decode returns; ``rows16``: the rows-on-M
    case's shares of copy per round (absent when None, as in recordings made before it)."""
    copy = 4000.0
    nbytes = 64 * 4096 * 1152
    cases, shapes = {}, {"MLA 16 heads": (64, 16, 4096), "MLA 128 heads": (64, 128, 4096)}
    runs = [("MLA 16 heads", share16, us16), ("MLA 128 heads", share128, us128)]
    if rows16 is not None:
        runs.append(("MLA, rows on M (16 heads)", rows16, us16 * share16[0] / rows16[0]))
        shapes["MLA, rows on M (16 heads)"] = (64, 16, 4096)
    for name, share, us in runs:
        gbps = nbytes / (us * 1e3)
        cases[name] = {"us": us, "us_range": [us, us], "gbps": gbps, "gbps_range": [gbps, gbps],
                       "gbps_rounds": [share[0] * copy, share[1] * copy]}
    roof = {"copy_gbps": copy, "matmul_tflops": 700.0, "ridge": 175.0}
    return {**roof, "cases": mla.rate(cases, shapes, roof)}


def test_rate_gives_shares_tflops_and_the_roof():
    m = measured()
    r = m["cases"]["MLA 128 heads"]
    assert r["copy_share_range"] == pytest.approx([0.20, 0.25])
    assert r["tflops"] == pytest.approx(mla.mla_flops(64, 128, 4096) / 300e6)
    assert r["flops_per_byte"] == pytest.approx(mla.decode_intensity(DEEPSEEK_V3, "MLA"))
    assert r["roof_share"] == pytest.approx(mla.mla_flops(64, 128, 4096) / 700e6 / 300)
    assert not math.isnan(mla.decode_table(m).loc["MLA 16 heads", "of copy"])


def test_decode_claims_hold_only_when_the_ranges_say_so():
    assert all(c.held for c in mla.decode_claims(measured()))
    # 128 heads reading as much of the copy bandwidth as 16 heads: not what compute-bound means
    overlapping = mla.decode_claims(measured(share128=(0.50, 0.58)))
    assert overlapping[0].held and not overlapping[1].held


def test_the_orientation_claim_needs_keys_on_m_faster_in_every_round():
    faster = mla.decode_claims(measured(rows16=(0.50, 0.55)))  # keys on M: 0.55-0.60
    assert len(faster) == 3 and all(c.held for c in faster)
    assert "ran 1.10x" in faster[0].text and "1.09-1.10x over" in faster[0].text
    one_round_slower = mla.decode_claims(measured(rows16=(0.50, 0.61)))
    assert not one_round_slower[0].held and one_round_slower[1].held


def test_the_intensity_claim_needs_gqa_under_the_ridge_and_mla_over_it():
    table = mla.scheme_table()
    assert mla.intensity_claim(table, 190.0).held
    assert not mla.intensity_claim(table, 300.0).held  # a ridge over MLA's 242


def test_engine_claim_counts_equal_prompts():
    assert mla.engine_claim([[1, 2], [3]], [[1, 2], [3]], "x").held
    assert not mla.engine_claim([[1, 2], [4]], [[1, 2], [3]], "x").held
    assert not mla.engine_claim([], [], "x").held


def test_figures_show_every_scheme_and_case():
    fig = mla.intensity_figure(190.0, "test")
    assert len(fig.data[0].x) == 7 and "MLA 128 heads" in fig.data[0].x
    roof = mla.roofline_figure(measured(), "test")
    assert {t.name for t in roof.data} >= {"MLA 16 heads", "MLA 128 heads"}


def test_the_gpu_measurement_feeds_the_notebooks_table_claims_and_figure(monkeypatch):
    """measure_decode's glue, with the CUDA pieces stood in by CPU work of known bytes: the
    names and fields notebook 10 reads on a GPU are the ones it returns."""
    def cpu_case(batch, heads, ctx, device="cpu", **kw):
        a = torch.randn(256, 256)
        return (lambda: a @ a), batch * ctx * (mla.RANK + mla.ROPE) * 2

    from labkit.lessons.mla import decode
    monkeypatch.setattr(decode, "latent_decode", cpu_case)  # keys_on_m in kw
    monkeypatch.setattr(decode, "gqa_decode", lambda batch, ctx, device="cpu": cpu_case(
        batch, 32, ctx))
    monkeypatch.setattr(decode, "roofs", lambda rounds, device: {
        "copy_gbps": 4000.0, "copy": {}, "matmul_tflops": 700.0, "ridge": 175.0})
    monkeypatch.setattr("labkit.device.free_memory", lambda device: None)
    measured = mla.measure_decode(rounds=3, batch=2, ctx=64, device="cpu")
    assert set(measured["cases"]) == {"MLA 16 heads", "MLA 128 heads", "GQA 32/8 heads of 128",
                                      "MLA, rows on M (16 heads)"}
    table = mla.decode_table(measured)
    assert table.loc["MLA 128 heads", "FLOPs per byte"] == pytest.approx(
        mla.decode_intensity(DEEPSEEK_V3, "MLA"))
    assert math.isnan(table.loc["GQA 32/8 heads of 128", "TFLOP/s"])
    assert len(mla.decode_claims(measured)) == 3
    assert len(mla.roofline_figure(measured, "test").data) == 5


def test_both_prefill_paths_give_the_same_outputs_over_a_paged_latent_cache():
    """benchmarks/mla_prefill.py times two ways to prefill: they must compute the same thing
    (the absorbed kernel then W_UV; decompressed keys and values through flash_attention,
    padded to its power of two), on a length off the block and scattered blocks."""
    model = random_model(mla.tiny_mla_config(), seed=2, std=0.15)
    attention = model.model.layers[1].self_attn
    c, seq_len, block = attention.config, 37, 16
    g = torch.Generator().manual_seed(3)
    blocks = -(-seq_len // block)
    cache = torch.randn(blocks + 3, block, c.latent_size, generator=g)
    table = torch.randperm(blocks + 3, generator=g)[:blocks][None].int()
    q_nope = torch.randn(seq_len, c.num_attention_heads, c.qk_nope_head_dim, generator=g)
    q_pe = torch.randn(seq_len, c.num_attention_heads, c.qk_rope_head_dim, generator=g)
    with torch.no_grad():
        paths = mla.prefill_paths(attention, q_nope, q_pe, cache, table, seq_len)
        absorbed, decompressed = paths["absorbed"](), paths["decompressed"]()
    assert absorbed.shape == (seq_len, c.num_attention_heads, c.v_head_dim)
    assert (absorbed - decompressed).abs().max() < 1e-4 * decompressed.abs().max()


def test_prefill_flops_count_the_widths_each_path_runs():
    from labkit.engine import ModelConfig
    config = ModelConfig.tiny(hidden_size=1024, num_attention_heads=128,
                              num_key_value_heads=128, kv_lora_rank=512, qk_nope_head_dim=128,
                              qk_rope_head_dim=64, v_head_dim=128)
    f = mla.prefill_flops(config, 1)  # one pair: the projections plus one score and one value
    projections = 2 * 128 * (128 + 128) * 512
    assert f["absorbed"] - projections == 2 * 128 * (512 + 64 + 512)
    assert f["decompressed"] - projections == 2 * 128 * (256 + 256)  # 192 and 128 padded


def test_the_byte_claims_fail_when_the_schemes_trade_places():
    table = mla.scheme_table()
    assert all(c.held for c in mla.bytes_claims(table, 64.0, 4096))
    assert mla.per_byte_claim(table).held
    swapped = table.copy()
    swapped.iloc[[1, 3]] = table.iloc[[3, 1]].to_numpy()  # GQA's row where MLA's stands
    assert not any(c.held for c in mla.bytes_claims(swapped, 64.0, 4096))
    assert not mla.per_byte_claim(swapped).held


def test_the_absorption_and_kernel_claims_fail_on_values_that_contradict_them():
    check = {"score_diff": 1e-16, "output_diff": 1e-16, "output_scale": 2.0}
    flops = mla.decode_step_flops(context=4096)
    assert all(c.held for c in mla.absorption_claims(check, flops, 4096))
    swapped = flops.assign(**{"total GFLOP": flops["total GFLOP"].to_numpy()[::-1]})
    wrong = mla.absorption_claims({**check, "output_diff": 1e-3}, swapped, 4096)
    assert not any(c.held for c in wrong), "an output off by 1e-3 and the paths' costs swapped"
    kernel = {"rel_err": 2e-7, "tol": 1e-4, "dtype": "float32", "rank": 32, "rope": 16,
              "heads": 4, "lens_q": [1, 3, 0, 21]}
    assert mla.kernel_claim(kernel).held and not mla.kernel_claim({**kernel, "rel_err": 1e-3}).held


def test_a_range_reads_as_one_share_when_its_ends_round_alike():
    from labkit.lessons.mla.decode import share_span
    assert share_span(0.571, 0.574) == "57%"
    assert share_span(0.56, 0.58) == "56%-58%"


def test_the_decode_flops_formula_is_what_torch_counts_in_the_reference(monkeypatch):
    c = mla.counted_flops_claim(heads=4, context=37, rank=32, rope=8)
    assert c.held and "2 x heads x (k + v)" in c.text
    assert c.values["c"] == c.values["f"] == 2 * 4 * 37 * ((32 + 8) + 32)
    # a formula that forgot the value's multiply-adds disagrees with the counter
    monkeypatch.setattr(cache_bytes, "mla_flops",
                        lambda b, h, ctx, r, p: 2 * b * h * ctx * (r + p))
    assert not mla.counted_flops_claim(heads=4, context=37, rank=32, rope=8).held
