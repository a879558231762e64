"""JupyterHub for a workshop: one JupyterLab per learner, in their own working copy of the student
notebooks, on their own GPU or MIG slice. `make hub` runs this.

JupyterHub does the multi-user work (log-in, one server per learner, the configurable-http-proxy
in front); labkit adds a spawner and its defaults:

- the working copy is what ``make student`` writes (solutions replaced by stubs), made the first
  time a learner starts a server and kept after: it is their work;
- ``CUDA_VISIBLE_DEVICES`` is the learner's entry of ``LabkitSpawner.device_map``, else an entry
  of ``LabkitSpawner.devices`` in turn by JupyterHub's user id, so a learner keeps their device
  across restarts of their server and of the hub;
- the hub listens on 127.0.0.1 unless ``--ip`` says otherwise (then put it behind TLS).

Everything else is ordinary JupyterHub configuration, in the file ``--config`` names:

    c.JupyterHub.authenticator_class = "pam"              # the default: the host's accounts
    c.LabkitSpawner.devices = ["MIG-4f0c...", "MIG-9a1b..."]   # from `nvidia-smi -L`
    c.LabkitSpawner.device_map = {"ada": "GPU-0b3e..."}   # a whole GPU for one learner

    python -m labkit.tools.hub --config workshop_config.py [--ip 0.0.0.0] [--port 8000]
"""
from __future__ import annotations

import argparse
import asyncio
import grp
import json
import os
import pwd
import re
import shutil
import stat
import sys
from pathlib import Path

from jupyterhub.spawner import LocalProcessSpawner, SimpleLocalProcessSpawner
from traitlets import Dict, List, Unicode, validate
from traitlets.config import Config

from labkit.tools import REPO_ROOT
from labkit.tools.lab_server import SETTING_DEFAULTS

HUB_DIR = REPO_ROOT / "hub" / "state"
PROXY = REPO_ROOT / "hub" / "node_modules" / ".bin" / "configurable-http-proxy"
# A GPU index, a GPU UUID or a MIG slice UUID, as `nvidia-smi -L` prints them.
DEVICE = re.compile(r"^(\d+|GPU-[0-9a-fA-F-]+|MIG-[0-9a-fA-F-]+)$")


def assign_device(name: str, user_id: int, devices: list[str],
                  device_map: dict[str, str]) -> str | None:
    """The learner's CUDA_VISIBLE_DEVICES: their fixed entry, else ``devices`` in turn by user id
    (JupyterHub numbers users 1, 2, ... as they first appear); None where nothing is configured."""
    if name in device_map:
        return device_map[name]
    if not devices:
        return None
    return devices[(user_id - 1) % len(devices)]


def _check_device(setting: str, value: str) -> str:
    if not DEVICE.match(value):
        raise ValueError(f"{setting} = {value!r} is not a device: use a GPU index (0), a GPU UUID "
                         f"(GPU-...) or a MIG slice UUID (MIG-...), as `nvidia-smi -L` lists them")
    return value


def closed_folder(path: Path, account: pwd.struct_passwd) -> str | None:
    """The first folder on the way to ``path`` (links followed; ``path`` too if it is one) that
    ``account`` may not enter, with its mode and owner, or None when all let it through. As the
    mode bits say: an ACL can open more."""
    if account.pw_uid == 0:
        return None
    path = Path(path).resolve()
    groups = set(os.getgrouplist(account.pw_name, account.pw_gid))
    for folder in [*reversed(path.parents), *([path] if path.is_dir() else [])]:
        st = folder.stat()
        if st.st_uid == account.pw_uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid in groups:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            return f"{folder} ({stat.filemode(st.st_mode)} {_owner(st)})"
    return None


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


