"""Executed notebooks become static HTML handouts a workshop can read with no network at all.

Each page carries the fingerprint of the machine that ran the notebooks at the top, draws every
plotly figure with plotly.js inlined once per page (interactive: zoom, hover), and shows each
widget as the run left it (its controls' descriptions and values, and what its output area
held). ``index.html`` lists the pages. ``--strip`` resets notebooks to their committed state
(no outputs, no execution counts, no widget state) between workshop groups.

    python -m labkit.tools.handouts --out handouts/today --from runs/20261129-140221
    python -m labkit.tools.handouts --out handouts/today --quick 00 05   # executes them first
    python -m labkit.tools.handouts --strip notebooks/
"""
from __future__ import annotations

import argparse
import copy
import html
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from labkit.device import describe
from labkit.tools.run_notebooks import PLOTLY_MIME, notebooks

WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE_MIME = "application/vnd.jupyter.widget-state+json"
FINGERPRINT_FILE = "fingerprint.json"

# The lab template with every CDN script taken out (require.js, MathJax, mermaid, the widget
# manager): a handout page loads nothing but itself.
TEMPLATE = r"""{%- extends 'index.html.j2' -%}
{% block html_head_js_requirejs %}{% endblock html_head_js_requirejs %}
{% block jupyter_widgets %}{% endblock jupyter_widgets %}
{% block html_head_js_mathjax %}{% endblock html_head_js_mathjax %}
{% block html_head_js_mermaidjs %}{% endblock html_head_js_mermaidjs %}
{% block extra_css %}
<style>{{ resources.labkit_css }}</style>
<script>{{ resources.labkit_plotly_js }}</script>
{% endblock extra_css %}
{% block body_header %}{{ super() }}{{ resources.labkit_header }}{% endblock body_header %}
"""

CSS = """
.labkit-run { font-family: var(--jp-ui-font-family, sans-serif); margin: 1em 0 2em;
  padding: .6em 1em; border-left: 4px solid #4a7bd0; background: #f3f6fb; }
.labkit-run table { border-collapse: collapse; font-size: 85%; }
.labkit-run td { padding: 0 1em 0 0; }
.labkit-widget { border: 1px dashed #999; padding: .5em; margin: .3em 0; }
.labkit-widget-note { font-size: 80%; color: #666; }
.labkit-control { margin: .2em 0; } .labkit-control label { display: inline-block; min-width: 9em; }
"""


class MissingFingerprint(FileNotFoundError):
    pass


@dataclass
class Handout:
    notebook: str
    title: str
    page: Path
    figures: int
    failed: bool


def load_fingerprint(run_dir: Path) -> dict:
    """The run's fingerprint.json: in the run folder (make run) or its parent (make gpu-check)."""
    for folder in (run_dir, run_dir.parent):
        if (folder / FINGERPRINT_FILE).exists():
            return json.loads((folder / FINGERPRINT_FILE).read_text())
    raise MissingFingerprint(
        f"{run_dir} has no {FINGERPRINT_FILE} (nor has its parent), so a handout could not say "
        "which machine produced its numbers. Run the notebooks again with `make run` or "
        "`make gpu-check` (both record it), or build without --from to execute them here.")


# --- plotly: JSON outputs become a div and one Plotly.newPlot call ------------------------------

def figure_html(figure: dict, div_id: str) -> str:
    spec = {"data": figure.get("data", []), "layout": figure.get("layout", {}),
            "config": {"displaylogo": False, "responsive": True, **figure.get("config", {})}}
    # "</" inside a string would end the <script> element early.
    payload = json.dumps(spec).replace("</", "<\\/")
    return (f'<div id="{div_id}" class="labkit-figure"></div>\n'
            f'<script>(function () {{ var f = {payload};\n'
            f'Plotly.newPlot("{div_id}", f.data, f.layout, f.config); }})();</script>')


def _html_output(text: str) -> dict:
    return {"output_type": "display_data", "data": {"text/html": text}, "metadata": {}}


# --- widgets: the saved widget state, drawn as plain disabled HTML controls ---------------------

def _control_html(model_name: str, s: dict) -> str:
    label = f"<label>{html.escape(str(s.get('description', '')))}</label>"
    if model_name.endswith("SliderModel") and not isinstance(s.get("value"), list):
        return (f'{label}<input type="range" disabled min="{s.get("min")}" max="{s.get("max")}" '
                f'step="{s.get("step")}" value="{s.get("value")}"> <output>{s.get("value")}</output>')
    if "_options_labels" in s:
        index = s.get("index")
        chosen = index if isinstance(index, (list, tuple)) else [index]
        options = "".join(f"<option{' selected' if i in chosen else ''}>{html.escape(o)}</option>"
                          for i, o in enumerate(s["_options_labels"]))
        return f"{label}<select disabled>{options}</select>"
    if model_name == "ButtonModel":
        return f"<button disabled>{html.escape(s.get('description', ''))}</button>"
    if model_name in ("CheckboxModel", "ToggleButtonModel"):
        return f'{label}<input type="checkbox" disabled{" checked" if s.get("value") else ""}>'
    if model_name == "HTMLModel":
        return f"{label}{s.get('value', '')}"
    return f"{label}<output>{html.escape(str(s.get('value', '')))}</output>"


