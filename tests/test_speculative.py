"""Speculative decoding's pieces: the config, the proposers, greedy and rejection acceptance."""
import itertools
import random

import pytest
import torch

from labkit.engine.speculative import (
    ControlledProposer, NgramProposer, SpecDecodeStats, SpeculativeConfig, accept_greedy,
    expected_tokens_per_step, rejection_sample, rejection_sample_point_drafts,
)


# ---------------------------------------------------------------- config
def test_the_default_config_is_ngram_with_four_draft_tokens():
    cfg = SpeculativeConfig()
    assert (cfg.method, cfg.num_speculative_tokens, cfg.min_n, cfg.max_n) == ("ngram", 4, 1, 3)
    with pytest.raises(AttributeError):
        cfg.method = "draft"


@pytest.mark.parametrize("bad, name", [
    (dict(method="eagle"), "method"), (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2.0), "num_speculative_tokens"), (dict(min_n=0), "min_n"),
    (dict(max_n=True), "max_n"), (dict(min_n=4, max_n=2), r"min_n \(4\) must be <= max_n"),
    (dict(acceptance=1.5), "acceptance"), (dict(acceptance="high"), "acceptance"),
    (dict(seed=None), "seed")])
def test_a_bad_config_is_refused_naming_the_parameter(bad, name):
    with pytest.raises(ValueError, match=name):
        SpeculativeConfig(**bad)


def test_proposers_refuse_bad_arguments_by_their_own_names():
    with pytest.raises(ValueError, match="k must be a positive int"):
        NgramProposer(1, 3, 0)
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(3, 1, 4)
    with pytest.raises(ValueError, match="acceptance"):
        ControlledProposer(-0.1, 4)
    with pytest.raises(ValueError, match="vocab_size must be >= 2"):
        ControlledProposer(0.5, 4).propose([0, 0], 0, vocab_size=1)


# ---------------------------------------------------------------- n-gram proposer
def test_ngram_proposes_what_followed_the_earlier_occurrence_of_the_suffix():
    assert NgramProposer(1, 2, 2).propose([1, 2, 3, 4, 1, 2]) == [3, 4]
    assert NgramProposer(1, 2, 9).propose([1, 2, 3, 4, 1, 2]) == [3, 4, 1, 2], "up to the end"


def test_ngram_prefers_the_longest_match_then_the_most_recent_occurrence():
    tokens = [5, 1, 2, 9, 7, 2, 8, 1, 2]
    assert NgramProposer(1, 2, 3).propose(tokens) == [9, 7, 2], "bigram [1, 2] beats [2]"
    assert NgramProposer(1, 1, 3).propose(tokens) == [8, 1, 2], "the latest earlier [2]"
    assert NgramProposer(1, 1, 2).propose([1, 5, 1, 6, 1]) == [6, 1]


@pytest.mark.parametrize("tokens, min_n", [([], 1), ([7], 1), ([1, 2, 3, 4], 1),
                                           ([1, 2, 3, 1, 2], 3)])
def test_ngram_proposes_nothing_without_an_earlier_match(tokens, min_n):
    assert NgramProposer(min_n, 3, 4).propose(tokens) == []


def test_ngram_matches_a_brute_force_search_on_random_sequences():
    rng = random.Random(0)
    for _ in range(400):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(12))]
        min_n, max_n, k = rng.randint(1, 3), rng.randint(3, 4), rng.randint(1, 4)
        expected = []
        for n in range(min_n, max_n + 1):  # the longest n with an earlier occurrence wins
            found = [i for i in range(len(tokens) - n) if tokens[i:i + n] == tokens[-n:]]
            if n < len(tokens) and found:
                expected = tokens[found[-1] + n:found[-1] + n + k]
        assert NgramProposer(min_n, max_n, k).propose(tokens) == expected, tokens


# ---------------------------------------------------------------- controlled proposer
REFERENCE = [random.Random(1).randrange(50) for _ in range(20000)]


