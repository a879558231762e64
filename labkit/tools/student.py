"""Student and instructor copies of the lab, from one source.

Solutions are marked where they live, in notebooks and in ``kernels/exercises/*.py``:

    # BEGIN SOLUTION exercise 02.1: what to write, in one line
    ... the solution ...
    # STUB                      (optional; without it the stub raises NotImplementedError)
    # ... the stub, commented out ...
    # END SOLUTION

The student copy keeps the marker lines and puts the stub between them: the commented ``# STUB``
lines uncommented, or ``raise NotImplementedError("exercise 02.1: what to write")`` at the
marker's indentation. Everything outside the markers is copied as it is. The instructor copy is
the source, unchanged.

    python -m labkit.tools.student --out student/        # solutions replaced by stubs
    python -m labkit.tools.student --out instructor/ --instructor
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from labkit.tools import REPO_ROOT as ROOT
from labkit.tools.run_notebooks import notebooks
BEGIN = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION\b ?(?P<task>.*)$")
STUB = re.compile(r"^[ \t]*# STUB\s*$")
END = re.compile(r"^[ \t]*# END SOLUTION\s*$")


class MarkerError(ValueError):
    pass


@dataclass
class Region:
    begin: int          # line index of BEGIN
    end: int            # line index of END
    task: str
    stub: list[str]     # stub lines, ready to insert


def regions(lines: list[str], where: str = "") -> list[Region]:
    """Every marked region of ``lines`` (no newlines); unbalanced markers are an error."""
    found, open_at, indent, task, stub_at = [], None, "", "", None
    for i, line in enumerate(lines):
        if m := BEGIN.match(line):
            if open_at is not None:
                raise MarkerError(f"{where}:{i + 1}: BEGIN SOLUTION inside the one opened at line "
                                  f"{open_at + 1}; close it with # END SOLUTION first")
            open_at, indent, task, stub_at = i, m["indent"], m["task"].strip(), None
        elif STUB.match(line):
            if open_at is None:
                raise MarkerError(f"{where}:{i + 1}: # STUB outside a BEGIN/END SOLUTION region")
            stub_at = i
        elif END.match(line):
            if open_at is None:
                raise MarkerError(f"{where}:{i + 1}: END SOLUTION with no BEGIN SOLUTION before it")
            if stub_at is not None:
                stub = _uncomment(lines[stub_at + 1:i], indent, where, stub_at)
            else:
                message = json.dumps(task or "exercise: write this part")
                stub = [f"{indent}raise NotImplementedError({message})"]
            found.append(Region(open_at, i, task, stub))
            open_at = None
    if open_at is not None:
        raise MarkerError(f"{where}:{open_at + 1}: BEGIN SOLUTION is never closed by # END SOLUTION")
    return found


def _uncomment(lines: list[str], indent: str, where: str, at: int) -> list[str]:
    out = []
    for k, line in enumerate(lines):
        if not line.startswith(indent + "#"):
            raise MarkerError(f"{where}:{at + k + 2}: stub lines must be commented out at the "
                              f"marker's indentation ('{indent}# ...'), got {line!r}")
        rest = line[len(indent) + 1:]
        out.append(indent + (rest[1:] if rest.startswith(" ") else rest))
    return out


def student_text(text: str, where: str = "") -> str:
    """``text`` with every solution region's body replaced by its stub."""
    lines = text.split("\n")
    out, start = [], 0
    for r in regions(lines, where):
        out += lines[start:r.begin + 1] + r.stub + [lines[r.end]]
        start = r.end + 1
    return "\n".join(out + lines[start:])


def student_notebook(nb: dict, where: str = "") -> dict:
    nb = json.loads(json.dumps(nb))
    for i, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        new = student_text(src, f"{where} cell {i}")
        if new != src:
            cell["source"] = new.splitlines(keepends=True)
    return nb


def sources(root: Path = ROOT) -> list[Path]:
    """What a copy contains: the notebooks and the Triton exercise files."""
    return (notebooks(root / "notebooks")
            + sorted((root / "kernels" / "exercises").glob("*.py")))


def write_copy(out: Path, instructor: bool = False, root: Path = ROOT) -> list[Path]:
    """Write the copy under ``out`` (``notebooks/``, ``kernels/exercises/``); returns the files."""
    written = []
    for src in sources(root):
        dst = out / src.relative_to(root)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if instructor:
            shutil.copyfile(src, dst)
        elif src.suffix == ".ipynb":
            nb = student_notebook(json.loads(src.read_text()), src.name)
            dst.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        else:
            dst.write_text(student_text(src.read_text(), src.name))
        written.append(dst)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="folder to write the copy into")
    parser.add_argument("--instructor", action="store_true",
                        help="keep the solutions (copy the sources unchanged)")
    args = parser.parse_args(argv)
    if args.out.resolve() == ROOT:
        parser.error("--out is the lab itself: pick another folder (the sources hold solutions)")
    try:
        files = write_copy(args.out, args.instructor)
    except MarkerError as e:
        print(f"labkit.tools.student: {e}", file=sys.stderr)
        return 1
    kind = "instructor (solutions kept)" if args.instructor else "student (solutions -> stubs)"
    print(f"{kind} copy: {len(files)} files in {args.out}/notebooks and {args.out}/kernels/exercises")
    return 0


if __name__ == "__main__":
    sys.exit(main())
