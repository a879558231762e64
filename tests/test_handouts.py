"""Handouts: executed notebooks as static HTML pages that draw every figure with the network off.

The tour is executed here (QUICK sizes, as `make handouts` would at full size) so the test does
not depend on another test having run first; a small hand-made executed notebook covers widget
state. Pages are opened in Debian's chromium through Playwright, offline, with every request
that is not a local file aborted and recorded.
"""
import json
import shutil
from pathlib import Path

import pytest

from labkit.tools import handouts
from labkit.device import describe, fingerprint
from labkit.tools.run_notebooks import PLOTLY_MIME, lab_metadata, notebooks

TOUR = next(p for p in notebooks() if p.stem.startswith("00_"))

PAGE_CHECKS = """() => ({
  figures: document.querySelectorAll('.labkit-figure').length,
  drawn: [...document.querySelectorAll('.labkit-figure')]
           .filter(d => d.classList.contains('js-plotly-plot') && d.querySelector('svg.main-svg')).length,
  first: document.querySelector('main').firstElementChild.id,
  header: (document.getElementById('labkit-fingerprint') || {}).textContent || '',
})"""


@pytest.fixture(scope="module")
def tour(tmp_path_factory):
    """Handouts built the way `make handouts` builds them: executing the notebook first."""
    out = tmp_path_factory.mktemp("handouts")
    built = handouts.build(out, names=[TOUR.stem[:2]], quick=True)
    return out, built


def _figure(title: str) -> dict:
    return {"data": [{"type": "bar", "x": ["a", "b"], "y": [1, 2]}], "layout": {"title": {"text": title}}}


@pytest.fixture(scope="module")
def widget_run(tmp_path_factory):
    """An executed notebook as a lab run leaves it: a figure, and an interact-style widget whose
    output area holds a second figure (with a title that would end a <script> early)."""
    run = tmp_path_factory.mktemp("run")
    (run / "fingerprint.json").write_text(json.dumps(fingerprint()))
    state = {
        "box": {"model_name": "VBoxModel", "state": {"children": ["IPY_MODEL_slider", "IPY_MODEL_out"]}},
        "slider": {"model_name": "IntSliderModel",
                   "state": {"description": "block_size", "value": 32, "min": 16, "max": 256, "step": 16}},
        "out": {"model_name": "OutputModel", "state": {"outputs": [
            {"output_type": "display_data", "metadata": {}, "data": {PLOTLY_MIME: _figure("a </script> title")}}]}},
    }
    nb = {"nbformat": 4, "nbformat_minor": 5,
          "metadata": {"widgets": {handouts.WIDGET_STATE_MIME: {"state": state, "version_major": 2,
                                                                "version_minor": 0}}},
          "cells": [
              {"cell_type": "markdown", "id": "m", "metadata": {}, "source": ["# 99 · widgets\n"]},
              {"cell_type": "code", "id": "f", "metadata": {}, "execution_count": 1, "source": ["fig"],
               "outputs": [{"output_type": "display_data", "metadata": {},
                            "data": {PLOTLY_MIME: _figure("plain")}}]},
              {"cell_type": "code", "id": "w", "metadata": {}, "execution_count": 2, "source": ["w"],
               "outputs": [{"output_type": "display_data", "metadata": {}, "data": {
                   handouts.WIDGET_VIEW_MIME: {"model_id": "box", "version_major": 2, "version_minor": 0},
                   "text/plain": ["VBox(...)"]}}]},
          ]}
    (run / "99_widgets.ipynb").write_text(json.dumps(nb))
    out = run / "handouts"
    return out, handouts.build(out, run)


@pytest.fixture(scope="module")
def offline_page(chromium):
    context = chromium.new_context(offline=True, viewport={"width": 1200, "height": 1400})
    requested = []

    def local_only(route):
        if route.request.url.startswith("file:"):
            route.continue_()
        else:
            requested.append(route.request.url)
            route.abort()

    context.route("**/*", local_only)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    def open_page(path: Path) -> dict:
        requested.clear()
        errors.clear()
        page.goto(path.as_uri(), wait_until="load")
        try:  # plotly draws right after its script runs; give a slow runner a moment
            page.wait_for_function(
                "[...document.querySelectorAll('.labkit-figure')].every(d => d.querySelector('svg.main-svg'))",
                timeout=15_000)
        except Exception:
            pass  # the assertions below say what is missing
        return {**page.evaluate(PAGE_CHECKS), "requested": list(requested), "errors": list(errors)}

    yield page, open_page
    context.close()


def test_every_figure_on_a_handout_draws_with_the_network_off(tour, offline_page):
    out, built = tour
    _, open_page = offline_page
    seen = open_page(built[0].page)
    expected = lab_metadata(json.loads(TOUR.read_text())).get("expected_figures", 1)
    assert seen["figures"] >= expected, (
        f"{built[0].page.name} has {seen['figures']} figure(s); the tour promises {expected}")
    assert seen["drawn"] == seen["figures"], (
        f"only {seen['drawn']} of {seen['figures']} figures drew offline; page errors: {seen['errors']}")
    assert seen["requested"] == [], (
        f"a handout must load nothing from the network, it asked for {seen['requested'][:5]}")


