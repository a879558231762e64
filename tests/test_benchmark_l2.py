"""Every benchmark says what its timings read their data from, and the benchmarks that decide
per section flush the L2 exactly where a working set fits in twice it (on a CPU, a stand-in
cache of 1 MiB)."""
import sys
from pathlib import Path

import pytest

from labkit.measure import bench

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.py")), ids=lambda p: p.name)
def test_every_benchmark_states_what_its_timings_read_from(path):
    source = path.read_text()
    assert "L2" in source and ("l2_statement" in source or "ENGINE_STEPS_L2" in source
                               or "not flushed" in source or "not a factor" in source), \
        f"{path.name} times GPU work without saying whether the L2 was flushed"


@pytest.fixture
def attention(monkeypatch):
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import benchmarks.attention as module
    monkeypatch.setattr(module, "DEV", "cpu")
    monkeypatch.setattr(bench, "cache_bytes", lambda dev: MiB)
    flushes = []
    monkeypatch.setattr(bench, "l2_flush", lambda dev: lambda: flushes.append(1))
    return module, flushes


def test_a_section_whose_working_set_fits_is_flushed_and_says_so(attention):
    module, flushes = attention
    res = module.timed({"a": lambda: lambda: None, "b": lambda: lambda: None},
                       {"a": 2 * MiB, "b": 64 * MiB}, rounds=3, repeats=2)
    assert len(flushes) == 2 * 3 * 2, "one flush per sample, every peer of the section"
    assert res["a"]["l2"] == "CPU cache flushed between samples (working set 2 MiB)"
    assert res["b"]["l2"].startswith("CPU cache flushed"), "the rounds stay comparable"


def test_a_section_over_twice_the_cache_is_not_flushed_and_says_so(attention):
    module, flushes = attention
    res = module.timed({"a": lambda: lambda: None}, {"a": 2 * MiB + 1}, rounds=3, repeats=2)
    assert flushes == []
    assert res["a"]["l2"] == ("working set 2 MiB > 2x CPU cache (2 MiB): read from memory "
                              "every call")


def test_the_mla_lesson_passes_the_flush_through(monkeypatch):
    from labkit.lessons.mla import decode
    flushes = []
    monkeypatch.setattr(bench, "l2_flush", lambda dev: lambda: flushes.append(1))
    decode.timed({"a": lambda: None}, {"a": 1}, rounds=3, device="cpu", flush_l2=True)
    assert len(flushes) == 3 * 20
