"""The lab as a learner sees it: each notebook, as papermill executed it, open in JupyterLab in a
real (headless) Chromium, its widgets live.

Each notebook is executed once a session (``executed_notebook`` in conftest.py: papermill, CPU,
QUICK sizes, the run the notebook test checks). The browser opens that executed copy, so every
saved output is drawn by JupyterLab's own renderers, and re-runs in a live kernel the cells up to
the last one that shows a widget the learner moves (an ``interact`` or a hand-built box): those
need a kernel behind them, the later outputs do not. The page is then checked: no live cell
raised, every code cell ran, every plotly figure drew an SVG, no widget shows an error view, no
stderr box shows, no number prints as ``150.000000`` or ``np.float64(...)``, no table cell is cut
with "..."; every moving widget redraws its output when moved and every hint accordion opens. A
screenshot of each goes to test-results/browser/. Uses the shared `chromium` fixture
(tests/conftest.py).
"""
import json
import shutil
from pathlib import Path

import pytest

from labkit.tools import lab_server
from labkit.tools.run_notebooks import notebooks

SHOTS = Path(__file__).resolve().parent.parent / "test-results" / "browser"
NOTEBOOKS = notebooks()
pytestmark = pytest.mark.browser

RUN_LIVE = """async ({name, last}) => {
  const app = window.jupyterapp;
  const panel = app.shell.currentWidget;
  await panel.context.ready;
  await panel.sessionContext.ready;
  if (panel.context.path !== name) throw new Error('wrong notebook in focus: ' + panel.context.path);
  const notebook = panel.content;
  const code = notebook.widgets.filter(c => c.model.type === 'code');
  if (last >= 0) {
    notebook.activeCellIndex = notebook.widgets.indexOf(code[last]);
    await app.commands.execute('notebook:run-all-above');
    await app.commands.execute('notebook:run-cell');
  }
  return code.map((c, i) => ({
    live: i <= last,
    count: c.model.executionCount,
    errors: c.model.outputs.toJSON().filter(o => o.output_type === 'error')
                               .map(o => o.ename + ': ' + o.evalue),
  }));
}"""

PAGE_CHECKS = r"""() => ({
  figures: document.querySelectorAll('.js-plotly-plot').length,
  drawn: [...document.querySelectorAll('.js-plotly-plot')]
           .filter(p => p.querySelector('svg.main-svg')).length,
  widgets: document.querySelectorAll('.jupyter-widgets').length,
  widget_errors: [...document.querySelectorAll('.jp-OutputArea-output')]
           .filter(o => o.textContent.includes('Error displaying widget')).length,
  stderr: [...document.querySelectorAll('.jp-RenderedText[data-mime-type="application/vnd.jupyter.stderr"]')]
           .map(o => o.textContent.trim().slice(0, 200)).filter(t => t),
  float_counts: [...document.querySelectorAll('.jp-OutputArea-output')]
           .map(o => o.textContent.match(/np\.float64\([^)]*\)|\b\d+\.000000\b/))
           .filter(m => m).map(m => m[0]),
  cut_cells: [...document.querySelectorAll('.jp-OutputArea-output td, .jp-OutputArea-output th')]
           .map(c => c.textContent.trim()).filter(t => t.length > 3 && /(\.\.\.|…)$/.test(t)),
})"""

FIGURES_DRAWN = """expected => {
  const plots = [...document.querySelectorAll('.js-plotly-plot')];
  return plots.length >= expected && plots.every(p => p.querySelector('svg.main-svg'));
}"""

MOVING = ("VBoxModel", "HBoxModel", "BoxModel")  # an interact, or a box of controls and an Output


def last_moving_widget_cell(nb: dict) -> int:
    """Index (among code cells) of the last cell whose output is a box of controls the learner
    moves, by the widget state papermill saved; -1 when there is none."""
    state = nb.get("metadata", {}).get("widgets", {}).get(
        "application/vnd.jupyter.widget-state+json", {}).get("state", {})
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    last = -1
    for i, cell in enumerate(code):
        for out in cell.get("outputs", []):
            view = out.get("data", {}).get("application/vnd.jupyter.widget-view+json")
            if view and state.get(view["model_id"], {}).get("model_name") in MOVING:
                last = i
    return last


@pytest.fixture(scope="module")
def lab_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("browser-notebooks")


@pytest.fixture(scope="module")
def browser_page(lab_dir, chromium):
    with lab_server.running_lab(lab_dir, expose_app=True, windowed=False) as lab:
        page = chromium.new_page(viewport={"width": 1280, "height": 1600})
        yield lab, page
        page.close()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_renders_in_jupyterlab_and_its_widgets_work(browser_page, lab_dir, path,
                                                              executed_notebook):
    run = executed_notebook(path)
    assert run.status == "ok", f"{path.name} failed under papermill:\n{run.error[-2000:]}"
    executed = json.loads(Path(run.output).read_text())
    shutil.copy(run.output, lab_dir / path.name)
    last = last_moving_widget_cell(executed)
    lab, page = browser_page
    page.goto(lab.url(f"lab/tree/{path.name}?reset"))  # reset: no tabs restored from before
    page.wait_for_function(
        "name => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        " return w && w.context && w.context.path === name && w.content; }",
        arg=path.name, timeout=60_000)
    page.set_default_timeout(300_000)
    cells = page.evaluate(RUN_LIVE, {"name": path.name, "last": last})
    errors = [e for c in cells if c["live"] for e in c["errors"]]
    assert not errors, f"{path.name} raised in the browser: {errors}"
    assert cells and all(c["count"] for c in cells), \
        f"{path.name}: cells {[i for i, c in enumerate(cells) if not c['count']]} never ran"
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    expected = run.expected_figures
    try:  # outputs render after the cells return: wait until every promised figure has drawn
        page.wait_for_function(FIGURES_DRAWN, arg=expected, timeout=30_000)
    except PlaywrightTimeout:
        pass  # the assertions below say which figures are missing
    seen = page.evaluate(PAGE_CHECKS)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.evaluate("() => document.querySelector('.js-plotly-plot')?.scrollIntoView()")
    page.screenshot(path=str(SHOTS / f"{path.stem}.png"))
    assert seen["figures"] >= expected and seen["drawn"] == seen["figures"], \
        f"{path.name}: {seen['drawn']} of {seen['figures']} figures drew, {expected} promised"
    assert seen["widget_errors"] == 0, f"{path.name}: a widget shows an error view"
    # what the screen shows: no red stderr boxes, no counts as floats, no cells cut with "..."
    assert not seen["stderr"], f"{path.name}: stderr shown under a cell: {seen['stderr']}"
    assert not seen["float_counts"], f"{path.name}: numbers printed as floats: {seen['float_counts']}"
    assert not seen["cut_cells"], f"{path.name}: table cells cut short: {seen['cut_cells']}"
    dead = move_every_widget(page)
    assert not dead, f"{path.name}: widgets whose output never changed when moved: {dead}"
    page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:shutdown')")


