"""JupyterLab for the lab: bound to 127.0.0.1, always behind a token. `make lab` runs this.

The same command serves the tests (``running_lab``), with fresh settings, workspace and runtime
folders so a test never reads or writes the learner's own Jupyter state. To reach a lab on a
remote GPU host, forward the port over SSH (see the README) rather than binding wider.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from labkit.tools import NOTEBOOK_DIR

# Out of the box JupyterLab asks on its first page whether to fetch Jupyter's news, and later
# announces new releases: pop-ups over the notebook that the lab is not about. These are
# defaults, layered below the learner's own settings, so a learner who wants news can opt in.
SETTING_DEFAULTS = {
    "@jupyterlab/apputils-extension:notification": {"fetchNews": "false",
                                                    "checkForUpdates": False},
}
# The workshop extra (`.[hub]`) brings nbgrader, whose JupyterLab extension adds an instructor's
# menus and panels, and with it the classic Notebook's "open in Notebook" button: neither is
# part of a learner's lab, so the lab this module starts leaves them off.
DISABLED_EXTENSIONS = {"@jupyter/nbgrader": True, "@jupyter-notebook/lab-extension": True}


def command(root_dir: Path = NOTEBOOK_DIR, port: int | None = None,
            token: str | None = None, expose_app: bool = False) -> list[str]:
    """The jupyter lab command line. Without ``token`` Jupyter generates one and prints the URL."""
    cmd = [sys.executable, "-m", "jupyter", "lab", f"--ServerApp.root_dir={root_dir}",
           "--ServerApp.ip=127.0.0.1", "--ServerApp.open_browser=False"]
    if port is not None:
        cmd += [f"--ServerApp.port={port}", "--ServerApp.port_retries=0"]
    if token is not None:
        if not token:
            raise ValueError("an empty token would let anyone on this machine run code: refused")
        cmd.append(f"--IdentityProvider.token={token}")
    cmd.append("--LabApp.news_url=None")  # the server fetches no news feed either
    if expose_app:  # lets a browser test drive JupyterLab's command registry
        cmd.append("--LabApp.expose_app_in_browser=True")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")  # containers and CI run as root; Jupyter refuses without this
    return cmd


def lab_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with a Jupyter config folder holding ``SETTING_DEFAULTS``
    and ``DISABLED_EXTENSIONS`` put on JUPYTER_CONFIG_PATH, where JupyterLab reads
    ``labconfig/default_setting_overrides.json`` and ``labconfig/page_config.json``.

    The folder sits in the runtime folder ``env`` names (else Jupyter's own runtime folder) and
    is rewritten on every start.
    """
    from jupyter_core.paths import jupyter_runtime_dir

    env = dict(os.environ if env is None else env)
    runtime = Path(env.get("JUPYTER_RUNTIME_DIR") or jupyter_runtime_dir())
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)  # Jupyter keeps its own this private
    folder = runtime / "labkit-config"
    (folder / "labconfig").mkdir(parents=True, exist_ok=True)
    (folder / "labconfig" / "default_setting_overrides.json").write_text(
        json.dumps(SETTING_DEFAULTS, indent=1))
    (folder / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": DISABLED_EXTENSIONS}, indent=1))
    env["JUPYTER_CONFIG_PATH"] = os.pathsep.join(
        p for p in (str(folder), env.get("JUPYTER_CONFIG_PATH")) if p)
    return env


def student_notebooks(folder: Path) -> Path:
    """The student copy's notebooks under ``folder`` (what ``make student`` writes), written now
    when ``folder`` holds none. An existing copy is the learner's work: it is served as it is,
    never rewritten (remove the folder for a fresh one)."""
    from labkit.tools import student

    notebooks = folder / "notebooks"
    if any(notebooks.glob("*.ipynb")):
        print(f"labkit: serving the student copy already in {folder} (your edits are kept; "
              f"remove {folder} for a fresh one)", flush=True)
    else:
        files = student.write_copy(folder)
        print(f"labkit: wrote a student copy (solutions replaced by stubs), {len(files)} files, "
              f"into {folder}", flush=True)
    return notebooks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str) -> int:
    """HTTP status of a GET, or 0 while nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


@dataclass
class RunningLab:
    base_url: str
    token: str
    process: subprocess.Popen
    root_dir: Path

    def url(self, path: str = "lab") -> str:
        sep = "&" if "?" in path else "?"
        return f"{self.base_url}/{path}{sep}token={self.token}"


@contextlib.contextmanager
def running_lab(root_dir: Path = NOTEBOOK_DIR, start_timeout_s: float = 90, expose_app=False,
                windowed: bool = True):
    """Start JupyterLab with a random token and fresh state folders; stop it and its children."""
    port, token = free_port(), secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="labkit-jupyter-") as state:
        env = dict(os.environ, JUPYTER_CONFIG_DIR=f"{state}/config",
                   JUPYTER_RUNTIME_DIR=f"{state}/runtime", JUPYTER_DATA_DIR=f"{state}/data",
                   JUPYTERLAB_SETTINGS_DIR=f"{state}/settings",
                   JUPYTERLAB_WORKSPACES_DIR=f"{state}/workspaces", IPYTHONDIR=f"{state}/ipython")
        # Kernels are found through sys.prefix too, so the venv's python3 kernel stays visible.
        if not windowed:  # render every cell, so a test can see every output
            path = Path(f"{state}/settings/@jupyterlab/notebook-extension/tracker.jupyterlab-settings")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text('{"windowingMode": "none"}')
        env = lab_environment(env)
        log = Path(f"{state}/server.log")
        with log.open("w") as log_file:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(command(root_dir, port, token, expose_app), env=env,
                                    stdout=subprocess.DEVNULL, stderr=log_file,
                                    start_new_session=True)
        lab = RunningLab(f"http://127.0.0.1:{port}", token, proc, Path(root_dir))
        try:
            deadline = time.time() + start_timeout_s
            while http_status(lab.url("api/status")) != 200:
                if proc.poll() is not None:
                    raise RuntimeError(f"jupyter lab exited at start:\n{log.read_text()[-3000:]}")
                if time.time() > deadline:
                    raise TimeoutError(f"jupyter lab did not answer within {start_timeout_s} s")
                time.sleep(0.3)
            yield lab
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)


def main(argv: list[str] | None = None) -> int:
    """Replace this process by JupyterLab (``exec``), so a signal sent to what ``make lab``
    started (Ctrl-C, ``kill -TERM``) reaches the server itself and it shuts down with its
    kernels, rather than leaving them running without a parent."""
    parser = argparse.ArgumentParser(
        description="JupyterLab on 127.0.0.1 behind a token, rooted at notebooks/ (`make lab`).")
    parser.add_argument("--port", type=int, help="port to listen on (default: Jupyter's 8888 "
                        "or the next free one)")
    parser.add_argument("--root-dir", type=Path, default=NOTEBOOK_DIR,
                        help="folder to serve (default: %(default)s)")
    parser.add_argument("--student", type=Path, metavar="FOLDER",
                        help="serve the student copy in FOLDER/notebooks, writing it first if "
                        "FOLDER has none (`make lab STUDENT=1` uses student/)")
    args = parser.parse_args(argv)
    if args.port is not None and not 0 < args.port < 65536:
        parser.error(f"--port must be in 1..65535, got {args.port}")
    if args.student is not None and args.root_dir != NOTEBOOK_DIR:
        parser.error("--student serves the student copy's notebooks: leave --root-dir out")
    root_dir = student_notebooks(args.student) if args.student is not None else args.root_dir
    cmd = command(root_dir, args.port)
    env = lab_environment()
    sys.stdout.flush()
    os.execve(cmd[0], cmd, env)
    return 0  # not reached: exec does not return


if __name__ == "__main__":
    sys.exit(main())
