"""Run a learner's code against labkit's reference on fresh random inputs, and say what is wrong.

    result = check("02.1", run_bucketed)      # a function written in a notebook cell
    result = check("06.1")                    # a Triton exercise: kernels/exercises/, read afresh
    result.passed

Every call draws new inputs (the seed is printed, so a failure can be replayed with
``seed=``), several shapes per exercise, the awkward ones included: not a multiple of the block,
one token, empty. The answer is meant to be read by a learner: which output is wrong, at which
index, by how much, and on which kind of input; for a Triton kernel under the interpreter, an
out-of-bounds access with the program id and offsets that made it. A function that still raises
the stub's ``NotImplementedError`` is reported as not written yet.
"""
from __future__ import annotations

import copy
import html
import math
import secrets
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import labkit
from labkit.teaching import exercises
from labkit.device import select_device
from labkit.teaching.exercises.bounds import bounds_checked, find_out_of_bounds

# Frames from these folders are not the learner's: an error is shown at the learner's line.
_LIBRARY_DIRS = (str(Path(torch.__file__).resolve().parent),
                 str(Path(labkit.__file__).resolve().parent))  # labkit itself


@dataclass
class CaseResult:
    label: str
    passed: bool
    message: str = ""


@dataclass
class CheckResult:
    exercise: str
    title: str
    passed: bool
    cases: list[CaseResult] = field(default_factory=list)
    message: str = ""
    seed: int = 0
    note: str = ""

    def summary(self) -> str:
        n_ok = sum(c.passed for c in self.cases)
        if self.passed:
            verdict = f"passed on all {len(self.cases)} inputs"
        elif self.cases and n_ok == len(self.cases):
            verdict = f"not yet: right on all {n_ok} inputs, but see below"
        else:
            verdict = f"not yet: {n_ok} of {len(self.cases)} inputs right"
        return f"Exercise {self.exercise} ({self.title}): {verdict}"

    def __repr__(self) -> str:
        lines = [("PASSED  " if self.passed else "FAILED  ") + self.summary()]
        if self.message:
            lines.append(self.message)
        lines += [f"  {'ok ' if c.passed else 'XX '} {c.label}" for c in self.cases]
        if self.note:
            lines.append(self.note)
        lines.append(f"(seed {self.seed}: check({self.exercise!r}, ..., seed={self.seed}) "
                     "reruns these inputs)")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        colour, mark = ("#2e7d32", "&#10003;") if self.passed else ("#c62828", "&#10007;")
        items = "".join(f"<li>{'&#10003;' if c.passed else '&#10007;'} {html.escape(c.label)}</li>"
                        for c in self.cases)
        parts = [f'<div style="border-left:4px solid {colour};padding:.4em .8em;margin:.3em 0">',
                 f'<b style="color:{colour}">{mark} {html.escape(self.summary())}</b>']
        if self.message:
            parts.append(f'<pre style="white-space:pre-wrap">{html.escape(self.message)}</pre>')
        parts.append(f'<ul style="margin:.2em 0;list-style:none;padding-left:.5em">{items}</ul>')
        if self.note:
            parts.append(f"<p><i>{html.escape(self.note)}</i></p>")
        parts.append(f"<small>seed {self.seed}: <code>check({self.exercise!r}, ..., "
                     f"seed={self.seed})</code> reruns these inputs</small></div>")
        return "".join(parts)


# --- comparing outputs ------------------------------------------------------------------------
def _index(name: str, idx) -> str:
    return f"{name}[{', '.join(str(int(i)) for i in idx)}]"


