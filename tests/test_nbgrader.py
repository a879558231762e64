"""nbgrader releases the exercises as `make student` writes them; labkit's checker grades them.

The graded run uses notebook 07's exercise section (its exercises are arithmetic and a scheduler:
seconds on a CPU), through nbgrader's own command line in a temporary course folder.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
# The hub extra (make venv installs it; a GPU host running `make gpu-check` has only the
# notebook stack): without it these tests cannot import what they test.
pytest.importorskip("nbgrader", reason="needs the hub extra: pip install -e .[hub]")
from nbgrader.api import Gradebook

from labkit.teaching.exercises import all_exercises
from labkit.tools.nbgrader_source import exercises_only, write_course
from labkit.tools.run_notebooks import notebooks
from labkit.tools.student import student_notebook

ASSIGNMENT = "07_prefill_vs_decode"


def nbgrader(course: Path, *args: str) -> None:
    # nbgrader runs alembic (its database migrations) by name: the venv's bin must be on PATH
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    run = subprocess.run([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"nbgrader {' '.join(args)} failed:\n{run.stdout}\n{run.stderr}"


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def submit(course: Path, learner: str, nb_cells: list[dict]) -> None:
    release = course / "release" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    nb = json.loads(release.read_text())
    nb["cells"] = nb_cells
    folder = course / "submitted" / learner / ASSIGNMENT
    folder.mkdir(parents=True)
    (folder / release.name).write_text(json.dumps(nb))


@pytest.fixture(scope="module")
def course(tmp_path_factory):
    """Release the assignment, then autograde an untouched copy and one with the solutions in."""
    out = tmp_path_factory.mktemp("course")
    write_course(out, [ASSIGNMENT], only_exercises=True)
    nbgrader(out, "generate_assignment", ASSIGNMENT)
    released = cells(out / "release" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb")
    solutions = cells(out / "source" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb")
    submit(out, "unsolved", released)
    submit(out, "solved", [
        {**r, "source": s["source"]} if r["metadata"].get("nbgrader", {}).get("solution") else r
        for r, s in zip(released, solutions)])
    nbgrader(out, "autograde", ASSIGNMENT)
    return out


def scores(course: Path, learner: str) -> dict[str, tuple[float, float]]:
    with Gradebook(f"sqlite:///{course / 'gradebook.db'}", course_id="labkit") as gb:
        nb = gb.find_submission_notebook(ASSIGNMENT, ASSIGNMENT, learner)
        return {g.name: (g.auto_score, g.max_score) for g in nb.grades}


def test_every_exercise_labkit_checks_is_graded_once_in_some_assignment(tmp_path):
    graded = []
    for path in write_course(tmp_path).values():
        graded += [c["metadata"]["nbgrader"]["grade_id"] for c in cells(path)
                   if c["metadata"].get("nbgrader", {}).get("grade")]
    assert sorted(graded) == sorted(f"check_{e.replace('.', '_')}" for e in all_exercises())


def test_a_check_cell_is_graded_by_labkits_checker_and_read_only(tmp_path):
    path = write_course(tmp_path, [ASSIGNMENT])[ASSIGNMENT]
    check_cell = next(c for c in cells(path) if c["metadata"].get("nbgrader", {}).get("grade"))
    meta = check_cell["metadata"]["nbgrader"]
    assert meta["locked"] and meta["points"] > 0
    assert source(check_cell).splitlines() == [
        'result_07_1 = check("07.1", decode_step_cost)',
        "### BEGIN HIDDEN TESTS", "assert result_07_1.passed, result_07_1", "### END HIDDEN TESTS",
        "result_07_1"]


def test_the_release_is_the_student_copy_cell_for_cell(course):
    original = next(p for p in notebooks() if p.stem == ASSIGNMENT)
    student = student_notebook(exercises_only(json.loads(original.read_text())))["cells"]
    released = cells(course / "release" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb")
    assert [source(c) for c in released] == [source(c) for c in student]
    assert any("raise NotImplementedError" in source(c) for c in released), "no stub was released"
    assert not any("HIDDEN TESTS" in source(c) for c in released)


def test_a_solved_submission_gets_full_marks(course):
    got = scores(course, "solved")
    assert got and all(score == top > 0 for score, top in got.values()), got


def test_an_unsolved_submission_gets_zero_and_the_checkers_report(course):
    got = scores(course, "unsolved")
    assert got and all(score == 0 for score, _ in got.values()), got
    graded = course / "autograded" / "unsolved" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb"
    reports = [json.dumps(c["outputs"]) for c in cells(graded)
               if c["metadata"].get("nbgrader", {}).get("grade")]
    assert reports and all("Not written yet" in r for r in reports), reports


def test_regenerating_the_source_keeps_the_gradebook_and_submissions(course):
    write_course(course, [ASSIGNMENT], only_exercises=True)
    assert (course / "gradebook.db").is_file() and (course / "submitted" / "solved").is_dir()
