"""Notebook 03's exercise: remove a graph break without changing the result.

``clip_norm_broken`` scales a tensor down when its norm is too large, with a Python ``if`` on a
tensor value: Dynamo must stop the graph to learn the bool. The learner writes ``clip_norm``,
the same function in one graph. The check compares it with the broken version (run eagerly,
the reference) on awkward inputs, its output and its gradient with respect to ``x``, then asks
``torch._dynamo.explain`` for zero breaks. The gradient is what catches the classic slip:
``torch.where`` differentiates both branches, so a branch that is inf where it is not picked
(``max_norm / norm`` at norm 0) gives ``0 * inf = NaN`` in the gradient though the output is
right.
"""
from __future__ import annotations

import random

import torch

from labkit.teaching.exercises import Case, Exercise


def clip_norm_broken(x: torch.Tensor, max_norm: float) -> torch.Tensor:  # x: [tokens, dim]
    norm = x.norm()
    if norm > max_norm:  # Python needs a bool from a tensor: the graph breaks here
        return x * (max_norm / norm)
    return x


def _cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)

    def rows(n, dim, scale=1.0):
        return (torch.randn(n, dim, generator=g) * scale).to(device)

    dim = rng.choice([8, 16, 24])
    cases = [
        Case("norm far above max_norm", (rows(6, dim, 3.0), 1.0)),
        Case("norm below max_norm (left as it is)", (rows(5, dim, 0.01), 1.0)),
        Case("one token", (rows(1, dim), 0.5)),
        Case("all zeros (norm 0; the gradient too)", (torch.zeros(3, dim, device=device), 1.0)),
        Case("no tokens at all (empty)", (rows(0, dim), 1.0)),
        Case(f"a larger max_norm ({(m := rng.choice([4.0, 8.0]))})", (rows(7, dim, 2.0), m)),
    ]
    for case in cases:  # the gradient flowing back into the output, one value per element
        case.kwargs["grad_out"] = rows(*case.args[0].shape)
    return cases


def _run(fn, case: Case) -> dict:
    """The output, and the gradient of (output * grad_out).sum() with respect to x."""
    x, max_norm = case.args
    x = x.detach().requires_grad_(True)
    out = fn(x, max_norm)
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        return {"output": out, "grad": None}
    (grad,) = torch.autograd.grad(out, x, case.kwargs["grad_out"], allow_unused=True)
    return {"output": out.detach(), "grad": grad}


def _diagnose(case: Case, got: dict, expected: dict) -> str | None:
    out, want = got.get("output"), expected["output"]
    if isinstance(out, torch.Tensor) and out.shape == want.shape and out.isnan().any():
        return ("NaN where the broken version gives numbers: with norm 0, max_norm / norm is inf "
                "and 0 * inf is NaN. torch.where picks per element, so compute a branch that is "
                "finite wherever it is picked (divide by a safe denominator).")
    grad = got.get("grad")
    if isinstance(out, torch.Tensor) and grad is None:
        return ("Your output carries no gradient back to x: compute it from x with torch ops "
                "(no .detach(), .item() or a new tensor built from numbers).")
    if isinstance(grad, torch.Tensor) and grad.isnan().any() and not expected["grad"].isnan().any():
        return ("The output is right, but its gradient is NaN. torch.where differentiates both "
                "branches: the branch it did not pick gets a gradient of 0, and 0 times the inf "
                "in max_norm / norm is NaN (clamping the factor afterwards does the same). Keep "
                "the unpicked branch finite: divide by a safe denominator inside it, e.g. "
                "torch.where(norm > max_norm, norm, torch.ones_like(norm)).")
    return None


def _no_breaks(fn, device) -> str | None:
    # imports Dynamo: only when a check gets this far
    from labkit.lessons.torch_compile import graph_breaks

    x = torch.randn(4, 16, device=device) * 3
    report = graph_breaks.explain(fn, x, 1.0)
    if report["breaks"]:
        return (f"Right numbers, but Dynamo still breaks the graph {report['breaks']} time(s): "
                f"{'; '.join(report['reasons'])}. Keep the decision inside the graph: "
                "torch.where(cond, a, b) instead of a Python if on a tensor.")
    if report["graphs"] != 1:
        return f"Dynamo made {report['graphs']} graphs of your function; one is the goal."
    return None


EXERCISES = [Exercise(
    id="03.1", title="remove the graph break in clip_norm", entry="clip_norm",
    task="compute clip_norm_broken's result in one graph: no Python if on a tensor value",
    cases=_cases, run=_run, reference=clip_norm_broken, diagnose=_diagnose,
    extra_check=_no_breaks, atol=1e-6, rtol=1e-6,
    note=lambda device: ("Checked eagerly on every input against clip_norm_broken, the output "
                         "and its gradient with respect to x, then traced once by "
                         "torch._dynamo.explain, which must find one graph and no break."),
    hints=(
        ("The break is `if norm > max_norm:`: Python needs a real bool, so Dynamo must run the "
         "graph so far and come back. Can the choice be made per element, inside the graph?"),
        ("`torch.where(norm > max_norm, a, b)` computes both `a` and `b` and picks, element by "
         "element; `norm > max_norm` stays a 0-d tensor."),
        ("Watch the all-zeros input: `max_norm / norm` is inf there. The branch torch.where "
         "does not pick is still computed and still differentiated, and 0 * inf = NaN in the "
         "gradient. Divide by a denominator that is safe wherever that branch is not picked: "
         "`torch.where(norm > max_norm, norm, torch.ones_like(norm))`."),
    ),
    seen="`big = norm > max_norm; safe = torch.where(big, norm, torch.ones_like(norm))`, then "
         "`torch.where(big, x * (max_norm / safe), x)`, gives the broken version's numbers and "
         "gradient on every input, and `explain` reports 1 graph and 0 breaks. Without the safe "
         "denominator the output is right but the gradient at norm 0 is NaN: torch.where "
         "differentiates both branches, and the unpicked one meets 0 * inf. It computes both "
         "branches: fine for two cheap elementwise ops; for an expensive branch a break (or "
         "`torch.cond`) can be the better trade.",
)]
