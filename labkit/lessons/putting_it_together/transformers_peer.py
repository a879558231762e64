"""The peer of labkit's engine benchmark: Hugging Face transformers on the same checkpoint.

``run_transformers`` generates greedily with ``LlamaForCausalLM`` over a static KV cache, its
decode forward compiled (transformers' own auto-compile, or ``torch.compile`` on older
versions), in batches of requests with similar prompt lengths (left padding). Only each
request's own output tokens count; the rest of a batch's longest output is ``wasted_tokens``.
Used by ``benchmarks/engine.py``; ``summary`` is shared with its labkit runs.
"""
from __future__ import annotations

import statistics
import time

import torch

from labkit.device import free_memory, synchronize


def median_ms(values) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values) * 1e3, 3) if values else None


def summary(tokens: int, seconds: float, ttfts, tpots, **extra) -> dict:
    """Throughput (output tokens / seconds) and median TTFT / TPOT in ms (None entries skipped)."""
    return {"output_tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds if seconds > 0 else None,
            "ttft_median_ms": median_ms(ttfts), "tpot_median_ms": median_ms(tpots), **extra}


class _StepClock:
    """A stopping criterion that never stops (or stops after ``stop_after`` tokens, for warm-up)
    and notes when each generated token exists: transformers calls it once per token."""

    def __init__(self, device, stop_after: int | None = None):
        self.device, self.stop_after, self.times = device, stop_after, []

    def __call__(self, input_ids, scores, **kwargs):
        synchronize(self.device)
        self.times.append(time.perf_counter())
        done = self.stop_after is not None and len(self.times) >= self.stop_after
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


def _forget_static_cache(hf) -> None:
    """transformers keeps the largest static cache (or its length) of earlier calls to avoid a
    recompile; each batch here gets a cache sized to itself, as a batch run alone would."""
    for name in ("_cache", "_previous_max_cache_length"):
        if hasattr(hf, name):
            delattr(hf, name)


def load_transformers(path, device, dtype, compile_forward: bool):
    import transformers
    from packaging.version import Version

    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    hf = transformers.LlamaForCausalLM.from_pretrained(
        path, attn_implementation="sdpa", **{dtype_kw: dtype}).to(device).eval()
    gc_ = hf.generation_config
    gc_.cache_implementation = "static"
    gc_.eos_token_id, gc_.pad_token_id = None, 0
    if not compile_forward:
        gc_.disable_compile = True
        how = "off (CPU or --quick)"
    elif hasattr(hf, "_valid_auto_compile_criteria"):
        # generate() itself compiles the decode forward over a static cache (CompileConfig,
        # mode reduce-overhead); the prefill of each batch stays eager, as its shape varies.
        how = f"transformers {transformers.__version__} auto-compile of the decode forward"
    else:
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
        how = f"torch.compile(model.forward) (transformers {transformers.__version__})"
    return hf, how


def hf_batches(prompts, batch_size) -> list[list[int]]:
    """Request indices grouped by similar prompt length (so little left padding)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[k:k + batch_size] for k in range(0, len(order), batch_size)]


def _hf_generate(hf, prompts, max_new, clock):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):  # left padding: every row's last token is at the end
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    _forget_static_cache(hf)
    with torch.no_grad():
        out = hf.generate(ids.to(hf.device), attention_mask=mask.to(hf.device), do_sample=False,
                          max_new_tokens=max_new,
                          stopping_criteria=[clock], eos_token_id=None, pad_token_id=0)
    return out[:, width:].tolist()


class TransformersPeer:
    """transformers' Llama loaded once from the checkpoint at ``path`` and warmed up (one short
    generate per batch shape, so every compile happens off the clock); :meth:`run` is one timed
    pass over every request, so the benchmark can interleave passes with its labkit runs."""

    def __init__(self, path, prompts: list[list[int]], olens: list[int], *,
                 device: torch.device, dtype: torch.dtype, batch_size: int,
                 compile_forward: bool):
        self.hf, self.how = load_transformers(path, device, dtype, compile_forward)
        self.prompts, self.olens, self.device = prompts, olens, device
        print(f"  transformers: static cache, compile {self.how}, batches of {batch_size}")
        self.batches = hf_batches(prompts, batch_size)
        if compile_forward:  # one compiled decode graph per batch shape, none left eager
            import torch._dynamo
            limit = getattr(torch._dynamo.config, "recompile_limit", None)
            name = "recompile_limit" if limit is not None else "cache_size_limit"
            setattr(torch._dynamo.config, name,
                    max(getattr(torch._dynamo.config, name), 2 * len(self.batches) + 8))
        for b in self.batches:  # compile for each batch's cache shape, off the clock
            _hf_generate(self.hf, [prompts[i] for i in b], max(olens[i] for i in b),
                         _StepClock(device, stop_after=5))

    def run(self) -> tuple[dict, list[list[int]]]:
        """Greedy generation of ``olens[i]`` tokens for each prompt: (summary, tokens)."""
        prompts, olens = self.prompts, self.olens
        tokens: list[list[int] | None] = [None] * len(prompts)
        ttfts, tpots = [None] * len(prompts), [None] * len(prompts)
        wasted, batch_seconds = 0, []
        t0 = time.perf_counter()
        for b in self.batches:
            clock = _StepClock(self.device)
            start = time.perf_counter()
            max_new = max(olens[i] for i in b)
            out = _hf_generate(self.hf, [prompts[i] for i in b], max_new, clock)
            for row, i in enumerate(b):  # only the request's own tokens are useful
                n = olens[i]
                tokens[i] = out[row][:n]
                ttfts[i] = clock.times[0] - t0
                tpots[i] = (clock.times[n - 1] - clock.times[0]) / (n - 1) if n > 1 else None
            wasted += sum(max_new - olens[i] for i in b)
            batch_seconds.append(round(time.perf_counter() - start, 4))  # one slow batch: a recompile
        seconds = time.perf_counter() - t0
        short = [i for i, t in enumerate(tokens) if len(t) != olens[i]]
        if short:
            raise RuntimeError(f"transformers produced the wrong number of tokens for requests "
                               f"{short[:5]}")
        return summary(sum(map(len, tokens)), seconds, ttfts, tpots, compile=self.how,
                       batches=len(self.batches), wasted_tokens=wasted,
                       batch_seconds=batch_seconds), tokens

    def close(self) -> None:
        del self.hf
        free_memory(self.device)  # one section's cache must not crowd the next


def run_transformers(path, prompts: list[list[int]], olens: list[int], *, device: torch.device,
                     dtype: torch.dtype, batch_size: int, compile_forward: bool
                     ) -> tuple[dict, list[list[int]]]:
    """One warmed-up, timed pass of :class:`TransformersPeer`: (summary, tokens per request)."""
    peer = TransformersPeer(path, prompts, olens, device=device, dtype=dtype,
                            batch_size=batch_size, compile_forward=compile_forward)
    try:
        return peer.run()
    finally:
        peer.close()
