"""The engine's front door: ``LLM(model).generate(prompts, SamplingParams(...))``.

    llm = LLM("path/to/checkpoint")             # or LLM(ModelConfig.tiny()): random weights
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=16))
    outs[0].token_ids, outs[0].ttft_s, outs[0].tpot_s

Every request of a call arrives at once; the loop is schedule -> run -> sample -> update until
all have finished. Times come from one step clock: the end of a step (after the device has
finished it) is when each token it sampled exists. TTFT is from arrival to the first token,
TPOT the mean gap between the following ones.

Every optimisation can be switched off for a comparison: ``enforce_eager`` (no CUDA Graphs),
``backend=`` (one attention backend instead of auto), ``enable_prefix_caching``, and a small
``max_num_batched_tokens`` forces chunked prefill.
"""
from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from labkit.device import select_device
from labkit.engine.config import ModelConfig
from labkit.engine.model import LlamaModel
from labkit.engine.request import Request, ScheduledStep, Status, StepStats
from labkit.engine.runner import ModelRunner
from labkit.engine.sampling import SamplingParams, request_generator, sample
from labkit.engine.scheduler import Scheduler, SchedulerConfig
from labkit.engine.weights import load_model, random_model
from labkit.kvcache import BlockManager

FINISH_REASONS = {Status.FINISHED_STOPPED: "stop", Status.FINISHED_LENGTH: "length",
                  Status.FINISHED_ERROR: "error"}


@dataclass
class RequestOutput:
    index: int                       # position in the prompts given to generate()
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str               # "stop" (a stop token), "length" or "error"
    error: str | None = None         # why the request was refused: the others still ran
    ttft_s: float | None = None      # arrival -> first token
    tpot_s: float | None = None      # mean time between later tokens; None with one token
    token_times_s: list[float] = field(default_factory=list)  # each token, since arrival
    num_cached_tokens: int = 0       # prompt tokens served by the prefix cache (last admission)
    num_preemptions: int = 0
    text: str | None = None          # decoded, when the LLM has a tokenizer

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class StepRecord:
    stats: StepStats
    graph_batch: int | None          # the graph bucket a decode step replayed; None: eager
    start_s: float                   # on the engine's clock
    end_s: float                     # after the device finished the step and its sampling

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class EngineStats:
    num_steps: int
    num_graph_steps: int
    prefill_tokens: int
    decode_tokens: int
    padded_rows: int
    prefix_hit_tokens: int
    preemptions: int

    @property
    def prefix_hit_rate(self) -> float:
        """Of the prompt tokens admitted (recomputes included), the share served from the
        prefix cache instead of computed."""
        total = self.prefix_hit_tokens + self.prefill_tokens
        return self.prefix_hit_tokens / total if total else 0.0


@dataclass
class _Live:
    index: int
    request: Request
    params: SamplingParams
    generator: torch.Generator | None
    arrival_s: float
    token_times_s: list[float] = field(default_factory=list)


