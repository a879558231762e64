"""The layout holds: roles visible from the tree, arrows pointing down, no cycles, no private
imports. Read from the source's imports (inside functions too), so the tree cannot drift back."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MECHANISMS = ("measure", "graphs", "overlap", "kvcache", "attention", "engine", "distributed",
              "kernels")
UPPER = ("lessons", "teaching", "tools")
NOTEBOOK_STEMS = sorted(p.stem.split("_", 1)[1] for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def source_files() -> dict[str, Path]:
    """Dotted module name -> file, for labkit/ and kernels/ (imported as labkit.kernels)."""
    found = {}
    for folder, prefix in ((ROOT / "labkit", ["labkit"]), (ROOT / "kernels", ["labkit", "kernels"])):
        for path in folder.rglob("*.py"):
            parts = prefix + list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = source_files()


def imports(module: str, path: Path) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) for every labkit import in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("labkit")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            if base.startswith("labkit"):
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    found.append((sub, "", node.lineno) if sub in MODULES
                                 else (base, a.name, node.lineno))
    return found


def graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    return {m: {target for target, _, _ in imports(m, p) if target in modules and target != m}
            for m, p in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def role(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_the_top_level_holds_packages_and_device_only():
    top = ROOT / "labkit"
    loose = sorted(p.name for p in top.iterdir() if p.suffix == ".py"
                   and p.name not in ("__init__.py", "device.py"))
    assert not loose, f"modules at labkit/'s top level: {loose}; put each in its role's package"
    for pkg in MECHANISMS[:-1] + UPPER:
        assert (top / pkg / "__init__.py").exists(), f"labkit/{pkg}/ is missing"


def test_every_notebook_has_its_lesson_and_nothing_else_sits_in_lessons():
    lessons = ROOT / "labkit" / "lessons"
    present = {p.stem for p in lessons.glob("*.py") if p.stem != "__init__"} | {
        p.name for p in lessons.iterdir() if (p / "__init__.py").exists()}
    assert present <= set(NOTEBOOK_STEMS), f"lessons not named by a notebook stem: {present - set(NOTEBOOK_STEMS)}"
    without = set(NOTEBOOK_STEMS) - present
    assert not without, f"notebooks without a lesson module: {sorted(without)}"


def test_mechanisms_never_import_lessons_teaching_or_tools():
    wrong = [f"{m} imports {target} (line {line})"
             for m, path in MODULES.items() if role(m) in MECHANISMS
             for target, _, line in imports(m, path) if role(target) in UPPER]
    assert not wrong, "\n".join(wrong)


def test_there_are_no_import_cycles_counting_imports_inside_functions():
    assert cycles(graph(MODULES)) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("folder", ["labkit", "kernels", "benchmarks", "tests"])
def test_no_module_imports_another_modules_private_names(folder):
    wrong = []
    for path in (ROOT / folder).rglob("*.py"):
        rel = path.relative_to(ROOT)
        module = ".".join(rel.with_suffix("").parts)
        for target, name, line in imports(module, path):
            private = name.startswith("_") or any(
                p.startswith("_") and not p.startswith("__") for p in target.split("."))
            if private:
                wrong.append(f"{rel}:{line} imports {target}{'.' + name if name else ''}")
    assert not wrong, "\n".join(wrong)


TRACKER = re.compile(r"\b(?:issue|issues|ticket|PR)\s*#?\d+\b", re.I)
HISTORY = re.compile(r"\b(?:an earlier (?:run|recording|session|version)|two runs disagreed|"
                     r"the previous (?:commit|session|recording)|used to (?:be|take|measure))\b", re.I)


@pytest.mark.parametrize("folder", ["labkit", "kernels", "benchmarks"])
def test_code_names_no_tracker_and_narrates_no_history(folder):
    wrong = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:80]}"
             for p in (ROOT / folder).rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if TRACKER.search(line) or HISTORY.search(line)]
    assert not wrong, "\n".join(wrong)
