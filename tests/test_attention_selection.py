"""Backend registry, selection with reasons, and the compatibility matrix."""
import logging
import os

import pytest
import torch

import labkit  # noqa: F401
from labkit.attention import (
    BACKENDS,
    CPU_SLOW,
    PRIORITY,
    AttentionSpec,
    BackendUnavailable,
    compatibility_matrix,
    example_specs,
    explain,
    flash_attention_ref,
    matrix_markdown,
    paged_attention_ref,
    select_backend,
    selection_lines,
)
from labkit.attention.matrix import limits_table

GQA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
FP8 = dict(kv_cache_dtype="fp8_e4m3", kv_scale="per_kv_head")
HOPPER = dict(device="cuda", compute_capability=(9, 0))


def test_auto_takes_the_first_compatible_backend_in_priority_order():
    backend, passed = select_backend(AttentionSpec(**GQA, **HOPPER))
    assert backend.name == PRIORITY[0] == "triton"
    assert set(passed) == set(PRIORITY) - {"triton"}, "every backend not chosen is accounted for"
    assert all(passed[n] for n in passed), "each passed-over backend comes with a reason"


def test_skip_slow_passes_over_what_is_slow_on_cpu_and_says_so():
    spec = AttentionSpec(**GQA, device="cpu")
    assert select_backend(spec)[0].name == "triton", "it can serve the spec: the matrix view"
    backend, passed = select_backend(spec, skip_slow=True)
    assert backend.name == "sdpa", "the engine's view: the first that is not slow on CPU"
    assert all(CPU_SLOW[n] in passed[n] for n in CPU_SLOW)
    backend, passed = select_backend(spec, among=("triton", "reference"), skip_slow=True)
    assert backend.name == "reference" and set(passed) == {"triton"}


def test_auto_logs_its_choice_and_every_reason(caplog):
    with caplog.at_level(logging.INFO, logger="labkit.attention"):
        backend, _ = select_backend(AttentionSpec(num_q_heads=8, num_kv_heads=8, head_dim=96,
                                                  **HOPPER))
    assert backend.name == "sdpa"
    text = caplog.text
    assert "'sdpa'" in text, "the choice is logged"
    assert text.count("head_dim 96") == 2, "why triton and flex were passed over is logged"


def test_fp8_cache_passes_over_the_backends_without_it():
    backend, passed = select_backend(AttentionSpec(**GQA, **FP8, **HOPPER))
    assert backend.name == "triton"
    for name in ("flex", "sdpa"):
        assert any("fp8_e4m3" in r for r in passed[name]), f"{name} must say it lacks fp8"


def test_fp8_on_an_ampere_gpu_needs_a_newer_compute_capability():
    spec = AttentionSpec(**GQA, **FP8, device="cuda", compute_capability=(8, 0))
    backend, passed = select_backend(spec)
    assert backend.name == "reference"
    assert any("8.9" in r for r in passed["triton"])


def test_an_unsupported_scale_granularity_is_refused_with_its_name():
    spec = AttentionSpec(**GQA, kv_cache_dtype="fp8_e4m3", kv_scale="per_token", **HOPPER)
    with pytest.raises(BackendUnavailable) as err:
        select_backend(spec)
    assert "per_token" in str(err.value)


def test_mla_is_served_by_the_backends_that_declare_it_and_refused_by_the_rest_with_a_reason():
    spec = AttentionSpec(num_q_heads=128, num_kv_heads=1, head_dim=576, mla=True, **HOPPER)
    backend, passed = select_backend(spec)
    assert backend.name == "triton" and backend.mla is not None  # paged_mla_attention
    serving = {b.name for b in BACKENDS.values() if "MLA" in b.attention_kinds}
    assert serving == {"triton", "reference"}
    for name in set(PRIORITY) - serving:
        assert any("MLA" in r for r in passed[name]), f"{name} must refuse MLA with a reason"
    with pytest.raises(BackendUnavailable, match="MLA"):
        select_backend(spec, prefer="sdpa")


def test_a_backend_listing_mla_without_its_mla_call_is_refused():
    import dataclasses
    with pytest.raises(ValueError, match="needs its mla call"):
        dataclasses.replace(BACKENDS["triton"], mla=None)


def test_forcing_an_incompatible_backend_lists_every_reason():
    spec = AttentionSpec(num_q_heads=8, num_kv_heads=8, head_dim=96, **FP8, **HOPPER,
                         cuda_graph="uniform_decode")
    with pytest.raises(BackendUnavailable) as err:
        select_backend(spec, prefer="flex")
    message = str(err.value)
    for fragment in ("head_dim 96", "fp8_e4m3", "uniform_decode"):
        assert fragment in message, f"the error must name {fragment!r}:\n{message}"


