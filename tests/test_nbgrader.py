"""nbgrader releases the exercises as `make student` writes them; labkit's checker grades them.

Every notebook with exercises is graded, each cut to what its exercises need (exercises-only:
seconds on a CPU), in one nbgrader run: one generate_assignment and one autograde for all of them,
through nbgrader's own command line in a temporary course folder.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
# The hub extra (make venv installs it; a GPU host running `make gpu-check` has only the
# notebook stack): without it these tests cannot import what they test.
pytest.importorskip("nbgrader", reason="needs the hub extra: pip install -e .[hub]")
from nbgrader.api import Gradebook

from labkit.teaching.exercises import all_exercises
from labkit.tools import REPO_ROOT
from labkit.tools.nbgrader_source import exercises_only, nbgrader_notebook, write_course
from labkit.tools.run_notebooks import notebooks
from labkit.tools.student import student_notebook

ASSIGNMENT = "07_prefill_vs_decode"   # the one the single-notebook tests look at
ASSIGNMENTS = [p.stem for p in notebooks() if nbgrader_notebook(json.loads(p.read_text()))[1]]


def nbgrader(course: Path, *args: str) -> subprocess.Popen:
    """Start ``nbgrader args`` in ``course``; ``done`` waits for it."""
    # nbgrader runs alembic (its database migrations) by name: the venv's bin must be on PATH
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.Popen([sys.executable, "-m", "nbgrader", *args], cwd=course, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def done(*runs: subprocess.Popen) -> None:
    for run in runs:
        out, _ = run.communicate(timeout=600)
        assert run.returncode == 0, f"{' '.join(run.args[2:])} failed:\n{out}"


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def submit(course: Path, learner: str, assignment: str, nb_cells: list[dict],
           kernels: Path) -> None:
    """``nb_cells`` in the released notebook, and the ``kernels/exercises/`` files from
    ``kernels`` (the learner's Triton exercises), as ``learner``'s submission."""
    release = course / "release" / assignment
    nb = json.loads((release / f"{assignment}.ipynb").read_text())
    nb["cells"] = nb_cells
    folder = course / "submitted" / learner / assignment
    folder.mkdir(parents=True)
    (folder / f"{assignment}.ipynb").write_text(json.dumps(nb))
    for stub in (release / "kernels" / "exercises").glob("*.py"):
        (folder / "kernels" / "exercises").mkdir(parents=True, exist_ok=True)
        shutil.copy(kernels / stub.name, folder / "kernels" / "exercises" / stub.name)


@pytest.fixture(scope="module")
def course(tmp_path_factory) -> dict[str, Path]:
    """Release every assignment; autograde an untouched copy of each ("unsolved") and one with
    the solutions in ("solved": the source's solution cells, labkit's own kernel files). The two
    learners are graded side by side, each in a copy of the course (one gradebook each, so they
    never wait on one another's database): half the time on two cores."""
    root = tmp_path_factory.mktemp("courses")
    course = {"solved": root / "solved", "unsolved": root / "unsolved"}
    assert sorted(write_course(course["solved"], only_exercises=True)) == ASSIGNMENTS
    done(nbgrader(course["solved"], "generate_assignment", "*"))
    shutil.copytree(course["solved"], course["unsolved"])
    for a in ASSIGNMENTS:
        release = course["solved"] / "release" / a
        released = cells(release / f"{a}.ipynb")
        solutions = cells(course["solved"] / "source" / a / f"{a}.ipynb")
        submit(course["unsolved"], "unsolved", a, released, release / "kernels" / "exercises")
        submit(course["solved"], "solved", a, [
            {**r, "source": s["source"]} if r["metadata"].get("nbgrader", {}).get("solution")
            else r for r, s in zip(released, solutions)], REPO_ROOT / "kernels" / "exercises")
    done(*(nbgrader(folder, "autograde", "*") for folder in course.values()))
    return course


def scores(course: dict[str, Path], learner: str, assignment: str) -> dict[str, tuple]:
    """{grade id: (auto score, max score)} of ``learner``'s submission."""
    with Gradebook(f"sqlite:///{course[learner] / 'gradebook.db'}", course_id="labkit") as gb:
        nb = gb.find_submission_notebook(assignment, assignment, learner)
        return {g.name: (g.auto_score, g.max_score) for g in nb.grades}


def autograded(course: dict[str, Path], learner: str, assignment: str) -> list[dict]:
    return cells(course[learner] / "autograded" / learner / assignment / f"{assignment}.ipynb")


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


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_the_release_is_the_student_copy_cell_for_cell(course, assignment):
    original = next(p for p in notebooks() if p.stem == assignment)
    student = student_notebook(exercises_only(json.loads(original.read_text())))["cells"]
    released = cells(course["solved"] / "release" / assignment / f"{assignment}.ipynb")
    assert [source(c) for c in released] == [source(c) for c in student]
    assert not any("HIDDEN TESTS" in source(c) for c in released)


def test_a_release_holds_stubs_not_solutions(course):
    released = cells(course["solved"] / "release" / ASSIGNMENT / f"{ASSIGNMENT}.ipynb")
    assert any("raise NotImplementedError" in source(c) for c in released), "no stub was released"


def test_every_notebook_with_exercises_is_an_assignment():
    assert {"05_paged_kv_cache", "06_attention_backends", ASSIGNMENT} <= set(ASSIGNMENTS)


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_a_solved_submission_gets_full_marks_and_runs_without_an_error(course, assignment):
    got = scores(course, "solved", assignment)
    assert got and all(score == top > 0 for score, top in got.values()), got
    # every cell ran: no name the exercises use was left behind with the lesson
    errors = [(source(c)[:80], o["ename"], o["evalue"])
              for c in autograded(course, "solved", assignment)
              for o in c.get("outputs", []) if o["output_type"] == "error"]
    assert not errors, errors


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_an_unsolved_submission_gets_zero_and_the_checkers_report(course, assignment):
    got = scores(course, "unsolved", assignment)
    assert got and all(score == 0 for score, _ in got.values()), got
    reports = {c["metadata"]["nbgrader"]["grade_id"]: json.dumps(c["outputs"])
               for c in autograded(course, "unsolved", assignment)
               if c["metadata"].get("nbgrader", {}).get("grade")}
    assert reports and all(f"FAILED  Exercise {g[len('check_'):].replace('_', '.')}" in r
                           for g, r in reports.items()), reports


def test_a_stub_that_raises_is_reported_as_not_written_yet(course):
    reports = [json.dumps(c["outputs"]) for c in autograded(course, "unsolved", ASSIGNMENT)
               if c["metadata"].get("nbgrader", {}).get("grade")]
    assert reports and all("Not written yet" in r for r in reports), reports


def test_regenerating_the_source_keeps_the_gradebook_and_submissions(course):
    write_course(course["solved"], [ASSIGNMENT], only_exercises=True)
    assert (course["solved"] / "gradebook.db").is_file()
    assert (course["solved"] / "submitted" / "solved").is_dir()
