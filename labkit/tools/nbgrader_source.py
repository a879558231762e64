"""The lab's exercises as an nbgrader course: nbgrader releases and grades, labkit's checker scores.

    python -m labkit.tools.nbgrader_source --out course/       # `make nbgrader`
    cd course
    nbgrader generate_assignment 05_paged_kv_cache              # -> release/05_paged_kv_cache/
    nbgrader autograde 05_paged_kv_cache                        # submitted/<learner>/... -> scores

One assignment per notebook with exercises, ``source/<stem>/<stem>.ipynb``, in which:

- a cell holding a ``# BEGIN SOLUTION`` region is an nbgrader *autograded answer* cell. Release
  replaces the region with labkit's own stub (``LabkitStubs`` stands in for nbgrader's
  ``ClearSolutions``), so a released notebook is the ``make student`` copy, cell for cell.
- a cell ``result_05_1 = check("05.1", slot_mapping)`` is an *autograder tests* cell: read-only,
  ``POINTS`` points, with a hidden ``assert result_05_1.passed, result_05_1``. The test is
  labkit's checker on fresh random inputs, the same call the learner ran; nothing is re-written
  for the grader, and the failure message is the checker's report.
- a Triton exercise (``check("06.1")`` reads ``kernels/exercises/<file>``) ships its stub file
  in the assignment; grading keeps the learner's file (``Autograde.exclude_overwriting``).

``--exercises-only`` keeps what each notebook's exercises need to run on their own, graded in
seconds on a CPU (the tests grade every notebook this way). Cell tags say what that is:

- ``exercises``: the exercise section, and an exercise's prose, hints and solution in the lesson
  body (02.1, 04.1). Kept, but for the notebook's closing assertion (it asserts the whole lesson).
- ``exercise-setup``: a lesson cell the exercises use (the parameters, the imports, 05's block
  manager, 08's engine on the timeline). Kept.
- ``uses-lesson``: an exercise-section cell built on the lesson's measurements (01's prediction
  about its sweep). Left out.

Solution and check cells are kept wherever they are, tagged or not.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

from labkit.tools import REPO_ROOT as ROOT
from labkit.tools.run_notebooks import notebooks
from labkit.tools.student import MarkerError, regions, student_text

POINTS = 1   # per exercise
CHECK = re.compile(r'^(?P<result>\w+) = check\("(?P<id>\d\d\.\d+)"(?:, *(?P<entry>\w+))?\)[ \t]*$',
                   re.M)
HIDDEN = "### BEGIN HIDDEN TESTS\nassert {result}.passed, {result}\n### END HIDDEN TESTS"
CONFIG = '''\
# The nbgrader course for labkit's exercises, written by `make nbgrader`
# (labkit.tools.nbgrader_source): edits here are lost when it is run again.
from labkit.tools.nbgrader_source import release_preprocessors

c = get_config()  # noqa: F821 (nbgrader defines it)
c.CourseDirectory.course_id = "labkit"
# Release puts labkit's stubs where the solutions were, as `make student` does.
c.GenerateAssignment.preprocessors = release_preprocessors()
# A whole notebook runs its lesson at full size when graded: each cell gets up to 10 minutes.
c.Execute.timeout = 600
# Triton exercises: grade the learner's kernel file, not the stub the assignment shipped with.
c.Autograde.exclude_overwriting = {exclude}
'''


def _source(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def _grade_id(kind: str, exercise: str) -> str:
    return f"{kind}_{exercise.replace('.', '_')}"   # nbgrader ids: no dots


def _nbgrader(grade_id: str, *, solution=False, grade=False, locked=False, points=None) -> dict:
    meta = {"grade": grade, "grade_id": grade_id, "locked": locked, "schema_version": 3,
            "solution": solution, "task": False}
    if points is not None:
        meta["points"] = points
    return meta


def _exercise_of(task: str, where: str) -> str:
    """'exercise 02.1: what to write' -> '02.1'."""
    m = re.match(r"exercise (\d\d\.\d+)\b", task)
    if not m:
        raise MarkerError(f"{where}: a graded solution needs its exercise id: "
                          f"'# BEGIN SOLUTION exercise NN.n: ...', got {task!r}")
    return m[1]


def _is_exercise_cell(cell: dict) -> bool:
    src = _source(cell)
    return cell["cell_type"] == "code" and bool(CHECK.search(src) or regions(src.split("\n")))


def exercises_only(nb: dict) -> dict:
    """``nb`` cut to what its exercises need (see the module's docstring for the tags): the
    cells tagged ``exercise-setup``, those tagged ``exercises`` but ``uses-lesson`` ones and the
    notebook's closing assertion, and every solution and check cell."""
    nb = json.loads(json.dumps(nb))
    last_code = max(i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code")

    def needed(i: int, cell: dict) -> bool:
        tags = cell.get("metadata", {}).get("tags", [])
        return (_is_exercise_cell(cell) or "exercise-setup" in tags
                or ("exercises" in tags and "uses-lesson" not in tags and i != last_code))

    nb["cells"] = [c for i, c in enumerate(nb["cells"]) if needed(i, c)]
    return nb


def nbgrader_notebook(nb: dict, where: str = "") -> tuple[dict, list[str]]:
    """``nb`` with nbgrader's metadata on its solution and check cells, and the hidden assert in
    each check cell; returns it and the ids of the exercises it checks."""
    nb = json.loads(json.dumps(nb))
    checked = []
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src, at = _source(cell), f"{where} cell {i}"
        found = regions(src.split("\n"), at)
        call = CHECK.search(src)
        if found and call:
            raise MarkerError(f"{at}: a solution and its check share a cell; put the check call "
                              "in the cell after the solution (it is graded, read-only)")
        if found:
            ids = sorted({_exercise_of(r.task, at) for r in found})
            cell["metadata"]["nbgrader"] = _nbgrader(_grade_id("answer", "_".join(ids)),
                                                     solution=True)
        elif call:
            if call["id"] in checked:
                raise MarkerError(f"{at}: exercise {call['id']} is checked twice; grade it once")
            checked.append(call["id"])
            hidden = HIDDEN.format(result=call["result"])
            cell["source"] = (src[:call.end()] + "\n" + hidden + src[call.end():]) \
                .splitlines(keepends=True)
            cell["metadata"]["nbgrader"] = _nbgrader(_grade_id("check", call["id"]), grade=True,
                                                     locked=True, points=POINTS)
    return nb, checked


def kernel_files(exercise_ids: list[str]) -> list[str]:
    """The ``kernels/exercises/`` files the learner edits for these exercises (Triton ones)."""
    from labkit.teaching import exercises

    return sorted({f for e in exercise_ids if (f := exercises.get(e).kernel_file)})


def release_preprocessors() -> list:
    """nbgrader's release pipeline with ``LabkitStubs`` in place of ``ClearSolutions``."""
    from nbgrader.converters import GenerateAssignment
    from nbgrader.preprocessors import ClearSolutions

    return [_labkit_stubs() if p is ClearSolutions else p
            for p in GenerateAssignment.preprocessors.default()]


def _labkit_stubs():
    """``ClearSolutions`` that writes ``make student``'s stubs (one per region, markers kept)."""
    from nbgrader.preprocessors import ClearSolutions

    class LabkitStubs(ClearSolutions):
        def _replace_solution_region(self, cell, language):
            if cell.cell_type != "code" or not regions(cell.source.split("\n")):
                return False
            cell.source = student_text(cell.source)
            return True

    return LabkitStubs


def write_course(out: Path, stems: list[str] | None = None, only_exercises: bool = False,
                 root: Path = ROOT) -> dict[str, Path]:
    """``out/source/<stem>/<stem>.ipynb`` for each notebook with exercises (``stems`` picks
    some), kernel stubs beside them, and ``out/nbgrader_config.py``; returns {assignment: notebook}.
    Gradebook, submissions and grades already in ``out`` are kept."""
    paths = [p for p in notebooks(root / "notebooks")
             if stems is None or p.stem in stems or p.stem.split("_")[0] in stems]
    if stems is not None and not paths:
        raise MarkerError(f"no notebook in {root / 'notebooks'} matches {stems}")
    written, exclude = {}, {}
    for path in paths:
        nb = json.loads(path.read_text())
        if only_exercises:
            nb = exercises_only(nb)
        nb, checked = nbgrader_notebook(nb, path.name)
        if not checked:
            continue
        folder = out / "source" / path.stem
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        (folder / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        for name in kernel_files(checked):
            rel = Path("kernels") / "exercises" / name
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_text(student_text((root / rel).read_text(), name))
            exclude.setdefault(path.stem, []).append(str(rel))
        written[path.stem] = folder / path.name
    (out / "nbgrader_config.py").write_text(CONFIG.format(exclude=json.dumps(exclude, indent=4)))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="the nbgrader course folder")
    parser.add_argument("--notebooks", nargs="+", metavar="STEM",
                        help="only these notebooks (e.g. 05 07_prefill_vs_decode); default all")
    parser.add_argument("--exercises-only", action="store_true",
                        help="each assignment is the notebook's exercise section only")
    args = parser.parse_args(argv)
    try:
        written = write_course(args.out, args.notebooks, args.exercises_only)
    except MarkerError as e:
        print(f"labkit.tools.nbgrader_source: {e}", file=sys.stderr)
        return 1
    print(f"nbgrader course in {args.out}/: {len(written)} assignments ({', '.join(written)}).\n"
          f"  cd {args.out} && nbgrader generate_assignment <assignment>   # -> release/\n"
          f"  then submitted/<learner>/<assignment>/ and nbgrader autograde <assignment>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