def test_forcing_a_compatible_backend_is_honoured():
    backend, passed = select_backend(AttentionSpec(**GQA, **HOPPER), prefer="sdpa")
    assert backend.name == "sdpa"
    assert "forced" in passed["triton"][0]


def test_forcing_an_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match="known"):
        select_backend(AttentionSpec(**GQA), prefer="xformers")


@pytest.mark.parametrize("fields, message", [
    (dict(num_q_heads=6, num_kv_heads=4, head_dim=64), "multiple of num_kv_heads"),
    (dict(**GQA, kv_cache_dtype="fp8_e4m3"), "scale granularity"),
    (dict(**GQA, kv_cache_dtype="int4"), "kv_cache_dtype"),
    (dict(**GQA, block_size=12), "power of two"),
    (dict(**GQA, sliding_window=0), "sliding_window"),
    (dict(**GQA, cuda_graph="piecewise"), "cuda_graph"),
])
def test_a_malformed_spec_says_what_is_wrong(fields, message):
    with pytest.raises(ValueError, match=message):
        AttentionSpec(**fields)


def test_spec_names_its_attention_kind():
    assert AttentionSpec(8, 8, 64).attention_kind == "MHA"
    assert AttentionSpec(8, 2, 64).attention_kind == "GQA"
    assert AttentionSpec(8, 1, 64).attention_kind == "MQA"
    assert AttentionSpec(8, 8, 64, mla=True).attention_kind == "MLA"


def test_explain_gives_one_row_per_backend():
    rows = explain(AttentionSpec(**GQA, sliding_window=4096, **HOPPER))
    assert [r["backend"] for r in rows] == list(PRIORITY)
    assert all(r["compatible"] for r in rows)


def test_matrix_is_generated_from_the_declarations():
    df = compatibility_matrix(whose=False)
    assert list(df.columns) == list(PRIORITY)
    assert set(df.index.get_level_values("category")) == {"model", "cache", "request", "graph",
                                                          "hardware"}
    assert df.loc[("model", "MLA")].to_dict() == {"triton": "yes", "flex": "no", "sdpa": "no",
                                                  "reference": "yes"}
    assert df.loc[("graph", "CUDA Graph capture"), "triton"] == "uniform decode"
    md = matrix_markdown()
    matrix, limits = md.split("\n\n")
    assert matrix.count("\n") == len(df) + 1, "header, separator and one line per row"
    assert limits.count("\n") == len(limits_table()) + 1, "and one line per declared limit"
    assert "fp8_e4m3" in md


def test_every_backend_declares_a_known_graph_mode_and_devices():
    for backend in BACKENDS.values():
        assert backend.cuda_graphs in ("always", "uniform_decode", "never")
        assert set(backend.devices) <= {"cuda", "cpu"}


# --- the backends really run, and agree with the reference -----------------------------------

def _paged_batch(device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    lens_q, seq_lens, bs = [1, 3, 7], [29, 3, 40], 16
    table = torch.randperm(12, generator=g)[:9].reshape(3, 3).int()
    k, v = (torch.randn(12, bs, 2, 64, generator=g) for _ in range(2))
    q = torch.randn(sum(lens_q), 4, 64, generator=g)
    cu = torch.tensor([0, 1, 4, 11], dtype=torch.int32)
    to = dict(device=device)
    return (q.to(dtype=dtype, **to), k.to(dtype=dtype, **to), v.to(dtype=dtype, **to),
            table.to(**to), cu.to(**to), torch.tensor(seq_lens, dtype=torch.int32, **to))


@pytest.mark.parametrize("name", ["sdpa", "flex", "triton", "reference"])
def test_every_backend_agrees_with_the_reference_on_cpu(name):
    seed = int.from_bytes(os.urandom(4), "little")
    args = _paged_batch("cpu", torch.float32, seed)
    backend = BACKENDS[name]
    out = backend.paged(*args, window=20)
    err = (out.double() - paged_attention_ref(*args, window=20)).abs().max().item()
    assert err < 2e-4, f"seed {seed}: {name} paged max error {err:.2e}"
    q, k, v = args[0], args[1][:3].reshape(-1, 2, 64), args[2][:3].reshape(-1, 2, 64)
    cu_q, cu_k = args[4], torch.tensor([0, 20, 25, 48], dtype=torch.int32)
    err = (backend.flash(q, k, v, cu_q, cu_k).double()
           - flash_attention_ref(q, k, v, cu_q, cu_k)).abs().max().item()
    assert err < 2e-4, f"seed {seed}: {name} flash max error {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sdpa", "flex", "triton"])