def test_controlled_at_acceptance_one_reads_the_reference_and_at_zero_is_always_wrong():
    assert ControlledProposer(1.0, 4).propose(REFERENCE, 10, 50) == REFERENCE[10:14]
    wrong = ControlledProposer(0.0, 4).propose(REFERENCE, 10, 50)
    assert len(wrong) == 4 and all(w != r and 0 <= w < 50 for w, r in zip(wrong, REFERENCE[10:]))
    assert ControlledProposer(1.0, 4).propose(REFERENCE, 19998, 50) == REFERENCE[19998:], \
        "no proposal past the reference's end"


def test_controlled_is_deterministic_per_seed_request_and_position():
    a = ControlledProposer(0.5, 8, seed=3)
    first = a.propose(REFERENCE, 100, 50, request_key="r1")
    a.propose(REFERENCE, 100, 50, request_key="r2")  # another request in between
    assert ControlledProposer(0.5, 8, seed=3).propose(REFERENCE, 100, 50, "r1") == first
    assert a.propose(REFERENCE, 102, 50, "r1")[:6] == first[2:], "a position's coin is fixed"
    others = [ControlledProposer(0.5, 8, seed=s).propose(REFERENCE, 100, 50, "r1")
              for s in range(4, 8)]
    assert any(o != first for o in others), "another seed, other mistakes"


@pytest.mark.parametrize("acceptance, k", [(0.5, 2), (0.8, 4), (0.9, 8)])
def test_controlled_emits_the_expected_tokens_per_verify_step(acceptance, k):
    drafter, stats, start = ControlledProposer(acceptance, k, seed=1), SpecDecodeStats(), 0
    emitted = []
    while start + k < len(REFERENCE):
        draft = drafter.propose(REFERENCE, start, 50)
        n, token = accept_greedy(draft, REFERENCE[start:start + k + 1])
        assert token == REFERENCE[start + n], "the target's token keeps it on the reference"
        stats.record(len(draft), n)
        emitted.append(n + 1)
        start += n + 1
    standard_error = torch.tensor(emitted, dtype=torch.float64).std() / len(emitted) ** 0.5
    assert stats.tokens_per_forward == pytest.approx(
        expected_tokens_per_step(acceptance, k), abs=4 * float(standard_error))


# ---------------------------------------------------------------- greedy acceptance
@pytest.mark.parametrize("k", [1, 2, 3])
def test_accept_greedy_emits_what_plain_greedy_decoding_would_on_every_small_case(k):
    for draft in itertools.product(range(3), repeat=k):
        for target in itertools.product(range(3), repeat=k + 1):
            n, token = accept_greedy(list(draft), list(target))
            assert list(draft[:n]) + [token] == list(target[:n + 1]), (draft, target)
            assert n == k or draft[n] != target[n], "stopped before a mismatch"


def test_accept_greedy_takes_tensors_and_checks_lengths():
    assert accept_greedy(torch.tensor([4, 5, 6]), torch.tensor([4, 5, 7, 8])) == (2, 7)
    assert accept_greedy([4, 5], [4, 5, 9]) == (2, 9), "all accepted: the bonus token"
    assert accept_greedy([], [3]) == (0, 3), "no draft: a plain decode"
    with pytest.raises(ValueError, match="one entry per draft token plus one"):
        accept_greedy([1, 2], [1, 2])


def test_rejection_sampling_with_one_hot_distributions_is_greedy_acceptance():
    eye = torch.eye(3)
    for draft in itertools.product(range(3), repeat=2):
        for target in itertools.product(range(3), repeat=3):
            n, token = accept_greedy(list(draft), list(target))
            assert rejection_sample(list(draft), eye[list(draft)], eye[list(target)]) == \
                list(draft[:n]) + [token]


# ---------------------------------------------------------------- rejection sampling
P = torch.tensor([[0.40, 0.30, 0.20, 0.10, 0.00],
                  [0.05, 0.05, 0.10, 0.30, 0.50]])
DRAFTS = {
    "uniform": [0.2] * 5,
    "equal to p": [0.40, 0.30, 0.20, 0.10, 0.00],
    "mass where p has none": [0.10, 0.10, 0.10, 0.10, 0.60],
    "no mass where p has some": [0.00, 0.00, 0.50, 0.50, 0.00],
    "one-hot": [0.00, 1.00, 0.00, 0.00, 0.00],
}
CHI2_DF4_P1E4 = 23.5  # the chi-square (4 degrees of freedom) exceeded with probability 1e-4


def chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = counts.sum() * p
    seen = expected > 0
    assert counts[~seen].sum() == 0, f"emitted a token the target gives no mass: {counts}"
    return float(((counts[seen] - expected[seen]) ** 2 / expected[seen]).sum())


@pytest.mark.parametrize("name", list(DRAFTS))
def test_rejection_sampling_emits_tokens_distributed_as_the_target(name):
    q = torch.tensor([DRAFTS[name], DRAFTS["uniform"]])  # [k=2, vocab=5]
    target = torch.cat([P, P[:1]])                      # [k+1, vocab]: bonus from row 0 again
    g = torch.Generator().manual_seed(0)
    first, second, bonus = torch.zeros(5), torch.zeros(5), torch.zeros(5)
    for _ in range(3000):
        draft = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        out = rejection_sample(draft, q, target, g)
        assert 1 <= len(out) <= 3 and out[:len(out) - 1] == draft[:len(out) - 1]
        first[out[0]] += 1
        if len(out) > 1:  # the first draft was accepted: the second token follows row 1
            second[out[1]] += 1
        if len(out) == 3:  # both accepted: the bonus token follows row 2
            bonus[out[2]] += 1
    assert chi2(first, P[0]) < CHI2_DF4_P1E4, f"first tokens {first.tolist()} vs p {P[0]}"
    assert chi2(second, P[1]) < CHI2_DF4_P1E4, f"second tokens {second.tolist()} vs p {P[1]}"
    assert chi2(bonus, P[0]) < CHI2_DF4_P1E4, f"bonus tokens {bonus.tolist()} vs p {P[0]}"


@pytest.mark.parametrize("draft", [[1, 4], [0, 3], [4, 4]], ids=["likely", "top", "no mass"])
def test_a_deterministic_draft_keeps_the_target_distribution(draft):
    """n-gram and controlled drafts are fixed tokens: q is a point mass, x is kept with
    probability p(x), and a rejection draws from p without x."""
    target = torch.cat([P, P[:1]])
    g = torch.Generator().manual_seed(0)
    first, second, bonus = torch.zeros(5), torch.zeros(5), torch.zeros(5)
    for _ in range(3000):
        out = rejection_sample_point_drafts(draft, target, g)
        assert out[:len(out) - 1] == draft[:len(out) - 1]
        if len(out) < 3:
            assert out[-1] != draft[len(out) - 1], "a rejected draft token is never drawn back"
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
        if len(out) == 3:
            bonus[out[2]] += 1
    assert chi2(first, P[0]) < CHI2_DF4_P1E4, f"first tokens {first.tolist()} vs p {P[0]}"
    if second.sum():
        assert chi2(second, P[1]) < CHI2_DF4_P1E4, f"second {second.tolist()} vs p {P[1]}"
    if bonus.sum():
        assert chi2(bonus, P[0]) < CHI2_DF4_P1E4, f"bonus {bonus.tolist()} vs p {P[0]}"


def test_rejection_sample_checks_shapes():
    with pytest.raises(ValueError, match=r"draft_probs must be \[k=2, vocab\]"):
        rejection_sample([1, 2], torch.rand(3, 5), torch.rand(3, 5))
    with pytest.raises(ValueError, match=r"target_probs must be \[k \+ 1 = 3, vocab = 5\]"):
        rejection_sample([1, 2], torch.rand(2, 5), torch.rand(2, 5))


# ---------------------------------------------------------------- statistics
def test_expected_tokens_per_step_is_the_geometric_sum():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1.75)


def test_stats_count_proposed_and_accepted_tokens():
    stats = SpecDecodeStats()
    stats.record(4, 3)
    stats.record(4, 0)
    assert (stats.num_verifies, stats.num_proposed, stats.num_accepted) == (2, 8, 3)
    assert stats.acceptance_rate == 3 / 8 and stats.mean_accepted_length == 1.5
    assert stats.tokens_per_forward == 2.5
    with pytest.raises(ValueError, match="num_accepted"):
        stats.record(2, 3)