class LabkitSpawner(LocalProcessSpawner):
    """Each learner's JupyterLab runs as their own account on this host (the accounts PAM signs
    in), in ``~/labkit/notebooks``. The hub runs as root to switch to them. Their working copy is
    theirs alone (mode 700): another learner's kernel, running as another account, cannot read it.
    Their lab runs labkit's interpreter and imports labkit from this checkout, so both must be
    where every learner may read them (not under /root or a private home)."""

    devices = List(Unicode(), config=True, help="GPUs or MIG slices handed out in turn, e.g. "
                   "['0', '1'] or ['MIG-...', ...]; empty: every learner sees every GPU")
    device_map = Dict(value_trait=Unicode(), config=True,
                      help="learner name -> device, for learners who get a fixed one")
    copy_dir = Unicode("{home}/labkit", config=True,
                       help="the learner's working copy; {home} is their home folder")
    config_path = Unicode(str(HUB_DIR / "lab-config"), config=True,
                          help="folder holding the JupyterLab setting defaults labkit writes")

    @validate("devices")
    def _valid_devices(self, proposal):
        return [_check_device(f"LabkitSpawner.devices[{i}]", d)
                for i, d in enumerate(proposal.value)]

    @validate("device_map")
    def _valid_device_map(self, proposal):
        return {n: _check_device(f"LabkitSpawner.device_map[{n!r}]", d)
                for n, d in proposal.value.items()}

    def device(self) -> str | None:
        return assign_device(self.user.name, self.user.id, self.devices, self.device_map)

    def working_copy(self) -> Path:
        if "/" in self.user.name or self.user.name.startswith("."):
            raise ValueError(f"user name {self.user.name!r} cannot name a folder: set "
                             f"Authenticator.username_pattern to refuse such names")
        return Path(self.copy_dir.format(home=self.user_env({})["HOME"]))

    def get_env(self):
        env = super().get_env()
        if (device := self.device()) is not None:
            env["CUDA_VISIBLE_DEVICES"] = device
        env["JUPYTER_CONFIG_PATH"] = self.config_path  # no news pop-ups, as in `make lab`
        return env

    async def start(self):
        copy = self.working_copy()
        if not any((copy / "notebooks").glob("*.ipynb")):
            await self.write_copy(copy)
        self.notebook_dir = str(copy / "notebooks")
        device = self.device() or "unset: every GPU, shared (LabkitSpawner.devices is empty)"
        self.log.info("%s: working copy %s, CUDA_VISIBLE_DEVICES %s", self.user.name, copy, device)
        return await super().start()

    async def write_copy(self, copy: Path) -> None:
        """``make student`` into ``copy``, run as the learner, so the files are theirs and no
        other account's (umask 077: folders 700, files 600)."""
        as_learner = self.make_preexec_fn(self.user.name)

        def preexec():
            as_learner()
            os.umask(0o077)

        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "labkit.tools.student", "--out", str(copy),
                preexec_fn=preexec, env=self.get_env(),
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(proc.communicate(), timeout=120)
            failed = err.decode()[-2000:] if proc.returncode else None
        except PermissionError as e:  # the interpreter itself is out of the learner's reach
            failed = str(e)
        if failed is not None:
            raise RuntimeError(f"writing {self.user.name}'s working copy into {copy} failed:\n"
                               f"{failed}{self.reach_advice()}")

    def reach_advice(self) -> str:
        """Why the learner's account cannot run labkit, where the mode bits say so."""
        try:
            account = pwd.getpwnam(self.user.name)
        except KeyError:
            return ""
        for what, path in (("labkit's interpreter", Path(sys.executable)),
                           ("this checkout", REPO_ROOT)):
            if (closed := closed_folder(path, account)) is not None:
                return (f"\n{self.user.name}'s account cannot reach {what} ({path}): {closed} is "
                        f"closed to it. Learners' labs run as their own accounts: put the checkout "
                        f"and the Python its venv was made from where every learner can read them "
                        f"(e.g. /opt/labkit, with make venv PYTHON=/usr/bin/python3)")
        return ""


