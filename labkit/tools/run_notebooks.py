"""Execute notebooks headless through papermill, as `make run`, `make gpu-check` and the tests do.

A notebook declares its parameters in a cell tagged ``parameters``; passing a name it does not
declare is an error here (papermill itself would only warn), so a renamed parameter cannot
silently leave a notebook running at its defaults. Notebook metadata ``labkit`` holds
``expected_figures`` and ``time_budget_s``, checked after the run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from labkit.device import fingerprint
from labkit.teaching.truth import LOG_ENV
from labkit.tools import NOTEBOOK_DIR

PLOTLY_MIME = "application/vnd.plotly.v1+json"


@dataclass
class NotebookRun:
    notebook: str
    status: str  # "ok" or "failed"
    seconds: float
    figures: int
    expected_figures: int
    time_budget_s: float | None
    output: str
    size_bytes: int
    error: str = ""
    claims: list = field(default_factory=list)  # every claim the run made, in order
    # the cells that took longest, [(cell id, seconds)], slowest first: where a run's time went
    slowest_cells: list = field(default_factory=list)

    @property
    def claims_failed(self) -> int:
        return sum(not c["held"] for c in self.claims)


MAIN = "[0-9][0-9]_*.ipynb"          # 06_attention_backends: the sequence
APPENDIX = "[0-9][0-9][a-z]_*.ipynb"  # 06a_...: an optional deep dive after its main notebook


def notebooks(directory: Path = NOTEBOOK_DIR, appendices: bool = True) -> list[Path]:
    """The notebooks in order, each appendix right after its main notebook ('_' sorts before
    'a')."""
    found = list(directory.glob(MAIN)) + (list(directory.glob(APPENDIX)) if appendices else [])
    return sorted(found)


def declared_parameters(path: Path) -> set[str]:
    import papermill

    return set(papermill.inspect_notebook(str(path)))


def lab_metadata(nb: dict) -> dict:
    return nb.get("metadata", {}).get("labkit", {})


def count_figures(nb: dict) -> int:
    return sum(PLOTLY_MIME in out.get("data", {})
               for cell in nb.get("cells", []) if cell.get("cell_type") == "code"
               for out in cell.get("outputs", []))


def slowest_cells(nb: dict, top: int = 3) -> list[tuple[str, float]]:
    """The ``top`` code cells that took longest in an executed notebook, from the duration
    papermill writes into each cell's metadata: [(cell id, seconds)], slowest first."""
    timed = [(cell.get("id", f"cell {i}"), float(duration))
             for i, cell in enumerate(nb.get("cells", []))
             if (duration := cell.get("metadata", {}).get("papermill", {}).get("duration"))
             is not None]
    return [(cell, round(seconds, 1)) for cell, seconds in
            sorted(timed, key=lambda item: -item[1])[:top]]


def execute(path: Path, out_dir: Path, parameters: dict, timeout_s: int = 1800) -> NotebookRun:
    import papermill

    unknown = set(parameters) - declared_parameters(path)
    if unknown:
        raise ValueError(f"{path.name} declares no parameter(s) {sorted(unknown)}; its "
                         f"parameters cell has {sorted(declared_parameters(path))}")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / path.name
    log = out_dir / f"{path.stem}.claims.jsonl"
    log.unlink(missing_ok=True)
    t0 = time.perf_counter()
    error = ""
    before = os.environ.get(LOG_ENV)
    os.environ[LOG_ENV] = str(log)  # the kernel papermill starts inherits it
    try:
        papermill.execute_notebook(str(path), str(out), parameters=parameters,
                                   kernel_name="python3", cwd=str(path.parent),
                                   execution_timeout=timeout_s, progress_bar=False)
    except Exception as e:  # papermill raises PapermillExecutionError with the cell's traceback
        error = f"{type(e).__name__}: {e}"
    finally:
        if before is None:
            os.environ.pop(LOG_ENV, None)
        else:
            os.environ[LOG_ENV] = before
    seconds = time.perf_counter() - t0
    made = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    nb = json.loads(out.read_text()) if out.exists() else {}
    meta = lab_metadata(nb)
    return NotebookRun(
        notebook=path.stem, status="failed" if error else "ok", seconds=round(seconds, 1),
        figures=count_figures(nb), expected_figures=int(meta.get("expected_figures", 0)),
        time_budget_s=meta.get("time_budget_s"), output=str(out),
        size_bytes=out.stat().st_size if out.exists() else 0, error=error, claims=made,
        slowest_cells=slowest_cells(nb))


def summary_table(runs: list[NotebookRun]) -> str:
    lines = [f"{'notebook':<28} {'status':<7} {'seconds':>8} {'figures':>8} {'size':>9} "
             f"{'claims held':>12}"]
    for r in runs:
        held = f"{len(r.claims) - r.claims_failed}/{len(r.claims)}"
        lines.append(f"{r.notebook:<28} {r.status:<7} {r.seconds:>8.1f} "
                     f"{r.figures:>4}/{r.expected_figures:<3} {r.size_bytes / 1e3:>7.0f}kB "
                     f"{held:>12}")
        if r.slowest_cells:
            lines.append("    slowest cells: " + ", ".join(f"{cell} {seconds:.1f} s"
                                                           for cell, seconds in r.slowest_cells))
    ok = sum(r.status == "ok" for r in runs)
    lines.append(f"{ok} passed, {len(runs) - ok} failed")
    return "\n".join(lines)


def write_claims(runs: list[NotebookRun], path: Path) -> Path:
    """Every claim of every run, notebook by notebook, as the learner read it."""
    lines = []
    for r in runs:
        lines.append(f"## {r.notebook}: {len(r.claims) - r.claims_failed} of {len(r.claims)} "
                     "claims held")
        lines += [f"- {'held' if c['held'] else 'DID NOT HOLD'}: {c['claim']}"
                  + ("" if c["checked"] == "measured here" else f" ({c['checked']})")
                  for c in r.claims]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--quick", action="store_true", help="small sizes (as the tests run)")
    parser.add_argument("names", nargs="*", help="notebook stems or prefixes (default: all)")
    args = parser.parse_args(argv)
    paths = [p for p in notebooks()
             if not args.names or any(p.stem.startswith(n) for n in args.names)]
    args.out.mkdir(parents=True, exist_ok=True)
    # Which machine made these numbers: handouts print it at the top of every page.
    (args.out / "fingerprint.json").write_text(json.dumps(fingerprint(), indent=1))
    runs = []
    for path in paths:
        print(f"running {path.name} ...", flush=True)
        run = execute(path, args.out, {"DEVICE": args.device, "QUICK": args.quick})
        runs.append(run)
        if run.error:
            print(run.error.splitlines()[-1] if run.error.strip() else run.error, flush=True)
    (args.out / "summary.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    table = summary_table(runs)
    (args.out / "summary.txt").write_text(table + "\n")
    write_claims(runs, args.out / "claims.md")
    print(table)
    return 0 if all(r.status == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