class LLM:
    """``model``: a checkpoint folder (config.json + safetensors), a ModelConfig (random
    weights from ``seed``) or a LlamaModel. The KV cache holds ``num_blocks`` blocks of
    ``block_size`` tokens, or as many as ``kv_cache_memory`` bytes hold (default: every running
    request at full length; on a GPU at most half the free memory). A step computes at most
    ``max_num_batched_tokens`` tokens of at most ``max_num_seqs`` requests. ``backend``: "auto"
    or a name of ``labkit.attention.BACKENDS``; ``enforce_eager`` turns CUDA Graphs off.
    """

    def __init__(self, model: str | Path | ModelConfig | LlamaModel, *,
                 num_blocks: int | None = None, kv_cache_memory: int | None = None,
                 block_size: int = 16, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 64, max_model_len: int | None = None,
                 enforce_eager: bool = False, backend: str = "auto",
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 device: str | torch.device = "auto", dtype: torch.dtype | None = None,
                 seed: int = 0, tokenizer: Any = None):
        self.device = select_device(device)
        if isinstance(model, LlamaModel):
            self.model = model
        elif isinstance(model, ModelConfig):
            self.model = random_model(model, seed=seed, device=self.device, dtype=dtype)
        elif isinstance(model, (str, Path)):
            self.model = load_model(model, device=self.device, dtype=dtype)
        else:
            raise TypeError(f"model must be a checkpoint folder, a ModelConfig or a LlamaModel, "
                            f"got {type(model).__name__}")
        self.model.eval()
        self.device = self.model.embed_tokens.device  # a LlamaModel given stays where it is
        self.config = self.model.config
        self.tokenizer = tokenizer
        self.runner = ModelRunner(
            self.model, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
            block_size=block_size, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            backend=backend, enforce_eager=enforce_eager)
        self.block_manager = BlockManager(self.runner.num_blocks, block_size,
                                          enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=self.runner.max_model_len,
            enable_chunked_prefill=enable_chunked_prefill,
            decode_buckets=self.runner.decode_buckets, vocab_size=self.config.vocab_size),
            self.block_manager)
        self.step_history: list[StepRecord] = []
        self._seeds = random.Random(seed)  # per-request seeds where SamplingParams has none
        self._next_id = 0
        self._clock0 = time.perf_counter()

    @property
    def backend(self) -> str:
        return self.runner.backend.name

    @property
    def selection_log(self) -> list[str]:
        return list(self.runner.selection_log)

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # a step has ended when the device is done
        return time.perf_counter() - self._clock0

    # ------------------------------------------------------------------ generate
    def generate(self, prompts: Sequence[Sequence[int] | str],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """One output per prompt, in order. A request that cannot be served gets
        ``finish_reason="error"`` and its ``error``; the rest of the batch goes on."""
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], int)):
            raise TypeError("generate() takes a list of prompts (each a list of token ids, or a "
                            "string with a tokenizer); wrap a single prompt in a list")
        params = self._params_for(len(prompts), sampling_params)
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        live: dict[int, _Live] = {}
        arrival = self._now()
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids, error = self._token_ids(i, prompt)
            req = None
            if error is None:
                req = self.scheduler.add_request(self._next_id, ids, max_tokens=p.max_tokens,
                                                 eos_token_ids=p.stop_token_ids)
                self._next_id += 1
                error = req.error
            if error is not None:
                outputs[i] = RequestOutput(i, list(ids or []), [], "error", error)
                continue
            seed = p.seed if p.seed is not None else self._seeds.getrandbits(63)
            generator = None if p.greedy else request_generator(seed, self.device)
            live[req.request_id] = _Live(i, req, p, generator, arrival)
        while self.scheduler.has_unfinished_requests():
            self._step(live)
        for entry in live.values():
            outputs[entry.index] = self._output(entry)
        return outputs

    def _params_for(self, n: int, sampling_params) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"sampling_params must be one SamplingParams or a list of {n} (one "
                             f"per prompt), got {len(params)} items")
        return params

    def _token_ids(self, i: int, prompt) -> tuple[list[int] | None, str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                return None, (f"prompt {i} is text but this LLM has no tokenizer: pass "
                              "LLM(..., tokenizer=...) or give token ids")
            return list(self.tokenizer.encode(prompt)), None
        if hasattr(prompt, "tolist"):
            prompt = prompt.tolist()
        try:
            return list(prompt), None
        except TypeError:
            return None, (f"prompt {i} is a {type(prompt).__name__}; give a list of token ids "
                          "or a string")

    def _step(self, live: dict[int, _Live]) -> None:
        step: ScheduledStep = self.scheduler.schedule()
        if not step.rows:
            raise RuntimeError(f"step {step.step_id} scheduled nothing while requests wait: "
                               f"{len(self.scheduler.waiting)} waiting, "
                               f"{len(self.scheduler.running)} running (a scheduler bug)")
        start = self._now()
        out = self.runner.execute(step, self.block_manager)
        rows = [live[r.request_id] for r in step.rows if r.needs_logits]
        tokens = sample(out.logits, [e.params for e in rows], [e.generator for e in rows])
        sampled = tokens.tolist()
        end = self._now()
        self.scheduler.update(step, sampled)
        for entry in rows:
            entry.token_times_s.append(end - entry.arrival_s)
        self.step_history.append(StepRecord(step.stats, out.graph_batch, start, end))

    def _output(self, entry: _Live) -> RequestOutput:
        req, times = entry.request, entry.token_times_s
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        text = None
        if self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids)
        return RequestOutput(entry.index, list(req.prompt_token_ids), list(req.output_token_ids),
                             FINISH_REASONS[req.status], req.error,
                             times[0] if times else None, tpot, list(times),
                             req.num_cached_tokens, req.num_preemptions, text)

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
            preemptions=sum(s.num_preempted for s in h))

    def history_table(self):
        """One row per step: the scheduler's statistics, graph or eager, and its time."""
        import pandas as pd

        return pd.DataFrame([{**asdict(r.stats), "graph_batch": r.graph_batch,
                              "start_ms": r.start_s * 1e3, "duration_ms": r.duration_s * 1e3}
                             for r in self.step_history])
