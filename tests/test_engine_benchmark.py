"""benchmarks/engine.py's quick path, run in-process: the benchmark measures what it claims.

Every section is there, each counted exactly the output tokens the workload asked for, the
transformers peer generated the same greedy tokens as labkit (so both did the same work), and
the printed ratios are the measured throughputs divided. One run serves every test.
"""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("benchmarks_engine",
                                                  ROOT / "benchmarks" / "engine.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


bench = load_benchmark()


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("engine_bench")
    return bench.run(out, quick=True), out


def test_every_section_ran_without_error(quick):
    results, _ = quick
    assert set(results["sections"]) == set(bench.SECTIONS)
    failed = {k: v["error"] for k, v in results["sections"].items() if "error" in v}
    assert not failed, f"sections failed on the quick path: {failed}"


def test_each_section_counts_exactly_the_requested_output_tokens(quick):
    results, _ = quick
    _, olens, _ = bench.BenchmarkConfig.small().requests()
    assert results["workload"]["requested_output_tokens"] == sum(olens)
    for name, s in results["sections"].items():
        assert s["output_tokens"] == sum(olens), (
            f"{name} counted {s['output_tokens']} output tokens, the workload asks for "
            f"{sum(olens)}: padding or early stops were counted, or requests were lost")


def test_transformers_generates_labkits_greedy_tokens(quick):
    results, _ = quick
    agreement = results["greedy_agreement"]
    assert (agreement["identical"], agreement["first_token_identical"]) == (8, 8), (
        f"labkit and transformers disagree on {8 - agreement['identical']} of 8 requests: the "
        "peer does different work (padding, positions or weights differ), so its speed is no "
        "comparison")


def test_ratios_are_per_round_throughputs_divided_with_their_range(quick):
    results, _ = quick
    s = results["sections"]
    for name, sec in s.items():
        assert sec["seconds"] > 0 and sec["tokens_per_s"] == pytest.approx(
            sec["output_tokens"] / sec["seconds"]), name
        assert len(sec["rounds_tokens_per_s"]) == 3, f"{name}: one pass per round"
        assert sec["tokens_per_s_low"] <= sec["tokens_per_s"] <= sec["tokens_per_s_high"]
    for key, (a, b) in bench.RATIOS.items():
        per = [x / y for x, y in zip(s[a]["rounds_tokens_per_s"], s[b]["rounds_tokens_per_s"])]
        r = results["ratios"][key]
        assert r["values"] == pytest.approx(per), key
        assert r["low"] <= results[key] == r["median"] <= r["high"]


def test_a_target_is_met_only_when_every_round_clears_it():
    from labkit.lessons.putting_it_together.engine_report import verdict
    from labkit.measure.rounds import Spread
    assert verdict(Spread.of([2.1, 2.4, 2.2]), 2.0).startswith("meets")
    assert "straddles" in verdict(Spread.of([1.9, 2.4, 2.2]), 2.0), \
        "a median above the target with one round below it is noise, not a result"
    assert verdict(Spread.of([1.5, 1.7, 1.6]), 2.0).startswith("misses")
    assert bench.BenchmarkConfig().rounds >= 3
    with pytest.raises(ValueError, match="rounds must be at least 3"):
        bench.BenchmarkConfig(rounds=2)


def test_latencies_are_reported_for_every_section(quick):
    for name, sec in quick[0]["sections"].items():
        assert sec["ttft_median_ms"] > 0 and sec["tpot_median_ms"] > 0, (name, sec)


def test_shared_system_prompt_is_served_from_the_prefix_cache(quick):
    s = quick[0]["sections"]
    assert s["prefix_cached"]["prefix_hit_rate"] > 0.3, s["prefix_cached"]
    assert s["prefix_uncached"]["prefix_hit_rate"] == 0.0 == s["labkit"]["prefix_hit_rate"]
    assert all(sec["triton_compiles"] == 0 for name, sec in s.items() if name != "transformers")


def test_csv_and_json_hold_one_row_per_section(quick):
    import json

    results, out = quick
    rows = (out / "engine.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == list(bench.SECTIONS)
    assert json.loads((out / "engine.json").read_text())["sections"].keys() == \
        results["sections"].keys()


def test_a_failing_peer_is_reported_and_the_other_sections_still_run(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise RuntimeError("peer exploded")

    monkeypatch.setattr(bench, "TransformersPeer", broken)
    results = bench.run(None, quick=True)
    assert results["sections"]["transformers"] == {"error": "RuntimeError: peer exploded"}
    assert results["ratio_vs_transformers"] is None and not results["target"]["met"]
    assert all("error" not in results["sections"][n] for n in bench.SECTIONS[:-1])
    table_line = [ln for ln in capsys.readouterr().out.splitlines()
                  if ln.startswith("transformers ")]
    assert table_line and table_line[-1].split() == [
        "transformers", "FAILED:", "RuntimeError:", "peer", "exploded"], table_line


def test_the_workload_is_fixed_by_its_seed_and_within_its_ranges():
    wl = bench.BenchmarkConfig()
    prompts, olens, system = wl.requests()
    again = wl.requests()
    assert (prompts, olens, system) == again
    assert len(prompts) == 256 and len(system) == 1024
    assert all(64 <= len(p) <= 2048 for p in prompts) and all(32 <= n <= 512 for n in olens)
    assert all(0 <= t < 32000 for p in prompts for t in p)


def test_transformers_batches_group_similar_prompt_lengths():
    from labkit.lessons.putting_it_together.transformers_peer import hf_batches

    prompts = [[0] * n for n in (9, 2, 7, 3, 8)]
    assert hf_batches(prompts, 2) == [[1, 3], [2, 4], [0]]


def test_step_kinds_partition_the_run_by_how_each_step_ran(quick):
    """Each section charges every step the time since the previous step ended: the charges
    add up to the first step's start to the last one's end, and every step is counted."""
    from types import SimpleNamespace as NS

    def rec(graph, start, end, tokens):
        return NS(graph=graph, start_s=start, end_s=end, stats=NS(num_tokens=tokens))

    # async scheduling: the second step starts before the first ends
    kinds = bench.step_kinds([rec("eager", 1.0, 1.5, 300), rec("full", 1.4, 1.6, 8),
                              rec("full", 1.6, 1.7, 8), rec("piecewise", 1.7, 2.0, 40)])
    assert kinds == {"eager": {"steps": 1, "seconds": pytest.approx(0.5), "tokens": 300},
                     "full": {"steps": 2, "seconds": pytest.approx(0.2), "tokens": 16},
                     "piecewise": {"steps": 1, "seconds": pytest.approx(0.3), "tokens": 40}}
    assert bench.step_kinds([]) == {}
    for name, sec in quick[0]["sections"].items():
        if name != "transformers":
            assert sum(k["steps"] for k in sec["step_kinds"].values()) > 0, name


def test_mode_gain_ceiling_is_the_run_over_its_decode_graph_steps():
    section = {"step_kinds": {"eager": {"steps": 3, "seconds": 1.0, "tokens": 900},
                              "full": {"steps": 50, "seconds": 4.0, "tokens": 400}}}
    c = bench.mode_gain_ceiling(section)
    assert c == {"steps": 3, "of_steps": 53, "share": pytest.approx(0.2),
                 "ceiling": pytest.approx(1.25)}
    # a run with no decode graph (a CPU's full_decode_only is "none") has no ceiling
    assert bench.mode_gain_ceiling({"step_kinds": {"eager": section["step_kinds"]["eager"]}}) \
        is None
    assert bench.mode_gain_ceiling(None) is None and bench.mode_gain_ceiling({}) is None
