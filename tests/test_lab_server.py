"""`make lab` serves the notebooks on 127.0.0.1 only, and only to whoever holds the token."""
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from labkit.tools import lab_server

ROOT = Path(__file__).resolve().parent.parent


def test_make_lab_runs_the_lab_server_module():
    out = subprocess.run(["make", "--no-print-directory", "-n", "lab", f"VPY={sys.executable}",
                          "VENV=/nonexistent"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    assert [line for line in out.splitlines() if "jupyter" in line or "lab_server" in line] == \
        [f"{sys.executable} -m labkit.tools.lab_server"], "make lab must start the lab through lab_server"


def test_the_server_binds_to_localhost_and_keeps_a_token():
    cmd = lab_server.command()
    assert "--ServerApp.ip=127.0.0.1" in cmd
    assert not any(a.startswith(("--ServerApp.token=", "--IdentityProvider.token=")) for a in cmd), \
        "without an explicit token Jupyter generates one: never pass an empty one"
    with pytest.raises(ValueError, match="empty token"):
        lab_server.command(token="")


def test_lab_serves_the_notebooks_to_the_token_holder_only():
    with lab_server.running_lab() as lab:
        with urllib.request.urlopen(lab.url("api/contents"), timeout=10) as r:
            names = {item["name"] for item in json.load(r)["content"]}
        assert "00_tour.ipynb" in names, f"the lab's root is notebooks/: saw {sorted(names)}"
        assert lab_server.http_status(f"{lab.base_url}/api/contents") == 403, \
            "without the token the server refuses"
        proc = lab.process
    assert proc.poll() is not None, "the server is stopped when the context ends"
