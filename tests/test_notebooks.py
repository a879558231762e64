"""Every notebook runs headless through papermill on CPU with QUICK sizes, as CI does.

Executed copies go to test-results/notebooks/ (CI can keep the folder); each notebook runs once a
session (``executed_notebook`` in conftest.py), shared with the browser test.
"""
import json

import pytest

from labkit.tools.run_notebooks import (NotebookRun, execute, notebooks, slowest_cells,
                                        summary_table)

MAX_EXECUTED_BYTES = 2_000_000
NOTEBOOKS = notebooks()


def test_the_sequence_starts_with_the_tour_and_launch_overhead():
    assert [p.stem for p in NOTEBOOKS[:2]] == ["00_tour", "01_launch_overhead"]


@pytest.mark.notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_shows_what_it_promises(path, executed_notebook):
    run = executed_notebook(path)
    assert run.status == "ok", f"{path.name} failed; executed copy in {run.output}\n{run.error}"
    assert run.figures >= run.expected_figures, (
        f"{path.name} drew {run.figures} plotly figures, its metadata promises "
        f"{run.expected_figures}")
    assert len(run.claims) >= 5 and run.claims_failed == 0, (
        f"{path.name}: {len(run.claims)} claims, {run.claims_failed} did not hold")
    assert run.time_budget_s, f"{path.name} has no labkit.time_budget_s in its metadata"
    assert run.seconds <= run.time_budget_s, (
        f"{path.name} took {run.seconds:.0f} s with QUICK=True, over its {run.time_budget_s} s budget")
    assert run.slowest_cells and run.slowest_cells[0][1] > 0, "papermill's cell durations"
    assert run.size_bytes < MAX_EXECUTED_BYTES, (
        f"executed {path.name} is {run.size_bytes / 1e6:.1f} MB; keep it under 2 MB "
        "(thin the timelines, or show fewer points)")


def test_a_run_names_its_slowest_cells_where_its_time_went():
    nb = {"cells": [{"id": "a", "metadata": {"papermill": {"duration": 1.25}}},
                    {"id": "b", "metadata": {"papermill": {"duration": 9.0}}},
                    {"id": "c", "metadata": {}},  # a markdown cell: papermill times none
                    {"id": "d", "metadata": {"papermill": {"duration": 3.04}}}]}
    assert slowest_cells(nb, top=2) == [("b", 9.0), ("d", 3.0)]
    assert slowest_cells({}) == []
    run = NotebookRun("11_x", "ok", 13.3, 1, 1, 10, "", 0, slowest_cells=[("b", 9.0)])
    assert "slowest cells: b 9.0 s" in summary_table([run])


def test_an_unknown_parameter_is_an_error_not_a_silent_default(tmp_path):
    with pytest.raises(ValueError, match="declares no parameter"):
        execute(NOTEBOOKS[0], tmp_path, {"DEVICE": "auto", "QUIK": True})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_committed_clean_and_follows_the_conventions(path):
    nb = json.loads(path.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    dirty = [i for i, c in enumerate(code) if c.get("outputs") or c.get("execution_count")]
    assert not dirty, f"{path.name}: code cells {dirty} carry outputs; commit notebooks clean"
    first = code[0]
    assert "parameters" in first.get("metadata", {}).get("tags", []), \
        f"{path.name}: the first code cell must be tagged 'parameters'"
    src = "".join(first["source"])
    assert "DEVICE" in src and "QUICK" in src, f"{path.name}: parameters need DEVICE and QUICK"
    assert "assert" in "".join(code[-1]["source"]), \
        f"{path.name}: the last cell must assert what the notebook demonstrated"
    meta = nb["metadata"].get("labkit", {})
    assert meta.get("expected_figures", 0) >= 1 and meta.get("time_budget_s"), \
        f"{path.name}: metadata.labkit needs expected_figures and time_budget_s"
