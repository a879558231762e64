"""The lab as a learner sees it: JupyterLab in a real (headless) Chromium runs every notebook.

For each notebook (a copy with QUICK=True injected as papermill would), the test opens it in
JupyterLab, runs all cells, and checks in the page: no cell raised, the last (asserting) cell
ran, every plotly figure drew an SVG, no widget shows an error view. A screenshot of each goes
to test-results/browser/. Uses the shared `chromium` fixture (tests/conftest.py).
"""
import json
from pathlib import Path

import nbformat
import pytest
from papermill.iorw import load_notebook_node
from papermill.parameterize import parameterize_notebook

from labkit.tools import lab_server
from labkit.tools.run_notebooks import lab_metadata, notebooks

SHOTS = Path(__file__).resolve().parent.parent / "test-results" / "browser"
NOTEBOOKS = notebooks()
pytestmark = pytest.mark.browser

RUN_ALL = """async () => {
  const app = window.jupyterapp;
  const panel = app.shell.currentWidget;
  await panel.context.ready;
  await panel.sessionContext.ready;
  if (panel.context.path !== NAME) throw new Error('wrong notebook in focus: ' + panel.context.path);
  await app.commands.execute('notebook:run-all-cells');
  const cells = panel.content.widgets.filter(c => c.model.type === 'code');
  return cells.map(c => ({
    count: c.model.executionCount,
    errors: c.model.outputs.toJSON().filter(o => o.output_type === 'error')
                               .map(o => o.ename + ': ' + o.evalue),
  }));
}"""

PAGE_CHECKS = """() => ({
  figures: document.querySelectorAll('.js-plotly-plot').length,
  drawn: [...document.querySelectorAll('.js-plotly-plot')]
           .filter(p => p.querySelector('svg.main-svg')).length,
  widgets: document.querySelectorAll('.jupyter-widgets').length,
  widget_errors: [...document.querySelectorAll('.jp-OutputArea-output')]
           .filter(o => o.textContent.includes('Error displaying widget')).length,
})"""


@pytest.fixture(scope="module")
def quick_copies(tmp_path_factory):
    """Each notebook with the QUICK parameters injected, as papermill injects them."""
    out = tmp_path_factory.mktemp("browser-notebooks")
    for path in NOTEBOOKS:
        nb = load_notebook_node(str(path))  # adds the metadata papermill expects
        nb = parameterize_notebook(nb, {"DEVICE": "auto", "QUICK": True})
        nbformat.write(nb, out / path.name)
    return out


@pytest.fixture(scope="module")
def browser_page(quick_copies, chromium):
    with lab_server.running_lab(quick_copies, expose_app=True, windowed=False) as lab:
        page = chromium.new_page(viewport={"width": 1280, "height": 1600})
        yield lab, page
        page.close()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_jupyterlab_and_every_output_renders(browser_page, path):
    lab, page = browser_page
    page.goto(lab.url(f"lab/tree/{path.name}?reset"))  # reset: no tabs restored from before
    page.wait_for_function(
        "name => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        " return w && w.context && w.context.path === name && w.content; }",
        arg=path.name, timeout=60_000)
    page.set_default_timeout(300_000)
    cells = page.evaluate(RUN_ALL.replace("NAME", json.dumps(path.name)))
    errors = [e for c in cells for e in c["errors"]]
    assert not errors, f"{path.name} raised in the browser: {errors}"
    assert cells and all(c["count"] for c in cells), \
        f"{path.name}: cells {[i for i, c in enumerate(cells) if not c['count']]} never ran"
    page.wait_for_timeout(1500)  # let plotly finish drawing after the last output arrives
    seen = page.evaluate(PAGE_CHECKS)
    expected = lab_metadata(json.loads(path.read_text())).get("expected_figures", 0)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.evaluate("() => document.querySelector('.js-plotly-plot')?.scrollIntoView()")
    page.screenshot(path=str(SHOTS / f"{path.stem}.png"))
    assert seen["figures"] >= expected and seen["drawn"] == seen["figures"], \
        f"{path.name}: {seen['drawn']} of {seen['figures']} figures drew, {expected} promised"
    assert seen["widget_errors"] == 0, f"{path.name}: a widget shows an error view"
    page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:shutdown')")
