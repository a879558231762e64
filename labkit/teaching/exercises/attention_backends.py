"""Notebook 06's exercises, written in Triton in ``kernels/exercises/``.

06.1 (``attention_tile_loop.py``): the masked loop over key tiles with the online softmax,
checked against the float64 reference on lengths that are not multiples of the tile, one
token, no queries, and a chunk of new queries after cached keys.

06.2 (``split_kv_merge.py``): the merge of split-KV partial results, checked on partials and
log-sum-exps computed from real attention over keys cut into splits: a split count that is not
a power of two, empty splits, and a token whose every split is empty.

Inputs sit inside NaN guard bands (``guarded``): under the interpreter a stray access is caught
by the bounds check with its program id; on a GPU it reads NaN, which the comparison shows.
"""
from __future__ import annotations

import math
import random

import torch

from labkit.attention.reference import attention_one_sequence
from labkit.teaching.exercises import Case, Exercise, guarded
from labkit.kernels.paged_attention_split import merge_splits_ref

HEAD_DIM = 16


# --- 06.1 the masked tile loop ---------------------------------------------------------------
def _attn_with(q, k, v, visible) -> torch.Tensor:
    """float64 attention with an explicit [len_q, len_k] mask (for naming common mistakes)."""
    q, k, v = (t.double().cpu() for t in (q, k, v))
    s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", p, v)


def _tile_cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n = rng.randrange(17, 60)
    shapes = [("one query over 37 keys (decode)", 1, 37, True),
              ("37 queries and keys: not a multiple of the 16-wide tile", 37, 37, True),
              ("exactly one tile (16 queries, 16 keys)", 16, 16, True),
              ("one token", 1, 1, True),
              ("no queries at all (empty)", 0, 5, True),
              ("a chunk of 5 new queries after 40 cached keys", 5, 45, True),
              ("not causal: 20 queries over 33 keys", 20, 33, False),
              (f"{n} queries and keys", n, n, True)]
    cases = []
    for label, len_q, len_k, causal in shapes:
        q, k, v = (torch.randn(length, 2, HEAD_DIM, generator=g).to(device)
                   for length in (len_q, len_k, len_k))
        cases.append(Case(label, (q, k, v, causal)))
    return cases


def _tile_run(fn, case: Case) -> dict:
    q, k, v, causal = case.args
    return {"out": fn(guarded(q), guarded(k), guarded(v), causal)}


def _tile_expected(case: Case) -> dict:
    q, k, v, causal = case.args
    out = attention_one_sequence(q.double(), k.double(), v.double(), causal=causal, window=None,
                                 scale=1 / math.sqrt(HEAD_DIM))
    return {"out": out}


def _tile_diagnose(case: Case, got: dict, expected: dict) -> str | None:
    q, k, v, causal = case.args
    out, want = got.get("out"), expected["out"]
    if not isinstance(out, torch.Tensor) or out.shape != want.shape or not out.numel():
        return None
    out = out.double().cpu()
    if out.isnan().any():
        return ("NaN in out. A query whose scores in a tile are all -inf gets m_new = -inf if "
                "m_i is -inf too, and 2^(-inf - -inf) is NaN: keep m_i starting at -1e30 "
                "(finite) and build m_new from it.")
    if not out.any() and want.abs().max() > 0:
        return ("out is all zeros: nothing was ever added into acc. Is the loop still the stub?")
    pos = torch.arange(len(q))[:, None] + (len(k) - len(q))
    j = torch.arange(len(k))[None, :]
    mistakes = {"attention without the causal mask: hide keys j > pos": j >= 0,
                "a causal mask that also hides the diagonal: a query sees its own key (j <= pos)":
                    j < pos}
    for what, visible in mistakes.items():
        if causal and torch.allclose(out, _attn_with(q, k, v, visible), atol=1e-3):
            return f"Your output is {what}."
    rows = sorted({int(r) for r in (out - want).abs().amax((1, 2)).gt(2e-3).nonzero().flatten()})
    return (f"Wrong queries: {rows[:12]}{' ...' if len(rows) > 12 else ''}. What do their key "
            "tiles have in common (the last, partial tile? the diagonal?) And when a larger "
            "score turns up, both l_i and acc must be rescaled by alpha.")


