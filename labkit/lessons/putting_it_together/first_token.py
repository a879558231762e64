"""Has a row passed the experiment? Its first generated tokens against the model's own forward
with its weights in float32.

With random weights the logits are nearly flat, and in bf16 two candidates can lie closer than
the rounding error of a bf16 forward: which wins is decided by rounding, not by the backend. So
a first token counts as right when it is the float32 argmax or a near-tie of it, within twice
the largest logit error the model's own dtype makes on that prompt (two rounded forwards, each
off by up to that much). In float32 the band is zero: every first token must match.
"""
from __future__ import annotations

import copy

import torch

from labkit.device import free_memory
from labkit.engine import LlamaModel


@torch.inference_mode()
def first_token_truth(model: LlamaModel, prompts: list[list[int]]) -> list[dict]:
    """Per prompt: the first token of the plain forward with the weights in float32, its
    logits, and ``tie``: how far two rounded forwards can disagree on a logit, twice the
    largest logit error of the model's own dtype against float32 on this prompt (0 for a
    float32 model). A backend whose first token is not the float32 argmax but whose float32
    logit is within ``tie`` of it picked between a near-tie that rounding decides."""
    exact = model if model.embed_tokens.dtype == torch.float32 else copy.deepcopy(model).float()
    out = []
    for p in prompts:
        ids = torch.tensor([p], device=model.embed_tokens.device)
        hi = exact(ids)[0, -1].float()
        err = 0.0 if exact is model else float((model(ids)[0, -1].float() - hi).abs().max())
        out.append({"token": int(hi.argmax()), "logits": hi.cpu(), "tie": 2 * err})
    if exact is not model and model.embed_tokens.device.type == "cuda":
        del exact
        free_memory(model.embed_tokens.device)  # the float32 copy: twice the weights' bytes
    return out


def first_token_check(tokens: list[list[int]], truth: list[dict]) -> tuple[float, int]:
    """(share of requests whose first token is the float32 argmax or a near-tie of it, how
    many of them were near-ties)."""
    ok = ties = 0
    for toks, t in zip(tokens, truth):
        if not toks:
            continue
        if toks[0] == t["token"]:
            ok += 1
        elif float(t["logits"][t["token"]] - t["logits"][toks[0]]) <= t["tie"]:
            ok, ties = ok + 1, ties + 1
    return ok / len(truth), ties
