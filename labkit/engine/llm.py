"""The engine's front door: ``LLM(model).generate(prompts, SamplingParams(...))``.

    llm = LLM("path/to/checkpoint")             # or LLM(ModelConfig.tiny()): random weights
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16))
    outs[0].token_ids, outs[0].ttft_s, outs[0].tpot_s

Every request of a ``generate`` call arrives at once; ``add_request`` + ``step`` feed requests
in over time. Each ``step`` runs the engine's loop, plain or with async scheduling (the default
on a GPU: the host schedules step N+1 while the device computes step N): see
``labkit.engine.step_loop``. Times come from one clock: a token exists when the host has read
it. TTFT is from arrival to the first token, TPOT the mean gap between the following ones.

Every optimisation can be switched off for a comparison: ``cudagraph_mode`` (which steps
replay graphs: "none", "full_decode_only", "piecewise", "full_and_piecewise"; ``enforce_eager``
is "none"),
``backend=`` (one attention backend instead of auto), ``enable_prefix_caching``, and a small
``max_num_batched_tokens`` forces chunked prefill.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch

from labkit import check_positive_int, check_power_of_two
from labkit.device import select_device
from labkit.engine.config import ModelConfig
from labkit.engine.inputs import check_params, params_for, prompt_list, token_ids_of
from labkit.engine.mla import MLAModel
from labkit.engine.model import LlamaModel
from labkit.engine.outputs import FINISH_REASONS, EngineStats, RequestOutput, StepRecord
from labkit.engine.reference_run import reference_tokens
from labkit.engine.runner import ModelRunner, resolve_cudagraph_mode
from labkit.engine.sampling import SamplingParams, request_generator
from labkit.engine.scheduler import Scheduler, SchedulerConfig
from labkit.engine.speculative import SpeculativeConfig
from labkit.engine.step_loop import LaunchedStep, LiveRequest, StepLoop
from labkit.engine.weights import load_model, random_model
from labkit.kvcache import BlockManager


class LLM(StepLoop):
    """``model``: a checkpoint folder (config.json + safetensors), a ModelConfig (random
    weights from ``seed``) or a LlamaModel. The KV cache holds ``num_blocks`` blocks of
    ``block_size`` tokens, or as many as ``kv_cache_memory`` bytes hold (default: every running
    request at full length; on a GPU at most half the free memory). A step computes at most
    ``max_num_batched_tokens`` tokens of at most ``max_num_seqs`` requests. ``backend``: "auto"
    or a name of ``labkit.attention.BACKENDS``. ``cudagraph_mode`` says which steps replay CUDA
    Graphs (``labkit.engine.cudagraphs`` explains the four modes; None: "full_and_piecewise" on CUDA,
    "none" elsewhere); ``enforce_eager=True`` is "none". ``cudagraph_capture_sizes``: the token
    counts piecewise graphs are captured for (default ``default_token_buckets``).
    ``decode_context_buckets``: key full decode graphs by (batch, context bucket) too, so each
    plans attention's KV splits for its context instead of ``max_model_len`` (default: one
    key per batch bucket).
    ``async_scheduling`` (default: on with CUDA, off with ``speculative``) schedules step N+1
    while step N computes; with speculation only the controlled draft can (its drafts depend
    on the position alone: ``labkit.engine.scheduler`` explains how a row is planned ahead).
    ``fused_ops`` runs each layer's small ops as three fused Triton kernels (default: on with
    CUDA, eager steps included): replayed, a step is GPU time and the fused kernels save it
    (``recorded_data/prefill_vs_decode.json`` has the measured gain); launched eagerly, a step
    is host time per launch, and fusing leaves about ten launches a layer where the plain ops
    take about forty, so eager stays a lean control beside the graphs, running their kernels. On CPU the
    kernels run in Triton's interpreter, so the default there is off. A model built here
    is built with that choice; a LlamaModel given keeps its own for direct calls, and the
    engine runs it with this one (``LLM.fused_ops``). ``compile=True`` runs the forward
    compiled (``labkit.engine.compiled``: traced by Dynamo, split at attention, each piece
    compiled by Inductor for a symbolic token count), the plain ops fused by Inductor; its
    pieces are captured as ``cudagraph_mode`` says (on CPU piecewise replays re-run them).
    ``device_step_times=True`` (CUDA only) gives each step's record its time on the device
    (``StepRecord.device_s``): CUDA events in stream order from its inputs on the device (the
    host has built and sent its metadata) to its samples. For a replayed step that is the GPU's
    time; for an eager one it also counts the GPU waiting for the host's launches. Where a
    step's wall time is host time, it says what the GPU needed.
    """

    def __init__(self, model: str | Path | ModelConfig | LlamaModel, *,
                 num_blocks: int | None = None, kv_cache_memory: int | None = None,
                 block_size: int = 16, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 64, max_model_len: int | None = None,
                 enforce_eager: bool = False, backend: str = "auto",
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 device: str | torch.device = "auto", dtype: torch.dtype | None = None,
                 seed: int = 0, tokenizer: Any = None, async_scheduling: bool | None = None,
                 fused_ops: bool | None = None, cudagraph_mode: str | None = None,
                 cudagraph_capture_sizes: Sequence[int] | None = None,
                 decode_context_buckets: Sequence[int] | None = None, compile: bool = False,
                 speculative: SpeculativeConfig | None = None,
                 device_step_times: bool = False):
        # The engine's own arguments first, by the names given here: a bad one must not surface
        # later as a derived quantity (num_blocks) the caller never passed.
        check_positive_int("max_num_seqs", max_num_seqs, hint="running requests at once")
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens,
                           hint="the token budget of one step")
        if max_model_len is not None:
            check_positive_int("max_model_len", max_model_len,
                               hint="prompt + output tokens, or None: the model's context")
        check_power_of_two("block_size", block_size, hint="tokens a KV block holds; 16 is usual")
        if num_blocks is not None:
            check_positive_int("num_blocks", num_blocks, hint="KV blocks, or None: sized for you")
        if kv_cache_memory is not None:
            check_positive_int("kv_cache_memory", kv_cache_memory, hint="bytes, or None")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63) (it seeds the random weights "
                             f"and each request's sampler), got {seed!r}")
        self.device = select_device(device)
        if isinstance(model, (LlamaModel, MLAModel)):
            self.device = model.embed_tokens.device  # a model given stays where it is
        mode = resolve_cudagraph_mode(cudagraph_mode, enforce_eager, self.device)
        asked_fused_ops = fused_ops
        if fused_ops is None:  # compiled, Inductor fuses the plain ops itself
            fused_ops = self.device.type == "cuda" and not compile
        fused_ops = bool(fused_ops)
        if isinstance(model, (LlamaModel, MLAModel)):
            self.model = model  # built already: the runner runs it with fused_ops
        elif isinstance(model, ModelConfig):
            self.model = random_model(model, seed=seed, device=self.device, dtype=dtype,
                                      fused_ops=fused_ops)
        elif isinstance(model, (str, Path)):
            self.model = load_model(model, device=self.device, dtype=dtype, fused_ops=fused_ops)
        else:
            raise TypeError(f"model must be a checkpoint folder, a ModelConfig, a LlamaModel or "
                            f"an MLAModel, got {type(model).__name__}")
        self.model.eval()
        if isinstance(self.model, MLAModel) and asked_fused_ops is None:
            fused_ops = False  # the fused ops are the Llama layer's; an MLA model has its own
        self.config = self.model.config
        self.tokenizer = tokenizer
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise TypeError(f"speculative must be a SpeculativeConfig or None, got "
                            f"{type(speculative).__name__}")
        self.runner = ModelRunner(
            self.model, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
            block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            backend=backend, fused_ops=fused_ops, cudagraph_mode=mode,
            token_buckets=None if cudagraph_capture_sizes is None else tuple(
                cudagraph_capture_sizes), max_num_batched_tokens=max_num_batched_tokens,
            decode_context_buckets=None if decode_context_buckets is None else tuple(
                decode_context_buckets), compile=bool(compile),
            num_speculative_tokens=None if speculative is None
            else speculative.num_speculative_tokens)
        self.block_manager = BlockManager(self.runner.num_blocks, block_size,
                                          enable_prefix_caching)
        # what an engine needs to run its steps as this one does (the controlled draft's
        # reference engine, labkit.engine.reference_run, is built from it)
        self.options = {"block_size": block_size, "max_num_batched_tokens": max_num_batched_tokens,
                        "max_num_seqs": max_num_seqs, "max_model_len": self.runner.max_model_len,
                        "backend": backend, "enable_chunked_prefill": enable_chunked_prefill,
                        "fused_ops": fused_ops, "cudagraph_mode": mode,
                        "cudagraph_capture_sizes": cudagraph_capture_sizes,
                        "decode_context_buckets": decode_context_buckets,
                        "compile": bool(compile)}
        if async_scheduling is None:  # speculation: the synchronous loop unless asked
            async_scheduling = self.device.type == "cuda" and speculative is None
        self.async_scheduling = bool(async_scheduling)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=self.runner.max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            decode_buckets=self.runner.decode_buckets, vocab_size=self.config.vocab_size,
            async_scheduling=self.async_scheduling, speculative=speculative), self.block_manager)
        self.step_history: list[StepRecord] = []
        self._seeds = random.Random(seed)  # per-request seeds where SamplingParams has none
        self._next_id = 0
        self._live: dict[int, LiveRequest] = {}
        self._finished: dict[int, RequestOutput] = {}   # refused at add_request, not yet returned
        self._launched: LaunchedStep | None = None      # async: the step on the device
        self._token_buffers = None
        if self.device.type == "cuda":  # two pinned buffers: step N's and step N+1's samples
            # a verify row samples k + 1 tokens, every other row at most one
            per_row = 1 + (0 if speculative is None else speculative.num_speculative_tokens)
            self._token_buffers = [torch.empty(max_num_seqs * per_row, dtype=torch.int64,
                                               pin_memory=True) for _ in range(2)]
        self._clock0 = time.perf_counter()
        self.device_step_times = bool(device_step_times) and self.device.type == "cuda"

    @property
    def backend(self) -> str:
        return self.runner.backend.name

    @property
    def cudagraph_mode(self) -> str:
        """Which steps replay CUDA Graphs (see ``labkit.engine.runner``)."""
        return self.runner.cudagraph_mode

    @property
    def fused_ops(self) -> bool:
        """Whether the engine runs the layers' small ops fused (see the class docstring)."""
        return self.runner.fused_ops

    @property
    def selection_log(self) -> list[str]:
        return list(self.runner.selection_log)

    def _now(self, sync: bool = True) -> float:
        """The engine clock. ``sync``: first wait for the device (the plain loop's step ends
        when the device is done); async scheduling never waits, it reads its events."""
        if sync and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - self._clock0

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Sequence[Sequence[int] | str] | torch.Tensor,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One output per prompt, in order. ``prompts``: a list (any iterable) of prompts, each
        a list of token ids, a 1-D integer tensor or a string (with a tokenizer); a 2-D integer
        tensor is a batch of equal-length prompts, one a row. Prompts or params of the wrong
        type raise before anything is queued. A request that cannot be served (a token outside
        the vocabulary, too long, empty) gets ``finish_reason="error"`` and its ``error``; the
        rest of the batch goes on. If a step fails (the device raised), this call's requests
        are dropped and the engine is left as it was before the call; the error propagates."""
        prompts = prompt_list(prompts)
        if self.has_unfinished_requests():
            raise RuntimeError("generate() runs on an idle engine: requests added with "
                               "add_request() are still unfinished; step() them to the end")
        # Every check before the first request is queued: a refused call changes nothing.
        token_ids = [token_ids_of(i, p, self.tokenizer) for i, p in enumerate(prompts)]
        params = params_for(len(prompts), sampling_params, self.config.vocab_size)
        references = self._references(token_ids, params)  # untimed, before any arrival
        ids = [self._add(prompt, ids, p, ref)
               for prompt, ids, p, ref in zip(prompts, token_ids, params, references)]
        done: dict[int, RequestOutput] = {}
        for rid in ids:  # refused at once
            if rid in self._finished:
                done[rid] = self._finished.pop(rid)
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    done[out.request_id] = out
        except BaseException:
            self._abort_all()
            raise
        outputs = [done[rid] for rid in ids]
        for i, out in enumerate(outputs):
            out.index = i
        return outputs

    def add_request(self, prompt: Sequence[int] | str | torch.Tensor,
                    sampling_params: SamplingParams | None = None, *,
                    reference: Sequence[int] | None = None) -> int:
        """Queue one request now (its arrival time); returns its id. A prompt or params of the
        wrong type raise (nothing is queued, no id is used). A request that cannot be served
        finishes at once with an error (see ``step``'s outputs or ``generate``).
        ``reference``: with the controlled draft, the request's greedy continuation; without
        one it is computed here first (untimed for this request, but requests already running
        wait for it: pass it, or use ``generate``, when they are being timed)."""
        ids = token_ids_of(0, prompt, self.tokenizer)
        p = check_params(sampling_params or SamplingParams(), "sampling_params",
                         self.config.vocab_size)
        if reference is None:
            reference = self._references([ids], [p])[0]
        return self._add(prompt, ids, p, reference)

    def _references(self, token_ids: Sequence[list[int] | None],
                    params: Sequence[SamplingParams]) -> list[list[int] | None]:
        """The controlled draft's reference for each request: its greedy continuation, from an
        untimed run of an engine configured as this one whose steps take the verify steps'
        shape (``labkit.engine.reference_run``; None for a sampled request, or without the
        controlled draft). This engine's clock, statistics, step history and prefix cache never
        see it. Its tokens are the target's own, so what the controlled draft shows is the upper
        bound for a draft of its acceptance rate on random weights (a near tie that another
        step shape breaks the other way can only lower acceptance; the output stays plain greedy
        decoding's either way)."""
        return reference_tokens(self, token_ids, params)

    def _add(self, prompt, ids: list[int] | None, p: SamplingParams,
             reference: list[int] | None = None) -> int:
        rid = self._next_id
        self._next_id += 1
        error = None
        if ids is None:  # text, and no tokenizer to encode it
            error = (f"prompt {rid} is text but this LLM has no tokenizer: pass "
                     "LLM(..., tokenizer=...) or give token ids")
        arrival = self._now(sync=not self.async_scheduling)
        req = None
        if error is None:
            req = self.scheduler.add_request(rid, ids, max_tokens=p.max_tokens,
                                             eos_token_ids=p.stop_token_ids,
                                             reference=reference)
            error = req.error
        if error is not None:
            out = RequestOutput(rid, list(ids or []), [], "error", error, request_id=rid)
            self._finished[rid] = out
            return rid
        seed = p.seed if p.seed is not None else self._seeds.getrandbits(63)
        generator = None if p.greedy else request_generator(seed, self.device)
        self._live[rid] = LiveRequest(rid, req, p, generator, arrival)
        return rid

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._launched is not None

    def _output(self, entry: LiveRequest) -> RequestOutput:
        req, times = entry.request, entry.token_times_s
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids)
        spec = req.spec_stats
        return RequestOutput(entry.request_id, list(req.prompt_token_ids),
                             list(req.output_token_ids), FINISH_REASONS[req.status], req.error,
                             times[0] if times else None, tpot, list(times),
                             req.num_cached_tokens, req.num_preemptions, text, entry.request_id,
                             spec.num_verifies, spec.num_proposed, spec.num_accepted,
                             len(set(req.token_steps)))  # a verify row's tokens share a step

    # ------------------------------------------------------------------ statistics
    @property
    def stats(self) -> EngineStats:
        """Totals over every step this engine has run."""
        h = [r.stats for r in self.step_history]
        return EngineStats(
            num_steps=len(h), num_graph_steps=sum(r.graph_batch is not None
                                                  for r in self.step_history),
            prefill_tokens=sum(s.num_prefill_tokens for s in h),
            decode_tokens=sum(s.num_decode_tokens for s in h),
            padded_rows=sum(s.padded_rows for s in h),
            prefix_hit_tokens=sum(s.prefix_hit_tokens for s in h),
            preemptions=sum(s.num_preempted for s in h),
            num_piecewise_steps=sum(r.graph_tokens is not None for r in self.step_history),
            padded_tokens=sum(r.padded_tokens for r in self.step_history),
            num_spec_proposed=self.scheduler.spec_stats.num_proposed,
            num_spec_accepted=self.scheduler.spec_stats.num_accepted,
            num_spec_verifies=self.scheduler.spec_stats.num_verifies)

    def history_table(self):
        """One row per step: the scheduler's statistics, graph or eager, and its time (and its
        device time with ``device_step_times``)."""
        import pandas as pd

        return pd.DataFrame([{**asdict(r.stats), "graph": r.graph, "graph_batch": r.graph_batch,
                              "graph_tokens": r.graph_tokens, "padded_tokens": r.padded_tokens,
                              "start_ms": r.start_s * 1e3, "duration_ms": r.duration_s * 1e3,
                              "device_ms": None if r.device_s is None else r.device_s * 1e3}
                             for r in self.step_history])