# --- 06.2 the split-KV merge --------------------------------------------------------------------
def _split_inputs(g: torch.Generator, tokens: int, heads: int, splits: int, head_dim: int,
                  contexts: list[int]):
    """Partials and base-2 log-sum-exps of real attention over ``contexts[t]`` keys per token."""
    partial = torch.zeros(tokens, heads, splits, head_dim, dtype=torch.float64)
    lse = torch.full((tokens, heads, splits), float("-inf"), dtype=torch.float64)
    for t, length in enumerate(contexts):
        q = torch.randn(heads, head_dim, generator=g, dtype=torch.float64)
        k, v = (torch.randn(length, heads, head_dim, generator=g, dtype=torch.float64)
                for _ in range(2))
        size = max(1, -(-length // splits))
        for s in range(splits):
            lo, hi = s * size, min((s + 1) * size, length)
            if lo >= hi:
                continue  # an empty split: lse -inf, partial zeros
            x = torch.einsum("hd,khd->hk", q, k[lo:hi]) / math.sqrt(head_dim) * math.log2(math.e)
            lse[t, :, s] = torch.logsumexp(x * math.log(2), -1) / math.log(2)
            partial[t, :, s] = torch.einsum("hk,khd->hd", torch.softmax(x * math.log(2), -1),
                                            v[lo:hi])
    return partial.float(), lse.float()


def _merge_cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    shapes = [("3 splits: not a power of two", 4, 2, 3, 16, [rng.randrange(9, 60) for _ in range(4)]),
              ("one split", 2, 2, 1, 16, [7, 30]),
              ("no tokens (empty)", 0, 2, 4, 16, []),
              ("8 splits over short contexts: some splits are empty", 3, 2, 8, 16, [3, 5, 40]),
              ("a token with no keys at all: every split is empty", 2, 2, 4, 16, [0, 13]),
              ("5 splits, head_dim 32", 2, 1, 5, 32, [rng.randrange(5, 80) for _ in range(2)])]
    cases = []
    for label, tokens, heads, splits, head_dim, contexts in shapes:
        partial, lse = _split_inputs(g, tokens, heads, splits, head_dim, contexts)
        cases.append(Case(label, (partial.to(device), lse.to(device))))
    return cases


def _merge_run(fn, case: Case) -> dict:
    partial, lse = case.args
    return {"out": fn(guarded(partial), guarded(lse))}


def _merge_expected(case: Case) -> dict:
    partial, lse = case.args
    return {"out": merge_splits_ref(partial, lse)}


def _merge_diagnose(case: Case, got: dict, expected: dict) -> str | None:
    partial, lse = (t.double().cpu() for t in case.args)
    out, want = got.get("out"), expected["out"]
    if not isinstance(out, torch.Tensor) or out.shape != want.shape or not out.numel():
        return None
    out = out.double().cpu()
    if out.isnan().any():
        return ("NaN in out: where every split of a (token, head) is empty, or on masked lanes, "
                "m is -inf and 2^(-inf - -inf) is NaN. Subtract 0 when m is -inf, and divide by "
                "1 when the total weight is 0.")
    if not out.any() and want.abs().max() > 0:
        return "out is all zeros: is the merge still the stub?"
    real = lse.isfinite().double()
    plain_mean = (partial * real[..., None]).sum(-2) / real.sum(-1, keepdim=True).clamp(min=1)
    if torch.allclose(out, plain_mean, atol=1e-3):
        return ("You averaged the splits' partials equally. A split holds 2^lse[s] of the total "
                "softmax weight: weigh it by 2^(lse[s] - m), then divide by the sum of weights.")
    return None


def _note(device) -> str:
    if torch.device(device).type == "cuda":
        return ("Run compiled on this GPU; a stray access reads the NaN guard around each input "
                "(the out-of-bounds report with program ids needs the interpreter: run without "
                "a GPU, or set TRITON_INTERPRET=1 before anything imports triton).")
    return ("Run in Triton's interpreter with every load and store checked against the "
            "tensors' bounds; float32 inputs, compared with a float64 reference.")


EXERCISES = [
    Exercise(
        id="06.1", title="the masked tile loop of flash attention", entry="attention",
        task="the loop over key tiles: masked K/V loads, causal mask, online softmax update",
        cases=_tile_cases, run=_tile_run, expected=_tile_expected, diagnose=_tile_diagnose,
        note=_note, kernel_file="attention_tile_loop.py", atol=1e-4, rtol=1e-4,
        gpu_tolerance=(1e-2, 1e-2),  # tl.dot on float32 runs in TF32 on a GPU
        hints=("`for n in range(0, len_k, BLOCK_N):` with `keys = n + offs_n`; a key exists when "
               "`keys < len_k`: pass that as the load's mask (other=0.0).",
               "Scores of keys that must stay hidden become -inf before the max: "
               "`tl.where(visible, s, float('-inf'))`, where `visible` combines `keys < len_k` "
               "and, with CAUSAL, `keys[None, :] <= pos[:, None]`.",
               "The update, in order: `m_new`, `alpha = tl.math.exp2(m_i - m_new)`, `p`, then "
               "`l_i` and `acc` both rescaled by `alpha` before adding this tile's part."),
        seen="On every length the kernel matches the float64 reference to about 1e-6 in the "
             "interpreter. Drop the load mask and the check names the program and the key rows "
             "past the end; flip `<=` to `<` and every query loses its own key. The same loop, "
             "split into unmasked middle tiles and masked edge tiles, is `_attend_range` in "
             "`kernels/flash_attention.py`.",
    ),
    Exercise(
        id="06.2", title="the split-KV merge", entry="merge_splits",
        task="load lse and partial with the split mask, weigh splits by 2^(lse - max), divide by "
             "the total weight",
        cases=_merge_cases, run=_merge_run, expected=_merge_expected, diagnose=_merge_diagnose,
        note=_note, kernel_file="split_kv_merge.py", atol=1e-5, rtol=1e-4,
        hints=("`real = offs_s < num_splits` is the mask; load lse with `other=float('-inf')` "
               "so a missing split weighs nothing, partial with `other=0.0`.",
               "`m = tl.max(lse, 0)`; if every split is empty, m is -inf: subtract "
               "`tl.where(m == float('-inf'), 0.0, m)` instead.",
               "`out = tl.sum(weight[:, None] * partial, 0) / total`, with `total` replaced by "
               "1 where it is 0."),
        seen="The merged output equals attention over all keys, whatever the number of splits, "
             "with empty splits and even a token with no keys (zeros, no NaN). That is why "
             "flash-decoding is exact: each split is a softmax of its own, and 2^lse says how "
             "much of the whole it holds. labkit's version is `_merge_splits_kernel` in "
             "`kernels/paged_attention_split.py`.",
    ),
]
