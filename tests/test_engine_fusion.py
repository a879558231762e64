"""The engine's model three ways (plain ops, hand-fused Triton, Inductor): the kernel census, the
table and the claims it makes."""
import pandas as pd
import pytest
import torch

from labkit.engine import ModelConfig, random_model
from labkit.lessons.torch_compile import engine_fusion as ef

HAND, IND, EAGER = "hand-fused Triton", "Inductor (compile=True)", "eager ops"
NAMES = {
    EAGER: ["nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT",
            "void at::native::vectorized_elementwise_kernel<8, at::native::BinaryFunctor>",
            "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>",
            "store_kv_kernel", "paged_attention_kernel", "_merge_splits_kernel"] * 3,
    HAND: ["_add_rms_norm_kernel", "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "_rope_kernel",
           "store_kv_kernel", "paged_attention_kernel", "_silu_mul_kernel",
           "void at::native::index_elementwise_kernel<128, 4>"],
    IND: ["triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
          "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "triton_poi_fused_cat_mul_neg_1",
          "triton_poi_fused_cat_mul_neg_3",
          "paged_attention_kernel", "triton_poi_fused_mul_silu_2"],
}


def table(hand=(1.00, 0.98, 1.02), ind=(1.20, 1.18, 1.22), build=(3.0, 40.0)):
    rows = []
    for variant, (ms, lo, hi), b in ((HAND, hand, build[0]), (IND, ind, build[1]),
                                     (EAGER, (2.0, 1.9, 2.1), build[0])):
        for batch in (1, 64):
            rows.append({"variant": variant, "batch": batch, "build_s": b,
                         "compile_s": b - 3.0, "graph_ms": ms, "graph_low_ms": lo,
                         "graph_high_ms": hi})
    return pd.DataFrame(rows)


def test_kernels_are_named_by_what_they_do():
    fam = ef.kernel_family
    assert fam("_add_rms_norm_kernel") == "hand-fused: residual add + RMSNorm"
    assert fam("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0") == \
        "Inductor: _to_copy_add_mean_mul_pow_rsqrt"
    assert fam("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT") == "matmul"
    assert fam("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "matmul"
    assert fam("paged_attention_kernel") == fam("_merge_splits_kernel") == "attention"
    assert fam("store_kv_kernel") == "KV store"
    assert fam("_gemv_kernel") == "hand-fused: matmul with norm / RoPE / SiLU x up (one row)"
    assert fam("void at::native::vectorized_elementwise_kernel<4>") == "torch op"
    counts = ef.census_table(NAMES)
    assert counts.loc["torch op", EAGER] == 6 and counts.loc["torch op", IND] == 0
    assert counts.sum().to_dict() == {k: len(v) for k, v in NAMES.items()}
    assert counts.loc["torch op", HAND] == 1


def test_the_census_claims_hold_and_fail_on_each_perturbation():
    made = ef.census_claims(NAMES)
    assert all(c.held for c in made), [c.text for c in made if not c.held]
    more = dict(NAMES, **{HAND: NAMES[HAND] * 4})
    assert not ef.census_claims(more)[0].held, "more launches than plain ops"
    no_inductor = dict(NAMES, **{IND: NAMES[IND][1:2] + ["void at::native::x"] * 2})
    assert not ef.census_claims(no_inductor)[1].held
    assert ef.rope_launches(NAMES[HAND]) == 1 and ef.rope_launches(NAMES[IND]) == 2
    one_rotation = dict(NAMES, **{IND: [n for n in NAMES[IND] if not n.endswith("neg_3")]})
    assert not ef.census_claims(one_rotation)[2].held, "as many rotations as labkit's"
    in_gemv = dict(NAMES, **{HAND: [n for n in NAMES[HAND] if n != "_rope_kernel"]})
    assert ef.census_claims(in_gemv)[2].held, "RoPE folded into the GEMV: no launch of its own"
    assert "launches 0 RoPE kernels" in ef.census_claims(in_gemv)[2].text
    none = dict(in_gemv, **{IND: [n for n in NAMES[IND] if "neg" not in n]})
    assert not ef.census_claims(none)[2].held, "no rotation on either side"


def test_the_step_claims_hold_only_where_every_round_agrees():
    made = ef.step_claims(table())
    assert all(c.held for c in made) and len(made) == 3  # batch 1, batch 64, build time
    assert "hand-fused Triton step takes 1.000 ms" in made[0].text
    assert not ef.step_claims(table(ind=(1.05, 1.01, 1.10)))[0].held, \
        "ranges that overlap settle nothing"
    swapped = ef.step_claims(table(hand=(1.20, 1.18, 1.22), ind=(1.00, 0.98, 1.02)))
    assert swapped[0].held and "Inductor (compile=True) step takes 1.000" in swapped[0].text
    assert not ef.step_claims(table(build=(40.0, 3.0)))[2].held


def test_unknown_variants_are_refused_by_name():
    model = random_model(ModelConfig.tiny(torch_dtype="float32"), device="cpu")
    with pytest.raises(ValueError, match="VARIANTS"):
        ef.fusion_table(model, variants=("fused",))


def test_the_table_on_cpu_times_the_plain_engine():
    model = random_model(ModelConfig.tiny(torch_dtype="float32"), device="cpu")
    t, names = ef.fusion_table(model, batches=(1, 2), context_len=40, rounds=3,
                               variants=(EAGER,))
    assert list(t.batch) == [1, 2] and (t.variant == EAGER).all()
    assert (t.build_s > 0).all() and (t.compile_s == 0).all() and (t.graphs == 0).all()
    assert t.eager_ms.notna().all() and names == {EAGER: []}


@pytest.mark.gpu
def test_gpu_the_three_ways_on_the_tiny_model():
    model = random_model(ModelConfig.tiny(torch_dtype="bfloat16"), device="cuda",
                         dtype=torch.bfloat16)
    t, names = ef.fusion_table(model, batches=(1, 4), context_len=64, rounds=3)
    assert set(t.variant) == set(ef.VARIANTS) and t.graph_ms.notna().all()
    counts = ef.census_table(names)
    assert counts.loc["hand-fused: RoPE", HAND] > 0
    assert any(f.startswith("Inductor") for f in counts.index if counts.loc[f, IND] > 0)
    assert len(names[HAND]) < len(names[EAGER]) and len(names[IND]) < len(names[EAGER])
    assert t.set_index("variant").loc[IND, "compile_s"].iloc[0] > 0


def test_the_table_view_keeps_what_the_issue_asks_with_each_range():
    full = table().assign(kernels=134, eager_ms=9.5, capture_s=3.0, graphs=1146)
    view = ef.table_view(full)
    assert list(view.columns) == ["variant", "batch", "kernels", "replayed ms (range)",
                                  "eager_ms", "build_s", "compile_s", "graphs"]
    first = full.iloc[0]
    assert view["replayed ms (range)"].iloc[0] == (
        f"{first.graph_ms:.3f} ({first.graph_low_ms:.3f}-{first.graph_high_ms:.3f})")
