"""Exercise 03.1's check holds a solution to the broken version's gradient, not only its output:
``torch.where`` differentiates the branch it does not pick, so an inf there is NaN in the
gradient at norm 0 though every output is right."""
import torch

from labkit.teaching.check import check

ZEROS = "all zeros (norm 0; the gradient too)"


def where_with_inf_branch(x, max_norm):
    norm = x.norm()
    return torch.where(norm > max_norm, x * (max_norm / norm), x)


def where_with_safe_denominator(x, max_norm):
    norm = x.norm()
    big = norm > max_norm
    safe = torch.where(big, norm, torch.ones_like(norm))
    return torch.where(big, x * (max_norm / safe), x)


def by_label(result):
    return {c.label: c for c in result.cases}


def test_the_safe_denominator_passes_with_its_gradient():
    result = check("03.1", where_with_safe_denominator, device="cpu", seed=0)
    assert result.passed, result


def test_an_inf_in_the_branch_not_picked_fails_on_the_gradient_at_zero():
    result = check("03.1", where_with_inf_branch, device="cpu", seed=0)
    assert not result.passed
    cases = by_label(result)
    assert not cases[ZEROS].passed
    assert all(c.passed for label, c in cases.items() if label != ZEROS), result
    assert cases[ZEROS].message.startswith(f"On input '{ZEROS}': grad["), cases[ZEROS].message
    assert "is NaN" in result.message and "0 times the inf" in result.message, result.message
    assert "safe denominator" in result.message, result.message


def test_clamping_the_factor_has_the_same_nan_gradient():
    def clip_norm(x, max_norm):
        return x * torch.clamp(max_norm / x.norm(), max=1.0)

    result = check("03.1", clip_norm, device="cpu", seed=1)
    assert not by_label(result)[ZEROS].passed and "gradient is NaN" in result.message


def test_an_output_cut_off_from_autograd_is_named():
    def clip_norm(x, max_norm):
        return where_with_safe_denominator(x, max_norm).detach()

    result = check("03.1", clip_norm, device="cpu", seed=2)
    assert not result.passed and "carries no gradient back to x" in result.message, result