def compare_tensor(name: str, got, expected: torch.Tensor, atol: float, rtol: float) -> str | None:
    if not isinstance(got, torch.Tensor):
        return (f"{name} should be a tensor of shape {tuple(expected.shape)}, but it is "
                f"{type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        return (f"{name} has shape {tuple(got.shape)} but should have {tuple(expected.shape)}")
    if got.numel() == 0:
        return None
    g = got.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    exact = not (expected.is_floating_point() or expected.is_complex())
    diff = (g - e).abs()
    tol = torch.zeros_like(e) if exact else atol + rtol * e.abs()
    bad = ~(diff <= tol) & ~(g.isnan() & e.isnan())
    if not bad.any():
        return None
    first = tuple(bad.nonzero()[0].tolist())
    score = torch.where(bad, diff.nan_to_num(math.inf), torch.zeros_like(diff))
    worst = tuple(int(i) for i in torch.unravel_index(score.flatten().argmax(), e.shape))
    gv, ev = g[first].item(), e[first].item()
    what = "NaN" if math.isnan(gv) else f"{gv:.6g}"
    msg = f"{_index(name, first)} is {what}, expected {ev:.6g}"
    if not math.isnan(gv):
        allowed = "" if exact else f"; tolerance {tol[first].item():.1g}"
        msg += f" (off by {abs(gv - ev):.3g}{allowed})"
    msg += f". {int(bad.sum())} of {bad.numel()} elements are wrong"
    if worst != first:
        msg += (f"; the worst is {_index(name, worst)} "
                f"({g[worst].item():.6g} vs {e[worst].item():.6g})")
    return msg + "."


def compare(name: str, got, expected, atol: float, rtol: float) -> str | None:
    """None when ``got`` matches ``expected``, else one sentence saying where it does not."""
    if isinstance(expected, torch.Tensor):
        return compare_tensor(name, got, expected, atol, rtol)
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return f"{name} should be a list of {len(expected)}, but it is {type(got).__name__}"
        if len(got) != len(expected):
            return f"{name} has {len(got)} entries but should have {len(expected)}"
        for i, (g, e) in enumerate(zip(got, expected)):
            problem = compare(f"{name}[{i}]", g, e, atol, rtol)
            if problem:
                return problem
        return None
    if isinstance(expected, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        return None if abs(got - expected) <= atol + rtol * abs(expected) else \
            f"{name} is {got:.6g}, expected {expected:.6g}"
    if type(got) is not type(expected) and not (isinstance(got, int) and isinstance(expected, int)
                                                 and not isinstance(got, bool)):
        return f"{name} should be {type(expected).__name__} {expected!r}, but it is {got!r}"
    return None if got == expected else f"{name} is {got!r}, expected {expected!r}"


# --- running the learner's code ---------------------------------------------------------------
def _learner_line(error: BaseException) -> str:
    """``line 7 of <cell>: x = ...``: the last frame outside torch, triton and labkit."""
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if not f.filename.startswith(_LIBRARY_DIRS) and "site-packages" not in f.filename
              and "/lib/python" not in f.filename]
    if not frames:
        return ""
    f = frames[-1]
    return f" (line {f.lineno} of {Path(f.filename).name}: {(f.line or '').strip()})"


def _chain(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__  # the interpreter wraps the kernel's own error


def _stub_message(error: BaseException) -> str | None:
    """The stub's NotImplementedError message, if that is what was raised (wrapped or not)."""
    for e in _chain(error):
        if isinstance(e, NotImplementedError):
            return str(e) or "this exercise still raises NotImplementedError"
    return None


def _explain_error(error: BaseException) -> str:
    oob = find_out_of_bounds(error)
    if oob:
        return oob
    cause = list(_chain(error))[-1]
    return f"your code raised {type(cause).__name__}: {cause}{_learner_line(cause)}"


def _fresh(case: exercises.Case) -> exercises.Case:
    return copy.deepcopy(case)  # the learner may write into its inputs: the reference must not see it


def check(exercise_id: str, fn: Callable | None = None, *, seed: int | None = None,
          device="auto", source: str | Path | None = None) -> CheckResult:
    """Run ``fn`` (or the ``entry`` of a kernel exercise file) on fresh cases against the
    reference; returns a :class:`CheckResult` (``.passed``, shown as a box in Jupyter)."""
    ex = exercises.get(exercise_id)
    dev = select_device(device)
    seed = secrets.randbelow(2**31) if seed is None else int(seed)
    note = ex.note(dev) if ex.note else ""
    if fn is None:
        if ex.kernel_file is None:
            raise TypeError(f"check({exercise_id!r}) needs your function: check({exercise_id!r}, "
                            f"{ex.entry})")
        path = Path(source) if source is not None else exercises.exercise_path(ex.kernel_file)
        fn = getattr(exercises.load_exercise_file(path), ex.entry)
    on_gpu = dev.type == "cuda" and ex.gpu_tolerance is not None
    atol, rtol = ex.gpu_tolerance if on_gpu else (ex.atol, ex.rtol)
    cases = ex.cases(seed, dev)
    results: list[CaseResult] = []
    first_problem = ""
    for case in cases:
        expected = ex.expected(case) if ex.expected else ex.run(ex.reference, _fresh(case))
        try:
            with bounds_checked(), np.errstate(all="ignore"):  # NaNs are reported, not warned
                got = ex.run(fn, _fresh(case))
        except Exception as error:  # noqa: BLE001 (the learner's code may raise anything)
            stub = _stub_message(error)
            if stub is not None:
                return CheckResult(ex.id, ex.title, False,
                                   [CaseResult(c.label, False) for c in cases],
                                   f"Not written yet: {stub}", seed, note)
            problems, got = [_explain_error(error)], None
        else:
            problems = [p for name, e in expected.items()
                        if (p := compare(name, got.get(name), e, atol, rtol))]
        if problems:
            hint = ex.diagnose(case, got, expected) if ex.diagnose and got is not None else None
            message = f"On input '{case.label}': {problems[0]}"
            if len(problems) > 1:
                message += f" ({len(problems) - 1} more output(s) wrong as well.)"
            message += f"\n{hint}" if hint else ""
            first_problem = first_problem or message
            results.append(CaseResult(case.label, False, message))
        else:
            results.append(CaseResult(case.label, True))
    passed = all(r.passed for r in results)
    if passed and ex.extra_check is not None:
        try:
            problem = ex.extra_check(fn, dev)
        except Exception as error:  # noqa: BLE001
            problem = _explain_error(error)
        if problem:
            passed, first_problem = False, problem
    return CheckResult(ex.id, ex.title, passed and bool(results), results, first_problem, seed,
                       note)


def main(argv: list[str] | None = None) -> int:
    """``python -m labkit.teaching.check 06.1 [--source FILE]``: a Triton exercise checked from a
    shell; exits 1 when it does not pass yet."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("exercise", help="the exercise id, e.g. 06.1")
    parser.add_argument("--source", type=Path, help="the kernel file (default: kernels/exercises/)")
    parser.add_argument("--seed", type=int)
    args = parser.parse_args(argv)
    result = check(args.exercise, seed=args.seed, source=args.source)
    print(result)
    return 0 if result.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