def widget_parts(model_id: str, state: dict) -> tuple[list[str], list[dict]]:
    """(html of each control, outputs the widget's output areas held) for one widget tree."""
    model = state.get(model_id)
    if model is None:
        return [], []
    name, s = model.get("model_name", ""), model.get("state", {})
    if name == "OutputModel":
        return [], list(s.get("outputs", []))
    if "children" in s:
        controls, outputs = [], []
        for child in s["children"]:
            c, o = widget_parts(str(child).removeprefix("IPY_MODEL_"), state)
            controls += c
            outputs += o
        return controls, outputs
    if "value" in s or "description" in s:
        return [f'<div class="labkit-control">{_control_html(name, s)}</div>'], []
    return [], []


def _widget_outputs(output: dict, state: dict) -> list[dict]:
    model_id = output["data"][WIDGET_VIEW_MIME].get("model_id", "")
    controls, held = widget_parts(model_id, state)
    if model_id not in state:
        repr_ = "".join(output["data"].get("text/plain", "widget"))
        controls = [f"<pre>{html.escape(repr_)}</pre>"]
    note = ('<div class="labkit-widget-note">widget: interactive in the lab; shown here as the run '
            "left it</div>")
    box = _html_output(f'<div class="labkit-widget">{note}{"".join(controls)}</div>')
    return [box] + [o for o in held if o.get("output_type") != "display_data" or o.get("data")]


def static_notebook(nb: dict) -> tuple[dict, int]:
    """A copy of an executed notebook that nbconvert renders with no JavaScript beyond plotly.js.

    Returns (notebook, number of figures)."""
    nb = copy.deepcopy(nb)
    state = nb.get("metadata", {}).pop("widgets", {}).get(WIDGET_STATE_MIME, {}).get("state", {})
    tags = [c.get("metadata", {}).get("tags", []) for c in nb.get("cells", [])]
    if any("injected-parameters" in t for t in tags):  # papermill's values replace the defaults
        nb["cells"] = [c for c, t in zip(nb["cells"], tags) if "parameters" not in t]
    figures = 0
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        expanded = []
        for out in cell.get("outputs", []):
            expanded += _widget_outputs(out, state) if WIDGET_VIEW_MIME in out.get("data", {}) else [out]
        outputs = []
        for out in expanded:
            if PLOTLY_MIME in out.get("data", {}):
                figures += 1
                out = {"output_type": "display_data", "metadata": {},
                       "data": {"text/html": figure_html(out["data"][PLOTLY_MIME], f"figure-{figures}")}}
            outputs.append(out)
        cell["outputs"] = outputs
    return nb, figures


# --- pages -----------------------------------------------------------------------------------

def run_header(fp: dict, nb: dict | None = None) -> str:
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
                   for k, v in fp.items())
    pm = (nb or {}).get("metadata", {}).get("papermill", {})
    when = (f"<p>executed {html.escape(str(pm.get('end_time', ''))[:19].replace('T', ' '))} UTC, "
            f"parameters {html.escape(json.dumps(pm.get('parameters', {})))}</p>" if pm else "")
    return (f'<header class="labkit-run" id="labkit-fingerprint"><p>Ran on <strong>'
            f"{html.escape(describe(fp))}</strong></p>{when}"
            f"<details><summary>machine fingerprint</summary><table>{rows}</table></details></header>")


def _title(nb: dict, fallback: str) -> str:
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            for line in "".join(cell.get("source", "")).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    return fallback


def _failed(nb: dict) -> bool:
    return any(o.get("output_type") == "error"
               for c in nb.get("cells", []) for o in c.get("outputs", []))


def render_page(nb: dict, fp: dict, plotly_js: str) -> tuple[str, int]:
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter

    static, figures = static_notebook(nb)
    exporter = HTMLExporter(template_name="lab", template_file="labkit_handout.html.j2",
                            extra_loaders=[jinja2.DictLoader({"labkit_handout.html.j2": TEMPLATE})])
    body, _ = exporter.from_notebook_node(
        nbformat.reads(json.dumps(static), as_version=4),  # joins list-of-lines sources
        resources={"labkit_header": run_header(fp, nb), "labkit_css": CSS,
                   "labkit_plotly_js": plotly_js})
    return body, figures


