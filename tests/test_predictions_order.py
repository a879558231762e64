"""A prediction teaches only if it is written down before the answer is seen.

So in every notebook a ``predict(name, ...)`` cell comes before the cell that reveals it
(``reveal(name, measured)``), in the same section (no ``##`` heading between them: the section
that shows the answer cannot sit between the guess and the reveal), and what is revealed is
measured after the guess: it reads at least one name whose value was set after the
prediction. The reveal belongs in the cell that first shows the answer; that an earlier cell
prints the same fact by another route is for a reviewer to see, not for this lint.
"""
import ast
import json

import pytest

from labkit.tools.run_notebooks import notebooks

NOTEBOOKS = notebooks()


def _tree(source: str) -> ast.Module:
    code = "\n".join(line for line in source.splitlines()
                     if not line.lstrip().startswith(("%", "!")))  # IPython magics
    return ast.parse(code)


def _calls(tree: ast.Module, fn: str) -> list[ast.Call]:
    """Calls of ``fn`` whose first argument is a literal name, like ``predict("04.corrupt", ...)``."""
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == fn and node.args and isinstance(node.args[0], ast.Constant)]


def _assigned(tree: ast.Module) -> set[str]:
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _measured(call: ast.Call) -> ast.AST | None:
    if len(call.args) > 1:
        return call.args[1]
    return next((k.value for k in call.keywords if k.arg == "measured"), None)


def order_problems(cells: list[dict]) -> list[str]:
    """What is wrong with the order of a notebook's predictions and reveals (empty: nothing)."""
    predicted: dict[str, list[int]] = {}
    reveals: list[tuple[str, int, ast.Call]] = []
    assigned: list[set[str]] = []
    for i, cell in enumerate(cells):
        tree = _tree("".join(cell["source"])) if cell["cell_type"] == "code" else ast.Module([], [])
        assigned.append(_assigned(tree))
        for call in _calls(tree, "predict"):
            predicted.setdefault(call.args[0].value, []).append(i)
        reveals += [(call.args[0].value, i, call) for call in _calls(tree, "reveal")]

    problems = [f"{name!r} is predicted in cells {at}: ask once" for name, at in predicted.items()
                if len(at) > 1]
    for name, r, call in reveals:
        if name not in predicted:
            problems.append(f"cell {r} reveals {name!r}, which no cell predicts")
            continue
        p = predicted[name][0]
        if p >= r:
            problems.append(f"cell {r} reveals {name!r} before (or in) its prediction, cell {p}")
            continue
        headings = [i for i in range(p + 1, r) if cells[i]["cell_type"] == "markdown" and any(
            line.startswith("## ") for line in "".join(cells[i]["source"]).splitlines())]
        if headings:
            problems.append(f"{name!r}: predicted in cell {p}, revealed in cell {r}, with a new "
                            f"section between them (cell {headings[0]}): ask right before the "
                            "measurement")
        measured = _measured(call)
        reads = {n.id for n in ast.walk(measured) if isinstance(n, ast.Name)} if measured else set()
        # where each name the reveal reads got its value: the last cell up to the reveal that
        # assigns it (builtins and names from nowhere have none)
        set_in = {n: max(i for i in range(r + 1) if n in assigned[i]) for n in reads
                  if any(n in a for a in assigned[: r + 1])}
        if not any(i > p for i in set_in.values()):
            problems.append(f"cell {r} reveals {name!r} from {sorted(set_in)}, all computed "
                            f"before the prediction in cell {p}: measure after the guess")
    return problems


def _md(text):
    return {"cell_type": "markdown", "source": [text]}


def _code(text):
    return {"cell_type": "code", "source": [text]}


def test_a_prediction_asked_then_measured_then_revealed_passes():
    cells = [_code("x = 1"), _md("## 4. The hazard"), _code('predict("n.q", question="?")'),
             _code('run = measure(x)\nreveal("n.q", run["wrong"])')]
    assert order_problems(cells) == []


def test_a_reveal_before_its_prediction_is_caught():
    cells = [_code('reveal("n.q", run)'), _code('predict("n.q", question="?")')]
    assert "before (or in) its prediction" in order_problems(cells)[0]


def test_a_reveal_without_a_prediction_is_caught():
    assert "no cell predicts" in order_problems([_code('reveal("n.q", 3)')])[0]


def test_a_section_between_the_guess_and_the_reveal_is_caught():
    cells = [_code('predict("n.q", question="?")'), _md("## 5. Next"),
             _code('run = measure()\nreveal("n.q", run)')]
    assert "new section between them" in order_problems(cells)[0]


def test_revealing_a_number_computed_before_the_guess_is_caught():
    cells = [_code("unsafe = measure()\nprint(unsafe)"), _code('predict("n.q", question="?")'),
             _code('reveal("n.q", 100 * unsafe["corrupt"])')]
    assert "computed before the prediction" in order_problems(cells)[0]


def test_builtins_do_not_make_an_old_number_new_and_a_fresh_measurement_counts():
    before = [_code("ratios = measure()"), _code('predict("n.q", question="?")')]
    stale = before + [_code('reveal("n.q", sorted(ratios)[len(ratios) // 2])')]
    assert "computed before the prediction" in order_problems(stale)[0]
    fresh = before + [_code('ratios = measure()\nreveal("n.q", sorted(ratios)[len(ratios) // 2])')]
    assert order_problems(fresh) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_prediction_comes_before_the_cell_that_reveals_it(path):
    cells = json.loads(path.read_text())["cells"]
    problems = order_problems(cells)
    assert not problems, f"{path.name}: " + "; ".join(problems)
