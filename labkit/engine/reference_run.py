"""The controlled draft's reference: each request's greedy continuation, in the timed run's shapes.

The controlled draft (``labkit.engine.speculative.ControlledProposer``) proposes a request's
next tokens from a reference, right with probability ``acceptance``. Those "right" tokens are
only right if they are the tokens the timed engine's verify steps will choose, and in bf16 a
token can depend on the shape of the step that computes it: a decode step of one row runs a
GEMV on the CUDA cores, a verify step of k + 1 rows a ``tl.dot`` tile, and the two round
differently. On random weights many next tokens are near ties, so a plain greedy run and the
verify steps part ways within a few dozen tokens (on an H200, bench_1b in bf16: at tokens 1,
21 and 25 of three prompts), and from there on every draft read from the plain run is wrong.

So the reference comes from an engine configured as the timed one (same graphs, kernels,
budget, block size, k), whose own controlled draft has acceptance 0: every step it runs is a
verify step of k + 1 rows like the timed engine's, and only the target's first token counts.
Each row's projections are computed alone in their tile and each query's attention only
reads the keys before it, so a token comes out the same whichever row of a verify step
computes it, and the timed run, whatever its coins accept, stays on its reference. What can
still differ is said in :func:`reference_tokens`.

The reference engine is built once and kept on the model, shared by the engines over it with
the same options and k (graphs are captured once), with a KV cache sized for the requests it
is asked about, rebuilt larger when a call needs more.
"""
from __future__ import annotations

from typing import Sequence

from labkit.engine.sampling import SamplingParams
from labkit.engine.speculative import SpeculativeConfig


def reference_tokens(llm, token_ids: Sequence[list[int] | None],
                     params: Sequence[SamplingParams]) -> list[list[int] | None]:
    """For each request of ``llm`` (an ``LLM`` with the controlled draft) that is greedy and
    has tokens: its greedy continuation, computed by ``llm``'s reference engine (above); None
    for the others. The reference engine's clock, statistics, step history and prefix cache are
    its own, so ``llm`` never sees this run.

    Where the timed run's steps differ from the reference run's in more than the row a token
    sits in, a near tie can still break the other way and the timed run leaves its reference
    (its output is still its own greedy decoding; only acceptance drops): steps of more than 16
    rows (a cuBLAS GEMM whose kernel may change with the row count), a batch that changes as
    requests finish at different steps, drafts cut short at a request's end or when no block
    is free, and contexts long enough for the attention's split plan to deal keys differently.
    """
    spec = llm.scheduler.config.speculative
    todo = [i for i, (ids, p) in enumerate(zip(token_ids, params))
            if spec is not None and spec.method == "controlled" and ids and p.greedy]
    references: list[list[int] | None] = [None] * len(token_ids)
    if not todo:
        return references
    k, bs = spec.num_speculative_tokens, llm.block_manager.block_size
    # each request at full length, plus the k draft slots a verify step holds before rollback
    need = sum(-(-min(len(token_ids[i]) + params[i].max_tokens + k, llm.runner.max_model_len)
                 // bs) for i in todo)
    engine = reference_engine(llm, need)
    ids = {engine.add_request(token_ids[i], params[i], reference=[0] * params[i].max_tokens): i
           for i in todo}  # the dummy reference only shapes the (always wrong) drafts
    while engine.has_unfinished_requests():
        for out in engine.step():
            references[ids[out.request_id]] = out.token_ids
    return references


def reference_engine(llm, num_blocks: int):
    """``llm``'s reference engine, with at least ``num_blocks`` KV blocks (never more than
    ``llm`` has): configured as ``llm``, speculating with the controlled draft at acceptance 0,
    no prefix caching, no async scheduling. Built on first use and kept on the model, shared by
    every engine over it with the same options and k (each would otherwise capture graphs of
    its own: notebook 11 builds a dozen timed engines over two models); rebuilt larger when a
    call needs more blocks. Between calls it holds no request, so sharing it changes nothing."""
    num_blocks = min(llm.block_manager.num_blocks, max(num_blocks, 1))
    spec = llm.scheduler.config.speculative
    key = (spec.num_speculative_tokens, repr(sorted(llm.options.items())))
    shared = getattr(llm.model, "_reference_engines", None)
    if shared is None:
        shared = llm.model._reference_engines = {}
    engine = shared.get(key)
    if engine is None or engine.block_manager.num_blocks < num_blocks:
        engine = shared[key] = type(llm)(
            llm.model, num_blocks=num_blocks, enable_prefix_caching=False,
            async_scheduling=False, tokenizer=None, device_step_times=False,
            speculative=SpeculativeConfig("controlled", spec.num_speculative_tokens,
                                          acceptance=0.0, seed=spec.seed),
            **llm.options)
    llm._reference_llm = engine
    return engine
