"""Exercise specs: what the learner writes, the reference it is held to, and the inputs.

Each module here belongs to one notebook and lists its exercises in ``EXERCISES``; any module
dropped into this package is found (``all_exercises``), so a new notebook's exercises need no
registration anywhere else. An :class:`Exercise` says how to call the learner's function on one
:class:`Case` (``run``: function, case -> named outputs) and what the outputs should be
(``reference``, run the same way, or ``expected(case)`` computed from the case itself).
``labkit.teaching.check.check`` runs both on fresh random cases and compares them.

Triton exercises live as files under ``kernels/exercises/`` (learners open and edit them):
``kernel_file`` names the file and ``entry`` its host function, loaded fresh from disk at every
check, from the learner's copy next to their notebooks when there is one.
"""
from __future__ import annotations

import importlib
import importlib.util
import itertools
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch


@dataclass
class Case:
    """One input the learner's code is run on; ``label`` says what is awkward about it."""
    label: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Exercise:
    id: str                      # "02.1": notebook 02, first exercise
    title: str
    entry: str                   # the learner's function (a notebook cell's def, or in kernel_file)
    task: str                    # what to write, in one sentence (the stub says it too)
    cases: Callable[[int, torch.device], list[Case]]   # (seed, device) -> fresh inputs
    run: Callable[[Callable, Case], dict]     # (function, case) -> {output name: value}
    reference: Callable | None = None         # run(reference, case) gives the expected outputs
    expected: Callable[[Case], dict] | None = None  # or computed from the case directly
    atol: float = 1e-5
    rtol: float = 1e-5
    gpu_tolerance: tuple[float, float] | None = None  # (atol, rtol) on CUDA, e.g. for TF32 dots
    diagnose: Callable[[Case, dict, dict], str | None] | None = None  # teaching hint when wrong
    extra_check: Callable[[Callable, torch.device], str | None] | None = None  # once, after cases
    note: Callable[[torch.device], str] | None = None   # what the check proves on this device
    kernel_file: str | None = None           # kernels/exercises/<kernel_file>
    hints: tuple[str, ...] = ()
    seen: str = ""                            # "what you should have seen", after the exercise

    def __post_init__(self):
        if not re.fullmatch(r"\d\d\.\d+", self.id):
            raise ValueError(f"exercise ids are '<notebook>.<n>' like '02.1', got {self.id!r}")
        if (self.reference is None) == (self.expected is None):
            raise ValueError(f"exercise {self.id}: give exactly one of reference= or expected=")


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def all_exercises() -> dict[str, Exercise]:
    """Every exercise of every module in this package, by id."""
    found: dict[str, Exercise] = {}
    for name in _modules():
        module = importlib.import_module(f"{__name__}.{name}")
        for ex in getattr(module, "EXERCISES", ()):
            if ex.id in found:
                raise ValueError(f"exercise id {ex.id} is defined twice (in {name} and before)")
            found[ex.id] = ex
    return found


def get(exercise_id: str) -> Exercise:
    exercises = all_exercises()
    if exercise_id not in exercises:
        raise KeyError(f"no exercise {exercise_id!r}; the lab has {sorted(exercises)}")
    return exercises[exercise_id]


# --- exercise files under kernels/exercises/ -----------------------------------------------
_loads = itertools.count()


def package_kernels() -> Path:
    """labkit's own ``kernels/exercises/`` (wherever ``labkit.kernels`` is installed)."""
    import labkit.kernels

    return Path(list(labkit.kernels.__path__)[0]) / "exercises"


def exercise_path(kernel_file: str) -> Path:
    """The learner's copy: ``../kernels/exercises/`` from a notebook's folder (a student copy
    has its own), else ``kernels/exercises/`` under the working directory, else labkit's own."""
    folders = (Path.cwd().parent / "kernels" / "exercises", Path.cwd() / "kernels" / "exercises",
               package_kernels())
    for folder in folders:
        if (folder / kernel_file).is_file():
            return folder / kernel_file
    raise FileNotFoundError(f"kernels/exercises/{kernel_file} is in none of "
                            f"{[str(f) for f in folders]}")


def load_exercise_file(path: str | Path) -> Any:
    """Import a kernel exercise file afresh (edits since the last check count)."""
    path = Path(path)
    import labkit  # noqa: F401  (the interpreter must be on before the file imports triton)

    name = f"labkit_exercise_{path.stem}_{next(_loads)}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def guarded(t: torch.Tensor, guard: int = 4096) -> torch.Tensor:
    """``t`` copied into the middle of a NaN-filled buffer: a read past either end meets NaN
    (on a GPU) or the bounds check (in the interpreter), never another argument's data."""
    fill = float("nan") if t.is_floating_point() else -1
    buf = torch.full((guard + t.numel() + guard,), fill, dtype=t.dtype, device=t.device)
    out = buf[guard:guard + t.numel()].view(t.shape)
    out.copy_(t)
    return out