class OneAccountSpawner(LabkitSpawner, SimpleLocalProcessSpawner):
    """Every learner's JupyterLab as the hub's own account, each in
    ``home_dir_template``/labkit: no OS accounts needed, and no isolation between learners'
    kernels (any kernel can read any file the account can). For tests and trusted groups only."""

    def get_args(self):
        args = super().get_args()
        if os.geteuid() == 0:  # containers run as root; Jupyter refuses to without this
            args = [*args, "--ServerApp.allow_root=True"]
        return args


def proxy_command() -> list[str]:
    """configurable-http-proxy: the one `make hub` installed into hub/node_modules, else PATH's."""
    found = str(PROXY) if PROXY.exists() else shutil.which("configurable-http-proxy")
    if found is None:
        raise FileNotFoundError(f"configurable-http-proxy is not installed: `make hub` installs it "
                                f"into {PROXY.parent.parent} (npm ci in hub/)")
    return [found]


def defaults(hub_dir: Path, ip: str, port: int) -> Config:
    """labkit's JupyterHub settings; the ``--config`` file and the command line override them."""
    hub_dir = hub_dir.resolve()
    private = hub_dir / "private"  # the cookie secret and the database: the hub's eyes only
    private.mkdir(mode=0o700, parents=True, exist_ok=True)
    lab_config = hub_dir / "lab-config" / "labconfig"  # read by every learner's server
    lab_config.mkdir(mode=0o755, parents=True, exist_ok=True)
    (lab_config / "default_setting_overrides.json").write_text(json.dumps(SETTING_DEFAULTS))
    c = Config()
    c.JupyterHub.ip, c.JupyterHub.port = ip, port
    c.JupyterHub.authenticator_class = "pam"
    c.JupyterHub.spawner_class = "labkit.tools.hub.LabkitSpawner"
    c.JupyterHub.db_url = f"sqlite:///{private / 'jupyterhub.sqlite'}"
    c.JupyterHub.cookie_secret_file = str(private / "jupyterhub_cookie_secret")
    c.ConfigurableHTTPProxy.command = proxy_command()
    c.ConfigurableHTTPProxy.pid_file = str(private / "jupyterhub-proxy.pid")
    c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
    c.Spawner.default_url = "/lab"
    c.Spawner.args = ["--LabApp.news_url=None"]  # no news feed fetched, as in `make lab`
    c.LabkitSpawner.config_path = str(lab_config.parent)
    c.OneAccountSpawner.home_dir_template = str(hub_dir / "learners" / "{username}")
    return c


def main(argv: list[str] | None = None) -> int:
    from jupyterhub.app import JupyterHub

    parser = argparse.ArgumentParser(description="JupyterHub for labkit's learners (`make hub`).")
    parser.add_argument("--config", type=Path, help="a JupyterHub config file: authenticator, "
                        "LabkitSpawner.devices / device_map, ... (see the README)")
    parser.add_argument("--ip", default="127.0.0.1", help="address to listen on (default: "
                        "%(default)s; bind wider only behind TLS)")
    parser.add_argument("--port", type=int, default=8000, help="public port (default: %(default)s)")
    parser.add_argument("--hub-dir", type=Path, default=HUB_DIR,
                        help="the hub's database and cookie secret, the lab's setting defaults and "
                        "OneAccountSpawner's working copies (default: %(default)s)")
    args, rest = parser.parse_known_args(argv)  # the rest goes to JupyterHub (--debug, --X.y=z)
    if args.config is not None and not args.config.is_file():
        parser.error(f"--config {args.config}: no such file")
    try:
        config = defaults(args.hub_dir, args.ip, args.port)
    except FileNotFoundError as e:
        parser.error(str(e))
    JupyterHub.instance(config=config)  # launch_instance below uses this instance
    hub_args = [f"--config={args.config.resolve()}"] if args.config else []
    # The command line wins over the config file: the address is always the one asked for here.
    JupyterHub.launch_instance(hub_args + [f"--JupyterHub.ip={args.ip}",
                                           f"--JupyterHub.port={args.port}", *rest])
    return 0


if __name__ == "__main__":
    sys.exit(main())
