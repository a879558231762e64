"""Notebook 11: speculative decoding, measured in labkit's engine.

Three questions, each answered from this run:
1. What does a draft of acceptance ``a`` buy per verify step? ``expected_table``: the formula
   (1 - a^(k+1)) / (1 - a), checked against the controlled draft's measured tokens per forward.
2. What does a verify step cost? ``step_costs``: the engine's (k + 1)-token verify steps against
   its one-token decode steps at several batch sizes, in interleaved rounds, with the share of
   each that replayed a full CUDA graph (on a GPU: per batch bucket for decode, per (request
   bucket, k + 1) for verify; ``graph_claim``).
3. Does the speed-up follow? ``speedups``: output tokens/s with the controlled draft against
   plain decoding, beside the formula divided by the measured relative step cost; and the n-gram
   proposer's acceptance on a workload that repeats itself against one that does not, beside
   how much each output repeats (``ngram_acceptance``, ``lookup_hits``).

The measurements are in ``measure``, the sentences made from them in ``claims``.
"""
from labkit.lessons.speculative_decoding.claims import (async_claim, cost_claim, draft_claim,
                                                        formula_claim, gpu_cost_claim,
                                                        graph_claim, ngram_claim, speedup_claims)
from labkit.lessons.speculative_decoding.measure import (MAX_MODEL_LEN, acceptance_check,
                                                         decode_span, draft_acceptance,
                                                         expected_table, full_verifies,
                                                         lookup_hits, lookup_models,
                                                         ngram_acceptance, prompts_for,
                                                         repeating_prompts, speedups, step_costs,
                                                         tokens_per_step)

__all__ = [
    "MAX_MODEL_LEN", "acceptance_check", "async_claim", "cost_claim", "decode_span",
    "draft_acceptance", "draft_claim", "expected_table", "formula_claim", "full_verifies",
    "gpu_cost_claim", "graph_claim", "lookup_hits", "lookup_models", "ngram_acceptance",
    "ngram_claim", "prompts_for", "repeating_prompts", "speedup_claims", "speedups",
    "step_costs", "tokens_per_step",
]
