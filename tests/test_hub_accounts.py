"""The workshop hub as shipped for many learners: the hub as root, each learner's JupyterLab as
their own OS account (LabkitSpawner), on loopback. Two throwaway accounts stand in for PAM's:
each server and kernel runs as its learner's uid, each working copy is its learner's alone (mode
bits, and a read attempt as the other account), one learner's token cannot read the other's files,
and everything stops with the hub. The accounts and their homes are removed at the end.

It needs root (to create the accounts and for the hub to switch to them) and skips without it.
"""
from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("jupyterhub", reason="needs the hub extra: pip install -e .[hub]")
from test_hub import (COMMON_CONFIG, DEADLINE_S, call, clean_up, kernel_reports, ready_server,
                      spawn_servers, start_hub, stop_and_check, wait_for)

from labkit.tools.hub import PROXY, closed_folder
from labkit.tools.lab_server import free_port

CONFIG = COMMON_CONFIG  # the shipped spawner, LabkitSpawner; hub names are the accounts' names


def demoted(account: pwd.struct_passwd):
    def preexec():
        os.setgid(account.pw_gid)
        os.setgroups(os.getgrouplist(account.pw_name, account.pw_gid))
        os.setuid(account.pw_uid)
    return preexec


def run_as(account: pwd.struct_passwd, *cmd: str) -> subprocess.CompletedProcess:
    """``cmd`` as ``account``; a command it may not execute exits 126, as a shell's would."""
    try:
        return subprocess.run(cmd, preexec_fn=demoted(account), cwd="/", capture_output=True,
                              text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    except PermissionError as e:
        return subprocess.CompletedProcess(cmd, 126, "", str(e))


@contextlib.contextmanager
def throwaway_accounts(homes: Path, n: int):
    """``n`` new OS accounts with homes under ``homes``, removed at the end with their homes
    and any process still running as them (all started here: the accounts are new)."""
    names = [f"lk{secrets.token_hex(4)}" for _ in range(n)]
    made = []
    try:
        for name in names:
            subprocess.run(["useradd", "--create-home", "--home-dir", str(homes / name),
                            "--user-group", "--shell", "/bin/sh", name],
                           check=True, capture_output=True, text=True, timeout=30)
            made.append(name)
        yield [pwd.getpwnam(name) for name in names]
    finally:
        for name in made:
            uid = pwd.getpwnam(name).pw_uid
            for pid in (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}").stat().st_uid == uid:
                        os.kill(pid, signal.SIGKILL)
            subprocess.run(["userdel", "--remove", name], capture_output=True, timeout=30)


def python_for(account: pwd.struct_passwd, folder: Path) -> str:
    """An interpreter with this venv's packages that ``account`` can run: this one, else the
    system's Python of the same version given this venv's site-packages (as a venv made from it
    would be), else skip saying which folder keeps the learners out."""
    probe = ("-c", "import labkit.tools.student, jupyterhub.singleuser")
    if run_as(account, sys.executable, *probe).returncode == 0:
        return sys.executable
    closed = closed_folder(Path(sys.executable), account)
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    site = Path(sysconfig.get_paths()["purelib"])
    if system.exists() and closed_folder(site, account) is None:
        (folder / "bin").mkdir(parents=True)
        (folder / "bin" / "python").symlink_to(system)
        (folder / "pyvenv.cfg").write_text(f"home = {system.parent}\n"
                                           "include-system-site-packages = false\n")
        own_site = folder / "lib" / system.name / "site-packages"
        own_site.mkdir(parents=True)
        (own_site / "labkit_venv.pth").write_text(f"import site; site.addsitedir({str(site)!r})\n")
        for shared in ("etc", "share"):  # Jupyter's config and data: the lab extension, kernels
            if (Path(sys.prefix) / shared).is_dir():
                (folder / shared).symlink_to(Path(sys.prefix) / shared)
        python = str(folder / "bin" / "python")
        if run_as(account, python, *probe).returncode == 0:
            return python
    pytest.skip(f"a learner's account cannot run this interpreter ({sys.executable}: "
                f"{closed or 'it fails as that account'}), and no system Python "
                f"{system} with this venv's packages can stand in")


def uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            real, effective = line.split()[1:3]
            assert real == effective, f"process {pid}: real uid {real}, effective {effective}"
            return int(real)
    raise AssertionError(f"no Uid line for process {pid}")


def test_a_folder_a_learner_cannot_enter_is_named_with_its_mode_and_owner():
    # an account that is not this one, in no group of this one's (it need not exist)
    stranger = pwd.struct_passwd(("stranger", "x", os.getuid() + 54321, os.getgid() + 54321,
                                  "", "/nonexistent", "/bin/sh"))
    base = Path(tempfile.mkdtemp(prefix="labkit-closed-"))  # made 700: closed to other accounts
    try:
        (base / "bin").mkdir()
        (base / "bin" / "python").touch()
        assert closed_folder(base / "bin" / "python", stranger).startswith(f"{base} (drwx------ ")
        assert closed_folder(base / "bin" / "python", pwd.getpwuid(0)) is None  # root enters
        base.chmod(0o711)
        assert closed_folder(base / "bin" / "python", stranger) is None
    finally:
        shutil.rmtree(base)


@pytest.mark.timeout(300)
def test_each_learner_runs_as_their_own_account_and_cannot_read_the_others_copy(tmp_path):
    if os.geteuid() != 0:
        pytest.skip(f"needs root (this run is uid {os.geteuid()}): it creates two throwaway OS "
                    "accounts with useradd, and the hub switches to them as a workshop's does")
    if not (shutil.which("useradd") and shutil.which("userdel")):
        pytest.skip("needs useradd and userdel (Debian's passwd package) to create the accounts")
    if not PROXY.exists():
        pytest.fail(f"configurable-http-proxy is not installed at {PROXY}: `make hub` and "
                    f"`make test` install it from npm (npm ci in hub/)")
    # Outside pytest's own temporary folder, which only root may enter.
    base = Path(tempfile.mkdtemp(prefix="labkit-accounts-"))
    try:
        base.chmod(0o711)  # enter only: no account lists what is here
        (base / "homes").mkdir(mode=0o711)
        with throwaway_accounts(base / "homes", 2) as accounts:
            hub_and_learners(base, accounts, tmp_path)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def hub_and_learners(base: Path, accounts: list[pwd.struct_passwd], tmp_path: Path) -> None:
    python = python_for(accounts[0], base / "env")
    names = [a.pw_name for a in accounts]
    port, token = free_port(), secrets.token_hex(16)
    config = tmp_path / "workshop_config.py"
    config.write_text(CONFIG.format(learners=set(names), hub_port=free_port(),
                                    api_port=free_port(), token=token, deadline=DEADLINE_S))
    log = tmp_path / "hub.log"
    # the shipped spawner: LabkitSpawner, one account each
    hub = start_hub(python, port, config, base / "hub", tmp_path, log)
    url = f"http://127.0.0.1:{port}"
    pids: dict[str, int] = {}
    try:
        pids["proxy"], tokens = spawn_servers(hub, url, token, names, base / "hub", log)

        for account in accounts:
            name = account.pw_name
            server = wait_for(f"{name}'s server was not ready",
                              lambda: ready_server(f"{url}/hub/api/users/{name}", token), log)
            pids[f"{name}'s server"] = server["state"]["pid"]
            assert uid_of(server["state"]["pid"]) == account.pw_uid, (
                f"{name}'s server does not run as {name}")
            uid, home, cwd, pids[f"{name}'s kernel"] = kernel_reports(
                port, name, tokens[name],
                "os.getuid(), os.environ['HOME'], os.getcwd(), os.getpid()")
            assert (uid, home) == (account.pw_uid, account.pw_dir), (
                f"{name}'s kernel runs as uid {uid} with HOME {home}")
            assert cwd == f"{account.pw_dir}/labkit/notebooks", f"{name}'s kernel runs in {cwd}"

        for owner, other in ((accounts[0], accounts[1]), (accounts[1], accounts[0])):
            copy = Path(owner.pw_dir) / "labkit"
            st = copy.stat()
            assert st.st_uid == owner.pw_uid, f"{copy} belongs to uid {st.st_uid}"
            assert st.st_mode & 0o077 == 0, (
                f"{copy} is {stat.filemode(st.st_mode)}: other accounts can read the work in it")
            tour = copy / "notebooks" / "00_tour.ipynb"
            read = run_as(other, "/bin/cat", str(tour))
            assert read.returncode != 0 and "Permission denied" in read.stderr, (
                f"{other.pw_name}'s account read {tour}: {read}")
            status, _ = call("GET", f"{url}/user/{owner.pw_name}/api/contents/00_tour.ipynb",
                             tokens[other.pw_name])
            assert status in (403, 404), (
                f"{other.pw_name}'s token read {owner.pw_name}'s notebook: HTTP {status}")

        stop_and_check(hub, pids, log)
    finally:
        clean_up(hub, pids)