def test_a_handout_names_the_machine_that_ran_it_at_the_top(tour, offline_page):
    out, built = tour
    _, open_page = offline_page
    recorded = json.loads((out / "notebooks" / "fingerprint.json").read_text())
    seen = open_page(built[0].page)
    assert seen["first"] == "labkit-fingerprint", "the fingerprint header must open the page"
    assert describe(recorded) in seen["header"], (
        f"the header should say where the numbers came from ({describe(recorded)!r}), "
        f"it says {seen['header'][:200]!r}")


def test_a_widget_shows_its_saved_values_and_what_its_output_held(widget_run, offline_page):
    out, built = widget_run
    page, open_page = offline_page
    seen = open_page(built[0].page)
    assert seen["figures"] == 2 and seen["drawn"] == 2, (
        f"the cell's figure and the one in the widget's output should both draw: {seen}")
    slider = page.locator(".labkit-widget input[type=range]")
    assert slider.count() == 1 and slider.input_value() == "32", \
        "the slider should show the value the run left it at (32)"
    assert "block_size" in page.locator(".labkit-widget").inner_text(), "the widget's description is missing"


def test_the_index_links_every_page_with_its_title(widget_run):
    out, built = widget_run
    index = (out / "index.html").read_text()
    assert 'href="99_widgets.html"' in index and "99 · widgets" in index, index[:500]
    assert describe(fingerprint()) in index, "the index should name the machine too"


def test_a_run_folder_without_a_fingerprint_is_refused_with_a_way_out(tmp_path, widget_run):
    shutil.copy(next(widget_run[0].parent.glob("99_*.ipynb")), tmp_path)
    with pytest.raises(handouts.MissingFingerprint, match="make run"):
        handouts.build(tmp_path / "out", tmp_path)


def test_a_gpu_check_folder_is_read_with_the_fingerprint_one_level_up(tmp_path, widget_run):
    (tmp_path / "notebooks").mkdir()  # make gpu-check: <out>/fingerprint.json, <out>/notebooks/
    shutil.copy(next(widget_run[0].parent.glob("99_*.ipynb")), tmp_path / "notebooks")
    (tmp_path / "fingerprint.json").write_text(json.dumps({**fingerprint(), "gpu": "NVIDIA H200"}))
    built = handouts.build(tmp_path / "out", tmp_path / "notebooks")
    assert "NVIDIA H200" in built[0].page.read_text(), "the page should name the GPU that ran it"


def _jupyter_layout(nb: dict) -> str:
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def test_reset_turns_a_notebook_run_in_the_lab_back_into_the_clean_one(tmp_path):
    clean = json.loads(TOUR.read_text())
    run = json.loads(TOUR.read_text())
    run["metadata"]["widgets"] = {handouts.WIDGET_STATE_MIME: {"state": {}}}
    for n, cell in enumerate(c for c in run["cells"] if c["cell_type"] == "code"):
        cell["execution_count"] = n + 1
        cell["metadata"]["execution"] = {"iopub.status.idle": "2026-11-29T10:00:00Z"}
        cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": ["group 1\n"]}]
    path = tmp_path / TOUR.name
    path.write_text(_jupyter_layout(run))
    assert handouts.strip(path), "strip should report that it changed the notebook"
    assert path.read_text() == _jupyter_layout(clean), \
        "after a reset, the notebook should differ from the committed one in nothing but layout"


def test_reset_leaves_clean_notebooks_untouched_byte_for_byte(tmp_path):
    for p in notebooks():
        shutil.copy(p, tmp_path)
    assert handouts.strip_folder(tmp_path) == [], "committed notebooks are clean already"
    for p in notebooks():
        assert (tmp_path / p.name).read_bytes() == p.read_bytes(), f"{p.name} was rewritten"


def test_reset_removes_checkpoints_that_hold_the_last_groups_outputs(tmp_path):
    (tmp_path / ".ipynb_checkpoints").mkdir()
    (tmp_path / ".ipynb_checkpoints" / "00_tour-checkpoint.ipynb").write_text("{}")
    handouts.strip_folder(tmp_path)
    assert not (tmp_path / ".ipynb_checkpoints").exists()


def test_a_page_shows_the_parameters_papermill_ran_with_once():
    from labkit.tools.handouts import static_notebook

    nb = {"cells": [{"cell_type": "code", "metadata": {"tags": ["parameters"]}, "outputs": [],
                     "source": "QUICK = False"},
                    {"cell_type": "code", "metadata": {"tags": ["injected-parameters"]},
                     "outputs": [], "source": "QUICK = True"},
                    {"cell_type": "code", "metadata": {}, "outputs": [], "source": "x = 1"}],
          "metadata": {}}
    static, _ = static_notebook(nb)
    assert [c["source"] for c in static["cells"]] == ["QUICK = True", "x = 1"]
    alone = {"cells": nb["cells"][:1] + nb["cells"][2:], "metadata": {}}
    assert len(static_notebook(alone)[0]["cells"]) == 2, "no injected cell: the defaults stay"
