"""The attention backends say whose limits they have: every "no"/"never" of the compatibility
matrix names whose limit it is (labkit's wrapper, labkit's kernel, the library or the hardware),
and selection's reasons carry it. (The PyTorch peers' fairness and agreement with the reference:
test_attention_peers.py.)"""
import dataclasses

import pytest

import labkit  # noqa: F401
from labkit.attention import BACKENDS, AttentionSpec, select_backend
from labkit.attention.backends import LIMITED_BY, Limit
from labkit.attention.matrix import (
    CHECKS,
    compatibility_matrix,
    limits_table,
    unexplained_cells,
)

HOPPER = {"device": "cuda", "compute_capability": (9, 0)}


def test_every_no_and_never_of_the_matrix_says_whose_limit_it_is():
    assert unexplained_cells() == []
    table = limits_table()
    assert set(table["limited by"]) <= set(LIMITED_BY)
    assert all(len(why) > 20 for why in table["why"])
    for name, b in BACKENDS.items():
        assert set(b.limits) <= set(CHECKS), f"{name} names a check the matrix lacks"


def test_a_never_without_a_declared_limit_is_caught():
    sdpa = BACKENDS["sdpa"]
    bare = dataclasses.replace(sdpa, limits={k: v for k, v in sdpa.limits.items()
                                             if k != "CUDA Graph capture"})
    assert unexplained_cells({"sdpa": bare}) == [("sdpa", "CUDA Graph capture", "never")]


def test_the_limits_the_issue_names_are_whose_they_are():
    assert BACKENDS["sdpa"].limit("CUDA Graph capture").by == "labkit's wrapper"
    assert BACKENDS["sdpa"].limit("paged KV").by == "the library"
    assert BACKENDS["flex"].limit("CUDA Graph capture").by == "labkit's wrapper"
    fp8 = BACKENDS["triton"].limit("fp8 cache needs")
    assert fp8.by == "labkit's kernel" and fp8.labkits and "8.9" in fp8.why
    df = compatibility_matrix()
    assert df.loc[("graph", "CUDA Graph capture"), "sdpa"] == "never (limit: labkit's wrapper)"
    assert df.loc[("hardware", "fp8 cache needs"), "triton"] == "8.9+ (limit: labkit's kernel)"


def test_selection_reasons_say_whose_limit_refused():
    spec = AttentionSpec(32, 8, 128, cuda_graph="uniform_decode", **HOPPER)
    _, passed = select_backend(spec)
    assert any("never" in r and r.endswith("limit of labkit's wrapper") for r in passed["sdpa"])
    fp8_on_ampere = AttentionSpec(32, 8, 128, kv_cache_dtype="fp8_e4m3", kv_scale="per_kv_head",
                                  device="cuda", compute_capability=(8, 0))
    _, passed = select_backend(fp8_on_ampere)
    assert any("8.9" in r and r.endswith("limit of labkit's kernel") for r in passed["triton"])


@pytest.mark.parametrize("by, why", [("the weather", "it rained"), ("labkit's wrapper", " ")])
def test_a_limit_names_a_known_party_and_a_reason(by, why):
    with pytest.raises(ValueError):
        Limit(by, why)


def test_a_limit_for_a_check_the_matrix_lacks_is_refused():
    odd = dataclasses.replace(BACKENDS["sdpa"], limits={"warp size": Limit("the hardware", "x")})
    with pytest.raises(ValueError, match="not checks of the matrix"):
        compatibility_matrix({"sdpa": odd})
