"""Figures measured on a real GPU, kept as data and shown, labelled, where no GPU is present.

One JSON file per notebook stem in ``labkit/recorded_data/`` (``tour.json``,
``cuda_graphs.json``, ...). A file holds one or more parts, each recorded by its own function
(``cuda_graphs`` has ``pool`` and ``pitfalls``), and each part keeps its own provenance: the
numbers, the fingerprint of the machine that measured them, the date, the command and the
commit. Only ``make record`` on a CUDA host writes them (:func:`save` refuses elsewhere), so
nothing shown as a GPU result is ever typed in by hand.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from labkit.device import describe, fingerprint


class NeedsMoreGPUs(RuntimeError):
    """Raised by a recorder this host cannot run (too few GPUs): `make record` skips it."""


DATA_DIR = Path(__file__).resolve().parent.parent / "recorded_data"
REQUIRED_FINGERPRINT = ("gpu", "driver", "cuda", "torch", "triton", "python")


@dataclass(frozen=True)
class Recorded:
    name: str
    data: dict
    fingerprint: dict
    date: str
    command: str
    commit: str | None = None
    part: str | None = None

    @property
    def label(self) -> str:
        """Exactly where the numbers came from; shown beside every recorded figure."""
        valid = self.commit and re.fullmatch(r"[0-9a-f]{7,40}", self.commit)
        commit = f", labkit {self.commit[:10]}" if valid else ""
        return (f"Recorded on {describe(self.fingerprint)}, {self.date[:10]}, "
                f"by `{self.command}`{commit}; not measured on this machine")


class RecordingMissing(LookupError):
    pass


def json_columns(df: pd.DataFrame) -> dict:
    """A table as JSON-ready columns for a recording: missing values (NaN) become None."""
    return df.astype(object).where(df.notna(), None).to_dict(orient="list")


def available() -> list[str]:
    """The notebook stems that have recorded figures."""
    return sorted(p.stem for p in DATA_DIR.glob("*.json"))


def _read(stem: str) -> dict:
    path = DATA_DIR / f"{stem}.json"
    if not path.exists():
        raise RecordingMissing(
            f"no recorded GPU figures for {stem!r} (have: {available()}); run `make record` "
            "on a CUDA host to create them")
    raw = json.loads(path.read_text())
    if not isinstance(raw.get("parts"), dict) or not raw["parts"]:
        raise ValueError(f"recording {stem!r} holds no parts (regenerate it with `make record`)")
    return raw


def parts(stem: str) -> list[str]:
    """The parts recorded for ``stem`` (``parts("cuda_graphs") == ["pitfalls", "pool"]``)."""
    return sorted(_read(stem)["parts"])


def validate(raw: dict, name: str = "?") -> None:
    """A recording must say where it came from: a real GPU, its driver and the versions."""
    for key in ("data", "fingerprint", "date", "command"):
        if key not in raw:
            raise ValueError(f"recording {name!r} lacks {key!r}")
    fp = raw["fingerprint"]
    missing = [k for k in REQUIRED_FINGERPRINT if not fp.get(k)]
    if missing:
        raise ValueError(f"recording {name!r} has no {missing} in its fingerprint: it cannot "
                         "have come from a GPU run (regenerate it with `make record`)")
    if fp.get("interpreter"):
        raise ValueError(f"recording {name!r} was made with Triton's interpreter, not on a GPU")
    _dt.datetime.fromisoformat(raw["date"])


def load(stem: str, part: str | None = None) -> Recorded:
    """One part of a notebook's recording; ``part`` may be left out where the stem has one."""
    recorded_parts = _read(stem)["parts"]
    if part is None:
        if len(recorded_parts) != 1:
            raise ValueError(f"recording {stem!r} has parts {sorted(recorded_parts)}: name one, "
                             f"e.g. load({stem!r}, {sorted(recorded_parts)[0]!r})")
        (part,) = recorded_parts
    if part not in recorded_parts:
        raise RecordingMissing(f"recording {stem!r} has no part {part!r} (have: "
                               f"{sorted(recorded_parts)}); run `make record` on a CUDA host")
    raw = recorded_parts[part]
    validate(raw, f"{stem}/{part}")
    return Recorded(name=stem, data=raw["data"], fingerprint=raw["fingerprint"], date=raw["date"],
                    command=raw["command"], commit=raw.get("commit"), part=part)


def _git_commit() -> str | None:
    """HEAD of the checkout; a copy without .git (a GPU host) can pass it as LABKIT_COMMIT."""
    if os.environ.get("LABKIT_COMMIT"):
        return os.environ["LABKIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", commit) else None


def save(stem: str, part: str, data: dict, command: str = "make record") -> Path:
    """Write one part of a stem's recording, keeping its other parts. Refuses without a CUDA
    device: recorded figures come from a GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("recorded figures can only be written on a CUDA host (`make record`)")
    raw = {
        "data": data,
        "fingerprint": fingerprint(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "commit": _git_commit(),
    }
    validate(raw, f"{stem}/{part}")
    path = DATA_DIR / f"{stem}.json"
    kept = json.loads(path.read_text())["parts"] if path.exists() else {}
    DATA_DIR.mkdir(exist_ok=True)
    path.write_text(json.dumps({"parts": {**kept, part: raw}}, indent=1, sort_keys=True) + "\n")
    return path
