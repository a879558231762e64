"""What the engine accepts from a caller, checked before anything is queued: prompts (token-id
lists, 1-D integer tensors, a 2-D tensor as a batch, or text with a tokenizer) and
SamplingParams. A refused call raises a TypeError or ValueError that names the prompt or
parameter and what to pass instead; ``LLM.generate`` and ``LLM.add_request`` call these first,
so a refused call changes nothing."""
from __future__ import annotations

from operator import index

import torch

from labkit.engine.sampling import SamplingParams


def prompt_list(prompts) -> list:
    """``generate``'s prompts as a list, one entry a prompt (not yet checked one by one)."""
    if isinstance(prompts, torch.Tensor) and prompts.dim() != 2:
        raise TypeError(f"prompts is a {prompts.dim()}-D tensor; generate() takes a list of "
                        "prompts, each a list of token ids: pass [tensor] for one prompt "
                        "(or a 2-D tensor, one prompt a row)")
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and isinstance(prompts[0], int)):
        raise TypeError("generate() takes a list of prompts (each a list of token ids, or a "
                        "string with a tokenizer); wrap a single prompt in a list")
    try:
        prompts = list(prompts)
    except TypeError:
        raise TypeError(f"prompts must be a list of prompts (each a list of token ids), got "
                        f"{type(prompts).__name__}") from None
    return prompts


def check_params(p, name: str, vocab_size: int) -> SamplingParams:
    """``p`` as the SamplingParams of a request, or a TypeError/ValueError naming ``name``."""
    if isinstance(p, dict):
        fields = ", ".join(f"{k}={v!r}" for k, v in p.items())
        raise TypeError(f"{name} is a dict; pass SamplingParams({fields})")
    if not isinstance(p, SamplingParams):
        raise TypeError(f"{name} must be a SamplingParams, got {type(p).__name__}")
    bad = next((t for t in p.stop_token_ids if t >= vocab_size), None)
    if bad is not None:  # never sampled, so it would never stop the request
        raise ValueError(f"{name}.stop_token_ids holds {bad}, outside the vocabulary "
                         f"[0, {vocab_size}): the model never samples it; check the tokenizer's "
                         "stop ids")
    return p

def params_for(n: int, sampling_params, vocab_size: int) -> list[SamplingParams]:
    """One SamplingParams per prompt from what ``generate`` was given (None, one, or a list)."""
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, (SamplingParams, dict)):
        return [check_params(sampling_params, "sampling_params", vocab_size)] * n
    try:
        params = list(sampling_params)
    except TypeError:
        raise TypeError(f"sampling_params must be one SamplingParams or a list of {n} (one "
                        f"per prompt), got {type(sampling_params).__name__}") from None
    if len(params) != n:
        raise ValueError(f"sampling_params must be one SamplingParams or a list of one per "
                         f"prompt: got {len(params)} SamplingParams for {n} prompts")
    return [check_params(p, f"sampling_params[{i}]", vocab_size) for i, p in enumerate(params)]

def token_ids_of(i: int, prompt, tokenizer=None) -> list[int] | None:
    """The prompt's token ids (None: text with no tokenizer, an error for its request), or
    a TypeError naming prompt ``i`` when it is not a prompt at all."""
    if isinstance(prompt, str):
        return None if tokenizer is None else list(tokenizer.encode(prompt))
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1:
            raise TypeError(f"prompt {i} is a {prompt.dim()}-D tensor; a prompt is a 1-D "
                            "tensor (or list) of token ids")
        if prompt.dtype.is_floating_point or prompt.dtype.is_complex or \
                prompt.dtype == torch.bool:
            raise TypeError(f"prompt {i} is a {prompt.dtype} tensor; token ids are integers "
                            "(torch.long or torch.int32)")
        return prompt.tolist()
    if hasattr(prompt, "tolist"):  # a numpy array
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple, range)):
        raise TypeError(f"prompt {i} is a {type(prompt).__name__}; a prompt is a list of "
                        "token ids (or a string, with a tokenizer)")
    ids = []
    for pos, t in enumerate(prompt):
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(index(t))
        except TypeError:
            raise TypeError(f"prompt {i} holds {type(t).__name__} {t!r} at position {pos}: "
                            "token ids are ints") from None
    return ids
