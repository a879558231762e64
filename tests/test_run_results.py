"""A gpu-check run times each benchmark once: its notebooks read what the run's benchmarks saved
(labkit.tools.run_results), never a file from before the run or from another machine."""
import json
import os
import time
from pathlib import Path

import pytest

from labkit.lessons.attention_backends import roofline as rl
from labkit.tools import gpu_check
from labkit.tools.run_results import RESULTS_ENV, STARTED_ENV, run_environment, this_run

HERE = {"gpu": "NVIDIA H200", "torch": "2.11.0", "driver": "580.159.04"}


def saved(folder: Path, results: dict, fingerprint=HERE, name="attention.json") -> Path:
    path = folder / name
    path.write_text(json.dumps({"fingerprint": fingerprint, "results": results}))
    return path


@pytest.fixture
def run_folder(tmp_path, monkeypatch):
    for key, value in run_environment(tmp_path, time.time() - 60).items():
        monkeypatch.setenv(key, value)
    return tmp_path


def test_nothing_is_read_outside_a_gpu_check_run(tmp_path, monkeypatch):
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    saved(tmp_path, {"copy_gbps": 1.0})
    assert this_run("attention.json", HERE) is None


def test_this_runs_results_are_read_on_the_machine_that_wrote_them(run_folder):
    saved(run_folder, {"copy_gbps": 4250.0})
    assert this_run("attention.json", HERE) == {"copy_gbps": 4250.0}
    assert this_run("missing.json", HERE) is None
    assert this_run("attention.json", {**HERE, "gpu": "NVIDIA H100"}) is None, "another machine"


def test_a_file_written_before_the_run_started_is_not_read(run_folder, monkeypatch):
    path = saved(run_folder, {"copy_gbps": 4250.0})
    monkeypatch.setenv(STARTED_ENV, repr(path.stat().st_mtime + 1.0))
    assert this_run("attention.json", HERE) is None


def test_the_folder_handed_to_notebooks_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = run_environment(Path("results/benchmarks"), 5.0)
    assert Path(env[RESULTS_ENV]).is_absolute() and float(env[STARTED_ENV]) == 5.0


def test_the_attention_notebooks_read_the_runs_benchmark_and_say_so(run_folder, monkeypatch):
    from labkit.device import fingerprint
    import labkit.tools.record as record
    calls = []
    monkeypatch.setattr(record, "resolve", lambda spec: lambda *a, **k: calls.append(k) or {})
    saved(run_folder, {"copy_gbps": 4250.0, "registry": {"error": "RuntimeError: no"}},
          fingerprint())
    data = rl.live_results()
    assert data["copy_gbps"] == 4250.0 and calls == []
    assert rl.live_source(data, "NVIDIA H200") == f"{rl.MEASURED_EARLIER} on NVIDIA H200"
    rl.live_results(with_registry=True)  # the run's registry section failed: measure it now
    assert calls == [{"with_registry": True}]
    saved(run_folder, {"copy_gbps": 1.0, "registry": {"error": [None], "us": [1.0]}},
          fingerprint())
    assert rl.live_results(with_registry=True)["copy_gbps"] == 1.0 and len(calls) == 1
    assert rl.live_source({}, "NVIDIA H200") == "measured now on NVIDIA H200"


def test_the_mla_notebook_reads_the_runs_decode_benchmark_and_says_so(run_folder, monkeypatch):
    from labkit.device import fingerprint
    from labkit.lessons.mla import decode
    calls = []
    monkeypatch.setattr(decode, "measure_decode", lambda **k: calls.append(k) or {"cases": {}})
    case = {"us": 105.2, "gbps": 2870.0}
    saved(run_folder, {"copy_gbps": 4278.0, "ridge": 177.0,
                       "sections": {"batch 64": {"MLA 16 heads": case}, "batch 1": {}}},
          fingerprint(), name="mla_decode.json")
    measured, where = decode.live_decode(rounds=5)
    assert measured["cases"] == {"MLA 16 heads": case} and measured["ridge"] == 177.0
    assert where == decode.MEASURED_EARLIER and calls == []
    saved(run_folder, {"sections": {"batch 64": {"error": "RuntimeError: no"}}}, fingerprint(),
          name="mla_decode.json")  # the benchmark's section failed: measure it now
    assert decode.live_decode(rounds=3) == ({"cases": {}}, "timed here")
    assert calls == [{"rounds": 3, "device": "cuda"}]


@pytest.mark.parametrize("skip", [[], ["benchmarks"]])
def test_gpu_check_runs_the_benchmarks_first_and_hands_them_to_the_notebooks(tmp_path,
                                                                             monkeypatch, skip):
    order, seen = [], []
    monkeypatch.setattr(gpu_check, "select_device", lambda device: None)
    monkeypatch.setattr(gpu_check, "_step", lambda name, cmd, out, timeout_s: order.append(name)
                        or {"step": name, "rc": 0, "seconds": 0.0})
    monkeypatch.setattr(gpu_check, "notebooks", lambda: [Path("notebooks/06_x.ipynb")])

    class Run:
        notebook, status, seconds, error, claims, claims_failed = "06_x", "ok", 1.0, "", [], 0
        slowest_cells = [("06-03", 0.75)]

    def execute(path, out_dir, parameters):
        order.append(path.stem)
        seen.append(os.environ.get(RESULTS_ENV))
        return Run()
    monkeypatch.setattr(gpu_check, "execute", execute)
    monkeypatch.setattr(gpu_check, "summary_table", lambda runs: "")
    monkeypatch.setattr(gpu_check, "write_claims", lambda runs, path: None)
    monkeypatch.delenv(RESULTS_ENV, raising=False)
    out = tmp_path / "out"
    assert gpu_check.main(["--out", str(out), "--skip", "tests", *skip,
                           "--benchmarks", "attention"]) == 0
    if skip:
        assert order == ["06_x"] and seen == [None], "no benchmarks: the notebook measures"
    else:
        assert order == ["bench-attention", "06_x"], "benchmarks before notebooks"
        assert seen == [str((out / "benchmarks").resolve())]
    assert RESULTS_ENV not in os.environ, "the variable is set for the notebooks only"
    summary = json.loads((out / "summary.json").read_text())
    assert summary[-1]["slowest_cells"] == [["06-03", 0.75]], "where the notebook's time went"
