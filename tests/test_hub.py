"""The workshop hub, end to end on loopback: JupyterHub with configurable-http-proxy, two
learners, each with their own JupyterLab, working copy and device; one learner's token cannot
read the other's files; everything stops when the hub does."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
# The hub extra (make venv installs it; a GPU host running `make gpu-check` has only the
# notebook stack): without it these tests cannot import what they test.
pytest.importorskip("jupyterhub", reason="needs the hub extra: pip install -e .[hub]")
from traitlets import TraitError

from labkit.tools.hub import PROXY, LabkitSpawner, assign_device, defaults
from labkit.tools.lab_server import free_port

DEVICES = ["MIG-11111111-aaaa-5555-8888-000000000001", "MIG-22222222-bbbb-5555-8888-000000000002"]
LEARNERS = ("alice", "bob")
DEADLINE_S = 40  # for each wait below; the whole test takes about 20 s on two cores

# What both hub tests configure: a dummy authenticator (tests only, on loopback: never a
# shipped default), the hub's internal port, the proxy's API, an instructor service token with
# the admin role, and how long a spawn may take.
COMMON_CONFIG = """
c.JupyterHub.authenticator_class = "dummy"
c.Authenticator.allowed_users = {learners!r}
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
c.JupyterHub.services = [{{"name": "instructor", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{"name": "admin", "services": ["instructor"]}}]
c.Spawner.start_timeout = c.Spawner.http_timeout = {deadline}
c.LocalProcessSpawner.interrupt_timeout = 5
"""
CONFIG = COMMON_CONFIG + """
c.JupyterHub.spawner_class = "labkit.tools.hub.OneAccountSpawner"
c.LabkitSpawner.devices = {devices!r}
"""


def test_devices_go_in_turn_by_user_id_and_a_fixed_map_wins():
    devices = ["0", "1", "2"]
    assert [assign_device(f"u{i}", i, devices, {}) for i in range(1, 8)] == list("0120120")
    assert assign_device("ada", 1, devices, {"ada": "MIG-abc"}) == "MIG-abc"
    assert assign_device("ada", 1, [], {}) is None  # nothing configured: CUDA_VISIBLE_DEVICES unset


def test_a_device_that_is_not_one_is_refused_naming_the_setting():
    with pytest.raises((TraitError, ValueError), match=r"LabkitSpawner.devices\[1\] = 'cuda:1'"):
        LabkitSpawner(devices=["0", "cuda:1"])
    with pytest.raises((TraitError, ValueError), match=r"device_map\['ada'\].*nvidia-smi -L"):
        LabkitSpawner(device_map={"ada": "gpu0"})


def test_the_shipped_hub_signs_in_with_pam_on_loopback(tmp_path):
    c = defaults(tmp_path, "127.0.0.1", 8000)
    assert c.JupyterHub.authenticator_class == "pam"
    assert c.JupyterHub.ip == "127.0.0.1"
    assert c.JupyterHub.spawner_class == "labkit.tools.hub.LabkitSpawner"


def call(method: str, url: str, token: str, body: dict | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(url, method=method, headers={"Authorization": f"token {token}"},
                                     data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            text = r.read()
            return r.status, json.loads(text) if text else {}
    except urllib.error.HTTPError as e:
        return e.code, {}
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}


def wait_for(what: str, check, log: Path):
    deadline = time.time() + DEADLINE_S
    while not (result := check()):
        if time.time() > deadline:
            raise TimeoutError(f"{what} within {DEADLINE_S} s; the hub's log ends:\n"
                               f"{log.read_text()[-4000:]}")
        time.sleep(0.3)
    return result


def ready_server(user_url: str, token: str) -> dict | None:
    """The user's default server as the hub's API shows it, once it is ready."""
    server = call("GET", user_url, token)[1].get("servers", {}).get("", {})
    return server if server.get("ready") else None


def in_own_loop(coro):
    """``asyncio.run(coro)`` on a thread of its own: in the full suite an earlier test (the
    browser test's Playwright) leaves an event loop running in the main thread."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def run_cell(ws_url: str, token: str, code: str) -> str:
    """Execute ``code`` in a kernel through the server's kernel websocket; its stdout."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    ws = await websocket_connect(HTTPRequest(ws_url, headers={"Authorization": f"token {token}"},
                                             connect_timeout=10, request_timeout=10))
    msg_id = uuid.uuid4().hex
    ws.write_message(json.dumps({
        "header": {"msg_id": msg_id, "msg_type": "execute_request", "session": uuid.uuid4().hex,
                   "username": "test", "version": "5.3"},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": code, "silent": False, "store_history": False,
                    "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}}))
    out = []
    try:
        while True:
            msg = json.loads(await asyncio.wait_for(ws.read_message(), DEADLINE_S))
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                raise AssertionError("\n".join(msg["content"]["traceback"]))
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return "".join(out)
    finally:
        ws.close()


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent to read its exit status."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def start_hub(python: str, port: int, config, hub_dir, cwd, log) -> subprocess.Popen:
    """``python -m labkit.tools.hub`` on ``port`` with ``config``, its output in ``log``, in a
    session of its own (so the test can stop it and everything it started)."""
    with log.open("w") as log_file:
        return subprocess.Popen([python, "-m", "labkit.tools.hub", "--port", str(port),
                                 "--config", str(config), "--hub-dir", str(hub_dir)],
                                cwd=cwd, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)


def spawn_servers(hub, url: str, token: str, names, hub_dir, log) -> tuple[int, dict]:
    """Once the hub answers through the proxy's public port (hub and proxy both up), start a
    server for each learner in ``names`` and make each a token: (proxy pid, {name: token})."""
    wait_for("the hub did not answer through the proxy",
             lambda: hub.poll() is not None or call("GET", f"{url}/hub/api/", token)[0] == 200,
             log)
    assert hub.poll() is None, f"the hub exited at start:\n{log.read_text()[-4000:]}"
    proxy = int((hub_dir / "private" / "jupyterhub-proxy.pid").read_text())
    tokens = {}
    for name in names:
        status, _ = call("POST", f"{url}/hub/api/users/{name}/server", token)
        assert status in (201, 202), f"spawning {name}'s server: HTTP {status}"
        status, reply = call("POST", f"{url}/hub/api/users/{name}/tokens", token,
                             {"note": "test", "expires_in": 600})
        assert status == 201, f"a token for {name}: HTTP {status}"
        tokens[name] = reply["token"]
    return proxy, tokens


def kernel_reports(port: int, name: str, token: str, expressions: str) -> list:
    """Start a kernel for a notebook of ``name``'s copy, as opening it in JupyterLab does, run
    ``print(json.dumps([expressions]))`` in it and return the list it printed."""
    lab = f"http://127.0.0.1:{port}/user/{name}/api"
    status, session = call("POST", f"{lab}/sessions", token, {
        "path": "00_tour.ipynb", "type": "notebook", "kernel": {"name": "python3"}})
    assert status == 201, f"{name} starting a notebook's kernel: HTTP {status}"
    ws_url = f"ws://127.0.0.1:{port}/user/{name}/api/kernels/{session['kernel']['id']}/channels"
    return json.loads(in_own_loop(run_cell(ws_url, token, "import json, os\nprint(json.dumps(["
                                           f"{expressions}]))")))


def stop_and_check(hub, pids: dict, log) -> None:
    """SIGTERM the hub, which stops the learners' servers and the proxy: nothing in ``pids``
    may still run a little later."""
    hub.send_signal(signal.SIGTERM)
    hub.wait(timeout=DEADLINE_S)
    deadline = time.time() + DEADLINE_S
    while (left := [what for what, pid in pids.items() if alive(pid)]) and time.time() < deadline:
        time.sleep(0.3)
    assert not left, f"still running after the hub stopped: {left}\n{log.read_text()[-4000:]}"


def clean_up(hub, pids: dict) -> None:
    """After a failure too: the hub stops what it started, else it and they are killed (only
    what the test started, and only if it is still there)."""
    if hub.poll() is None:
        hub.send_signal(signal.SIGTERM)
        try:
            hub.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            os.killpg(hub.pid, signal.SIGKILL)
            hub.wait(timeout=10)
    for pid in pids.values():
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(180)
def test_two_learners_each_get_their_own_lab_copy_and_device_and_nothing_outlives_the_hub(tmp_path):
    if not PROXY.exists():
        pytest.fail(f"configurable-http-proxy is not installed at {PROXY}: `make hub` and "
                    f"`make test` install it from npm (npm ci in hub/)")
    port, token = free_port(), secrets.token_hex(16)
    config = tmp_path / "workshop_config.py"
    config.write_text(CONFIG.format(learners=set(LEARNERS), devices=DEVICES, hub_port=free_port(),
                                    api_port=free_port(), token=token, deadline=DEADLINE_S))
    log = tmp_path / "hub.log"
    hub = start_hub(sys.executable, port, config, tmp_path / "hub", tmp_path, log)
    base = f"http://127.0.0.1:{port}"
    pids: dict[str, int] = {}
    try:
        pids["proxy"], tokens = spawn_servers(hub, base, token, LEARNERS, tmp_path / "hub", log)
        for name in LEARNERS:
            server = wait_for(f"{name}'s server was not ready",
                              lambda: ready_server(f"{base}/hub/api/users/{name}", token), log)
            pids[f"{name}'s server"] = server["state"]["pid"]

        seen = {}
        for name in LEARNERS:
            lab = f"{base}/user/{name}/api"
            status, listing = call("GET", f"{lab}/contents", tokens[name])
            assert status == 200, f"{name} reading their own files: HTTP {status}"
            assert "00_tour.ipynb" in {f["name"] for f in listing["content"]}, (
                f"{name}'s lab does not open on the student notebooks: {listing['content']}")
            seen[name], cwd, pids[f"{name}'s kernel"] = kernel_reports(
                port, name, tokens[name], "os.environ.get('CUDA_VISIBLE_DEVICES'), os.getcwd(), "
                "os.getpid()")
            assert cwd == str(tmp_path / "hub" / "learners" / name / "labkit" / "notebooks"), (
                f"{name}'s kernel runs in {cwd}, not in their own working copy")
        assert sorted(seen.values()) == sorted(DEVICES), (
            f"each learner should see their own device of {DEVICES}: {seen}")

        for reader, owner in (("alice", "bob"), ("bob", "alice")):
            status, _ = call("GET", f"{base}/user/{owner}/api/contents/00_tour.ipynb", tokens[reader])
            assert status in (403, 404), f"{reader}'s token read {owner}'s notebook: HTTP {status}"

        stop_and_check(hub, pids, log)
    finally:
        clean_up(hub, pids)