def test_every_backend_agrees_with_the_reference_on_gpu_bf16(name):
    seed = int.from_bytes(os.urandom(4), "little")
    args = _paged_batch("cuda", torch.bfloat16, seed)
    ref = paged_attention_ref(*args)
    err = ((BACKENDS[name].paged(*args).double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, f"seed {seed}: {name} bf16 relative error {err:.2e}"


# --- side-by-side helpers (notebook 06) ------------------------------------------------------

def test_check_backends_runs_every_compatible_backend_against_the_reference():
    from labkit.lessons.attention_backends.compare import (
        AttentionWorkload,
        check_backends,
    )
    table = check_backends(AttentionWorkload((1, 3, 0), (20, 9, 4), window=6))
    assert list(table["backend"]) == list(PRIORITY)
    assert table["compatible"].all()
    assert (table["max_abs_error"] < 2e-4).all(), table.to_string()


def test_check_backends_reports_why_a_backend_was_skipped():
    from labkit.lessons.attention_backends.compare import (
        AttentionWorkload,
        check_backends,
    )
    table = check_backends(AttentionWorkload((1,), (20,), kv_cache_dtype="fp8_e4m3")).set_index("backend")
    assert not table.loc["sdpa", "compatible"] and "fp8" in table.loc["sdpa", "reasons"]
    # the fp8 path multiplies in float16: float16's rounding bounds it, not float32's
    assert table.loc["triton", "max_abs_error"] < 2e-3


def test_workload_counts_only_the_query_key_pairs_the_mask_keeps():
    from labkit.lessons.attention_backends.compare import AttentionWorkload
    # 2 new tokens at the end of 5 keys see 4 and 5 keys; with window 3 they see 3 each
    assert AttentionWorkload((2,), (5,)).visible_keys() == 9
    assert AttentionWorkload((2,), (5,), window=3).visible_keys() == 6
    assert AttentionWorkload((2,), (5,), num_q_heads=1, head_dim=8).flops() == 4 * 9 * 8


def test_tiling_removes_the_score_matrix_from_hbm_traffic():
    from labkit.lessons.attention_backends.compare import attention_io, tile_io
    io = attention_io(4096, 4096, num_heads=1, head_dim=128, block_m=128)
    assert io["tiled_bytes"] < io["naive_bytes"]
    assert tile_io(128, 64, 128)["flops_per_byte"] == 128.0, "4*M*N*D FLOPs over 2*N*D*2 bytes"


def test_example_models_select_as_the_notebook_describes():
    chosen = {}
    for name, spec in example_specs().items():
        try:
            chosen[name] = select_backend(spec)[0].name
        except BackendUnavailable:
            chosen[name] = None
    assert chosen["GQA + fp8 KV cache"] == "triton"
    assert chosen["MLA (DeepSeek-V3)"] == "triton", "paged_mla_attention serves the latent cache"


def test_the_mla_example_caches_one_shared_576_wide_latent_per_token():
    spec = example_specs()["MLA (DeepSeek-V3)"]
    assert (spec.num_q_heads, spec.num_kv_heads, spec.head_dim) == (128, 1, 512 + 64), \
        "one latent (512 compressed K/V + 64 RoPE key) shared by all 128 query heads"
    assert spec.attention_kind == "MLA"


def test_selection_lines_match_what_is_logged(caplog):
    spec = AttentionSpec(**GQA, **FP8, **HOPPER)
    with caplog.at_level(logging.INFO, logger="labkit.attention"):
        backend, passed = select_backend(spec)
    lines = selection_lines(backend.name, passed, forced=False, spec=spec)
    assert [r.getMessage() for r in caplog.records] == lines


# --- bad input: AttentionSpec / select_backend -------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(mla="no"), TypeError, "mla must be True or False"),
    (dict(mixed_batch="no"), TypeError, "mixed_batch must be True or False"),
    (dict(compute_capability=9), ValueError, r"compute_capability must be a \(major, minor\)"),
    (dict(dtype=torch.int8), ValueError, "dtype must be a floating-point torch dtype"),
])
def test_attention_spec_fields_of_the_wrong_kind_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        AttentionSpec(4, 2, 64, **kwargs)


def test_select_backend_names_what_it_was_given():
    with pytest.raises(TypeError, match="spec must be an AttentionSpec, got dict"):
        select_backend({"num_q_heads": 4})
    with pytest.raises(ValueError, match=r"among holds unknown backends \['bogus'\]; known"):
        select_backend(AttentionSpec(4, 2, 64), among=["bogus"])
    with pytest.raises(TypeError, match=r"among must be a list of backend names"):
        select_backend(AttentionSpec(4, 2, 64), among="sdpa")
