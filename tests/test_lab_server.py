"""`make lab` serves the notebooks on 127.0.0.1 only, and only to whoever holds the token."""
import json
import os
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


def test_the_lab_starts_without_news_or_update_pop_ups(tmp_path):
    cmd = lab_server.command()
    assert "--LabApp.news_url=None" in cmd, "the server fetches no news feed"
    env = lab_server.lab_environment({"JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
                                      "JUPYTER_CONFIG_PATH": "/elsewhere"})
    first, *rest = env["JUPYTER_CONFIG_PATH"].split(os.pathsep)
    assert rest == ["/elsewhere"], "a config path already set is kept, below labkit's"
    defaults = json.loads((Path(first) / "labconfig/default_setting_overrides.json").read_text())
    assert defaults["@jupyterlab/apputils-extension:notification"] == \
        {"fetchNews": "false", "checkForUpdates": False}


def test_lab_serves_the_notebooks_to_the_token_holder_only():
    with lab_server.running_lab() as lab:
        with urllib.request.urlopen(lab.url("api/contents"), timeout=10) as r:
            names = {item["name"] for item in json.load(r)["content"]}
        plugin = "@jupyterlab/apputils-extension:notification"
        with urllib.request.urlopen(lab.url(f"lab/api/settings/{plugin}"), timeout=10) as r:
            answer = json.load(r)  # the composite is the schema's defaults under the user's
        notification = {k: v.get("default") for k, v in answer["schema"]["properties"].items()}
        notification.update(answer["settings"])
        assert notification["fetchNews"] == "false" and notification["checkForUpdates"] is False, \
            f"JupyterLab would ask about news or announce releases: {notification}"
        assert "00_tour.ipynb" in names, f"the lab's root is notebooks/: saw {sorted(names)}"
        assert lab_server.http_status(f"{lab.base_url}/api/contents") == 403, \
            "without the token the server refuses"
        proc = lab.process
    assert proc.poll() is not None, "the server is stopped when the context ends"


def test_a_learners_lab_leaves_the_instructors_extensions_off():
    with lab_server.running_lab() as lab:
        with urllib.request.urlopen(lab.url("lab"), timeout=20) as r:
            page = r.read().decode()
    start = page.index('>', page.index('id="jupyter-config-data"')) + 1
    config = json.loads(page[start:page.index("</script>", start)])
    disabled = config["disabledExtensions"]
    for name in lab_server.DISABLED_EXTENSIONS:
        assert name in disabled, f"{name} is on in a learner's lab: {disabled}"


def test_lab_server_help_prints_usage_and_starts_nothing():
    out = subprocess.run([sys.executable, "-m", "labkit.tools.lab_server", "--help"],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0 and "usage:" in out.stdout and "--port" in out.stdout


def test_sigterm_to_what_make_lab_starts_stops_the_server(tmp_path):
    """`make lab` runs `python -m labkit.tools.lab_server`: a SIGTERM to that process must close
    the port, not leave JupyterLab running under init."""
    import contextlib
    import os
    import signal
    import time

    port = lab_server.free_port()
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_DATA_DIR=str(tmp_path / "data"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"), IPYTHONDIR=str(tmp_path / "ipy"))
    proc = subprocess.Popen([sys.executable, "-m", "labkit.tools.lab_server", "--port", str(port)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.time() + 90
        while lab_server.http_status(f"http://127.0.0.1:{port}/api/status") == 0:
            assert proc.poll() is None, "the lab server exited at start"
            assert time.time() < deadline, "the lab server did not listen within 90 s"
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert lab_server.http_status(f"http://127.0.0.1:{port}/api/status") == 0, \
            "after SIGTERM nothing may listen on the lab's port"
    finally:  # whatever the wrapper left behind is in its process group
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_make_lab_student_serves_the_student_copy():
    out = subprocess.run(["make", "--no-print-directory", "-n", "lab", "STUDENT=1",
                          f"VPY={sys.executable}", "VENV=/nonexistent"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert f"{sys.executable} -m labkit.tools.lab_server --student student" in out.splitlines()


def test_the_student_copy_is_written_once_and_the_learners_edits_are_kept(tmp_path, capsys):
    served = lab_server.student_notebooks(tmp_path / "student")
    assert served == tmp_path / "student" / "notebooks"
    copy = served / "02_cuda_graphs.ipynb"
    assert "BEGIN SOLUTION" in copy.read_text() and "NotImplementedError" in copy.read_text(), \
        "the served notebooks are the student copy: solutions replaced by stubs"
    assert (tmp_path / "student" / "kernels" / "exercises").is_dir()
    copy.write_text(copy.read_text().replace("NotImplementedError", "MyAnswer"))
    assert lab_server.student_notebooks(tmp_path / "student") == served
    assert "MyAnswer" in copy.read_text(), "a second start must not overwrite the learner's work"
    assert "edits are kept" in capsys.readouterr().out


def test_student_and_root_dir_together_are_refused(capsys):
    with pytest.raises(SystemExit):
        lab_server.main(["--student", "student", "--root-dir", "/tmp"])
    assert "--student" in capsys.readouterr().err