def index_html(handouts: list[Handout], fp: dict) -> str:
    rows = "".join(
        f'<tr><td><a href="{h.page.name}">{html.escape(h.notebook)}</a></td>'
        f"<td>{html.escape(h.title)}</td><td>{h.figures}</td>"
        f"<td>{'FAILED: the page shows the error' if h.failed else 'ok'}</td></tr>"
        for h in handouts)
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>labkit handouts'
            f"</title><style>{CSS} body {{ font-family: sans-serif; margin: 2em; }} td {{ padding: "
            f"0 1em 0 0; }}</style></head><body><h1>labkit handouts</h1>{run_header(fp)}"
            f"<table><tr><th>notebook</th><th>title</th><th>figures</th><th>run</th></tr>{rows}"
            "</table></body></html>\n")


def build(out: Path, run_dir: Path | None = None, names: list[str] | tuple = (),
          quick: bool = False, device: str = "auto") -> list[Handout]:
    """Pages for the executed notebooks in ``run_dir``; without one, executes them into out/notebooks."""
    import plotly

    if run_dir is None:
        from labkit.tools import run_notebooks

        run_dir = out / "notebooks"
        run_notebooks.main(["--out", str(run_dir), "--device", device, *(["--quick"] if quick else []),
                            *names])
    fp = load_fingerprint(run_dir)
    paths = [p for p in notebooks(run_dir) if not names or any(p.stem.startswith(n) for n in names)]
    if not paths:
        raise FileNotFoundError(f"no executed notebooks (NN_name.ipynb) in {run_dir}"
                                + (f" matching {list(names)}" if names else ""))
    plotly_js = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_text()
    out.mkdir(parents=True, exist_ok=True)
    handouts = []
    for path in paths:
        nb = json.loads(path.read_text())
        body, figures = render_page(nb, fp, plotly_js)
        page = out / f"{path.stem}.html"
        page.write_text(body)
        handouts.append(Handout(path.stem, _title(nb, path.stem), page, figures, _failed(nb)))
    (out / "index.html").write_text(index_html(handouts, fp))
    return handouts


# --- reset between groups --------------------------------------------------------------------

def strip(path: Path) -> bool:
    """Clear what running a notebook adds. Returns whether the file changed (a clean one is left
    untouched, byte for byte)."""
    nb = json.loads(path.read_text())
    before = json.dumps(nb, sort_keys=True)
    for key in ("widgets", "papermill"):
        nb.get("metadata", {}).pop(key, None)
    for cell in nb.get("cells", []):
        for key in ("execution", "ExecuteTime", "papermill"):
            cell.get("metadata", {}).pop(key, None)
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
    if json.dumps(nb, sort_keys=True) == before:
        return False
    # Jupyter's own layout, so a notebook saved in the lab and then reset diffs only where it was edited.
    path.write_text(json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    return True


def strip_folder(folder: Path) -> list[Path]:
    changed = [p for p in sorted(folder.glob("*.ipynb")) if strip(p)]
    # JupyterLab's checkpoints keep the last group's outputs one "Revert" away.
    shutil.rmtree(folder / ".ipynb_checkpoints", ignore_errors=True)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="folder for the HTML pages")
    parser.add_argument("--from", dest="run_dir", type=Path,
                        help="a `make run` folder of executed notebooks (default: execute them now)")
    parser.add_argument("--quick", action="store_true", help="when executing: small sizes")
    parser.add_argument("--device", default="auto", help="when executing: auto, cuda or cpu")
    parser.add_argument("--strip", type=Path, metavar="FOLDER",
                        help="instead: remove outputs and widget state from FOLDER/*.ipynb")
    parser.add_argument("names", nargs="*", help="notebook stems or prefixes (default: all)")
    args = parser.parse_args(argv)
    if args.strip:
        changed = strip_folder(args.strip)
        print(f"reset {len(changed)} notebook(s) in {args.strip}: "
              + (", ".join(p.name for p in changed) or "all were already clean"))
        return 0
    if args.out is None:
        parser.error("--out is required (or --strip FOLDER)")
    try:
        handouts = build(args.out, args.run_dir, args.names, args.quick, args.device)
    except (FileNotFoundError, ValueError) as e:
        print(f"labkit.tools.handouts: {e}", file=sys.stderr)
        return 2
    for h in handouts:
        print(f"{h.page}  {h.figures} figures{'  (the run FAILED: the page shows the error)' if h.failed else ''}")
    print(f"open {args.out / 'index.html'}")
    return 1 if any(h.failed for h in handouts) else 0


if __name__ == "__main__":
    sys.exit(main())