def test_the_last_moving_widget_is_found_by_its_saved_state():
    view = "application/vnd.jupyter.widget-view+json"
    nb = {"metadata": {"widgets": {"application/vnd.jupyter.widget-state+json": {"state": {
              "a": {"model_name": "VBoxModel"}, "h": {"model_name": "AccordionModel"}}}}},
          "cells": [{"cell_type": "code", "outputs": []},
                    {"cell_type": "markdown", "source": "text"},
                    {"cell_type": "code", "outputs": [{"data": {view: {"model_id": "a"}}}]},
                    {"cell_type": "code", "outputs": [{"data": {view: {"model_id": "h"}}}]}]}
    assert last_moving_widget_cell(nb) == 1, "the interact's cell; the accordion needs no kernel"
    assert last_moving_widget_cell({"cells": [{"cell_type": "code", "outputs": []}]}) == -1


def test_the_screen_checks_see_stderr_float_counts_and_cut_cells(chromium):
    page = chromium.new_page()
    page.set_content("""
      <div class="jp-OutputArea-output"><div class="jp-RenderedText"
        data-mime-type="application/vnd.jupyter.stderr"><pre>USDT profiler_start</pre></div></div>
      <div class="jp-OutputArea-output"><pre>kernels 150.000000</pre></div>
      <div class="jp-OutputArea-output"><pre>rows np.float64(256.0)</pre></div>
      <div class="jp-OutputArea-output"><table><tr><td>CUDA Graph re...</td>
        <td>1.5</td><td>2.25</td></tr></table></div>
      <div class="jp-OutputArea-output"><pre>speed 891.731758 and 12 steps</pre></div>""")
    seen = page.evaluate(PAGE_CHECKS)
    page.close()
    assert seen["stderr"] == ["USDT profiler_start"]
    assert seen["float_counts"] == ["150.000000", "np.float64(256.0)"]
    assert seen["cut_cells"] == ["CUDA Graph re..."]


def _shown(output) -> str:
    """What an Output widget shows: its text (figure titles and ticks included) and how many
    figures drew. An empty string when it shows nothing."""
    text = output.evaluate("o => o.textContent.trim()")
    figures = output.locator("svg.main-svg").count()
    return f"{figures} figures | {text}" if text or figures else ""


def _redrew(page, output, before: str, timeout_ms: int) -> bool:
    """The Output shows something, and something other than ``before``."""
    for _ in range(max(1, timeout_ms // 250)):
        now = _shown(output)
        if now and now != before:
            return True
        page.wait_for_timeout(250)
    return False


def move_every_widget(page, timeout_ms: int = 120_000) -> list[str]:
    """Every widget the learner can move must change what it owns: each control beside an
    Output widget (an ``interact`` or a hand-built box) is moved once, its run button pressed if
    it has one, and the Output must redraw; each accordion (hints) must open a pane when its
    title is clicked. Returns a description of each that did not."""
    dead = []
    boxes = page.locator(".widget-box:has(> .widget-output)")
    for i in range(boxes.count()):
        box = boxes.nth(i)
        output = box.locator("> .widget-output")
        before = _shown(output)
        moved = []
        for j in range(box.locator(".noUi-handle").count()):
            handle = box.locator(".noUi-handle").nth(j)
            handle.focus()
            at_max = handle.get_attribute("aria-valuenow") == handle.get_attribute("aria-valuemax")
            handle.press("ArrowLeft" if at_max else "ArrowRight")
            moved.append(f"slider {j}")
        for j in range(box.locator("select").count()):
            select = box.locator("select").nth(j)
            options = select.locator("option")
            if options.count() > 1:
                current = select.evaluate("s => s.selectedIndex")
                select.select_option(index=(current + 1) % options.count())
                moved.append(f"dropdown {j}")
        run = box.locator("button:has-text('Run Interact')")
        if run.count():
            run.first.click()
        if moved and not _redrew(page, output, before, timeout_ms):
            dead.append(f"widget box {i} ({', '.join(moved)})")
    accordions = page.locator(".jupyter-widget-Collapse-header, .p-Collapse-header, .lm-Collapse-header")
    for i in range(accordions.count()):
        header = accordions.nth(i)
        header.scroll_into_view_if_needed()
        header.click()
        contents = header.locator("xpath=following-sibling::*[1]")
        if not contents.is_visible():
            dead.append(f"accordion title {i} ({header.inner_text()[:40]!r})")
    return dead
