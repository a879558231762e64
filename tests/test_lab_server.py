"""`make lab` serves the notebooks on 127.0.0.1 only, and only to whoever holds the token."""
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lab_command() -> list[str]:
    out = subprocess.run(["make", "-n", "lab", "VPY=" + sys.executable, "VENV=/nonexistent"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if "jupyter lab" in l)
    return shlex.split(line)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, ConnectionError):
        return 0  # not listening yet


def test_make_lab_binds_to_localhost_and_never_disables_the_token():
    cmd = _lab_command()
    assert "--ServerApp.ip=127.0.0.1" in cmd
    assert not any(a.startswith(("--ServerApp.token=", "--IdentityProvider.token=")) for a in cmd), \
        "make lab must keep Jupyter's generated token"


def test_lab_serves_the_notebooks_to_the_token_holder_only(tmp_path):
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "cfg"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "rt"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"))
    cmd = _lab_command() + [f"--ServerApp.port={port}", f"--IdentityProvider.token={token}",
                            "--ServerApp.port_retries=0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while time.time() < deadline and _get(f"{base}/api/status?token={token}") != 200:
            assert proc.poll() is None, "jupyter lab exited at start"
            time.sleep(0.5)
        assert _get(f"{base}/api/contents?token={token}") == 200
        with urllib.request.urlopen(f"{base}/api/contents?token={token}", timeout=5) as r:
            names = {item["name"] for item in json.load(r)["content"]}
        assert "00_tour.ipynb" in names, f"the lab's root is notebooks/: saw {sorted(names)}"
        assert _get(f"{base}/api/contents") == 403, "without the token the server refuses"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.poll() is not None
