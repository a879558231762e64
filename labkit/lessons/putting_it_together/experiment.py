"""The controlled experiment: one model, one workload, every attention backend x eager / graph.

Forcing a backend, or turning graphs off, is a claim that it is faster (or needed) here. The
claim is checked by changing ONE thing at a time: the same weights, the same token-id prompts
and output lengths (greedy, no stop tokens, prefix caching off, so every run does the same
work), one row per (backend, mode). Each row reports what the choice costs once (building the
engine, graph capture included; the first run's extra time over a repeat: kernel JIT, warm-up)
and in steady state (decode step time, TPOT, throughput, graph memory, padded rows). A row that
cannot run here stays in the table with the reason: a refusal is a result too.

The timeline of a few steps and the padding study are in
:mod:`labkit.lessons.putting_it_together.engine_steps`; :func:`record` measures all three on a
GPU. The requests are a :class:`~labkit.lessons.putting_it_together.workload.Workload`.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import torch

from labkit import check_positive_int
from labkit.attention import BACKENDS, CPU_SLOW, PRIORITY, BackendUnavailable
from labkit.device import free_memory, select_device, synchronize
from labkit.engine import LLM, LlamaModel, ModelConfig, random_model
from labkit.lessons.putting_it_together.workload import Workload, engine_options
from labkit.tools.recorded import json_columns

MODES = ("eager", "graph")
COLUMNS = ["backend", "mode", "status", "chosen", "reason", "build_s", "capture_ms", "graphs",
           "first_run_s", "steady_run_s", "warmup_s", "decode_step_ms", "tpot_ms", "ttft_ms",
           "output_tok_s", "steps", "graph_steps", "padded_rows", "pool_padded_rows",
           "graph_MiB", "engine_MiB", "kv_cache_MiB", "warm_start", "same_first_token"]


# Why the GPU recording skips flex: timed, its row would measure recompiles and the fallback.
FLEX_IN_THE_ENGINE = (
    "not timed: flex_attention is compiled for fixed shapes, every engine step brings a new KV "
    "length, so Dynamo recompiles until its limit of 8 and then runs the unfused fallback, "
    "minutes for this workload on a GPU; it suits fixed-shape work, not this engine")


def slow_here(device: torch.device) -> dict[str, str]:
    """Backends that would run here but slowly (on CPU: interpreted or uncompiled; on a GPU
    flex, recompiled for every new KV length), with why."""
    if device.type != "cpu":
        return {"flex": FLEX_IN_THE_ENGINE}
    return {name: f"not run, to keep this run short: {why.split(';')[0]}"
            for name, why in CPU_SLOW.items()}


@dataclass(frozen=True)
class Run:
    outputs: list            # RequestOutput per request
    seconds: float           # wall time of the whole generate()
    steps: list              # the StepRecords of this run
    pool_padded_rows: int    # rows the graph pool padded during this run

    @property
    def decode_step_ms(self) -> float:
        """Median time between the ends of consecutive steps, at decode-only steps: the rate
        at which steps complete, also where async scheduling overlaps one with the next."""
        gaps = [b.end_s - a.end_s for a, b in zip(self.steps, self.steps[1:])
                if b.stats.num_prefill_tokens == 0]
        return _median_ms(gaps)


def timed_generate(llm: LLM, prompts, params) -> Run:
    graphs = llm.runner.graphs
    first, padded0 = len(llm.step_history), graphs.stats.padded_rows if graphs else 0
    synchronize(llm.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    synchronize(llm.device)
    return Run(outs, time.perf_counter() - t0, llm.step_history[first:],
               graphs.stats.padded_rows - padded0 if graphs else 0)


def _median_ms(xs) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) * 1e3 if xs else float("nan")


def run_one(model: LlamaModel, workload: Workload, backend: str, mode: str,
            skip: dict[str, str] | None = None, repeats: int = 3
            ) -> tuple[dict, list[str], list | None]:
    """One row, its selection log and its steady run's tokens (None if it did not run). The
    steady figures are from the repeat (of ``repeats``) with the median wall time."""
    dev = model.embed_tokens.device
    row = dict.fromkeys(COLUMNS, float("nan")) | {"backend": backend, "mode": mode,
                                                  "chosen": "", "reason": ""}
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "graph" and dev.type != "cuda":
        return row | {"status": "cannot run", "reason": "CUDA Graphs need a CUDA device: here "
                      "every step runs eagerly, so this row would repeat the eager one"}, [], None
    if backend in (skip or {}):
        return row | {"status": "skipped", "reason": skip[backend]}, [], None
    prompts, params = workload.requests(model.config.vocab_size)
    free_memory(dev)
    mem0 = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
    t0 = time.perf_counter()
    try:
        llm = LLM(model, backend=backend, enforce_eager=mode == "eager",
                  **engine_options(workload))
    except BackendUnavailable as e:
        why = "; ".join(e.reasons.get(backend, [])) or str(e).splitlines()[0]
        return row | {"status": "refused", "reason": why}, [], None
    synchronize(dev)
    row["build_s"] = time.perf_counter() - t0
    graphs = llm.runner.graphs
    if dev.type == "cuda":
        row["engine_MiB"] = (torch.cuda.memory_reserved(dev) - mem0) / 2**20
    row.update(chosen=llm.backend, kv_cache_MiB=llm.runner.cache.nbytes / 2**20,
               capture_ms=graphs.stats.capture_ms if graphs else 0.0,
               graphs=len(graphs.stats.buckets) if graphs else 0,
               graph_MiB=graphs.stats.captured_bytes / 2**20 if graphs else 0.0)
    try:
        first = timed_generate(llm, prompts, params)
        runs = sorted((timed_generate(llm, prompts, params) for _ in range(repeats)),
                      key=lambda r: r.seconds)
    except Exception as e:  # noqa: BLE001 (a backend that breaks mid-run is a result too)
        del llm
        free_memory(dev)
        return row | {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:300]}, [], None
    run = runs[len(runs) // 2]
    n_out = sum(len(o.token_ids) for o in run.outputs)
    row.update(status="ran", first_run_s=first.seconds,
               steady_run_s=run.seconds, warmup_s=first.seconds - run.seconds,
               decode_step_ms=run.decode_step_ms,
               tpot_ms=_median_ms([o.tpot_s for o in run.outputs]),
               ttft_ms=_median_ms([o.ttft_s for o in run.outputs]),
               output_tok_s=n_out / run.seconds, steps=len(run.steps),
               graph_steps=sum(s.graph_batch is not None for s in run.steps),
               padded_rows=sum(s.stats.padded_rows for s in run.steps),
               pool_padded_rows=run.pool_padded_rows)
    log = llm.selection_log
    del llm
    free_memory(dev)
    return row, log, [o.token_ids for o in run.outputs]


@dataclass
class Experiment:
    table: pd.DataFrame                               # one row per (backend, mode), COLUMNS
    selection_logs: dict[str, list[str]] = field(default_factory=dict)  # "backend/mode" -> log
    model: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"table": json_columns(self.table), "selection_logs": self.selection_logs,
                "model": self.model, "workload": self.workload}

    @classmethod
    def from_dict(cls, d: dict) -> "Experiment":
        return cls(pd.DataFrame(d["table"], columns=COLUMNS), d["selection_logs"], d["model"],
                   d["workload"])


def run_experiment(model: ModelConfig | LlamaModel, workload: Workload, *,
                   backends=None, modes=MODES, skip: dict[str, str] | None = None,
                   device="auto", dtype: torch.dtype | None = None, seed: int = 0,
                   repeats: int = 3) -> Experiment:
    """Every backend (``PRIORITY`` order, then "auto") x ``modes`` on one model and workload.

    ``skip``: backends not to run, each with the reason shown in its row. One throwaway
    request first warms up what every row shares (allocator, BLAS handles). Compiled kernels
    stay cached for the process, so a row whose backend already ran has ``warm_start``.
    """
    if isinstance(model, ModelConfig):
        model = random_model(model, seed=seed, device=select_device(device), dtype=dtype)
    backends = list(backends) if backends is not None else [*PRIORITY, "auto"]
    unknown = [b for b in backends if b != "auto" and b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backends {unknown}; known: {['auto', *BACKENDS]}")
    check_positive_int("repeats", repeats, hint="steady runs after the first")
    warmup = Workload(num_requests=1, prompt_len=(4, 4), output_len=(2, 2))
    LLM(model, backend="reference", enforce_eager=True,
        **engine_options(warmup)).generate(*warmup.requests(model.config.vocab_size))
    rows, logs, outputs, ran = [], {}, {}, set()
    for backend in backends:
        for mode in modes:
            row, log, outs = run_one(model, workload, backend, mode, skip, repeats)
            if row["status"] == "ran":
                row["warm_start"] = row["chosen"] in ran
                ran.add(row["chosen"])
            rows.append(row)
            logs[f"{backend}/{mode}"] = log
            if outs is not None:
                outputs[len(rows) - 1] = outs
    base = next((i for i in outputs if rows[i]["chosen"] == "reference"), next(iter(outputs), 0))
    for i, outs in outputs.items():
        rows[i]["same_first_token"] = float(np.mean([a[:1] == b[:1]
                                                     for a, b in zip(outs, outputs[base])]))
    return Experiment(pd.DataFrame(rows, columns=COLUMNS), logs, asdict(model.config),
                      asdict(workload))


SHOWN = {"build_s": 3, "capture_ms": 1, "warmup_s": 3, "decode_step_ms": 3, "tpot_ms": 3,
         "output_tok_s": 0, "steps": 0, "graph_steps": 0, "padded_rows": 0, "graph_MiB": 1,
         "engine_MiB": 1, "same_first_token": 2}


def compact(table: pd.DataFrame) -> pd.DataFrame:
    """The experiment's table with the columns a reader compares first, rounded."""
    out = table[["backend", "mode", "status", "chosen", *SHOWN, "reason"]].copy()
    for col, digits in SHOWN.items():
        out[col] = pd.to_numeric(out[col], errors="coerce").round(digits)
    return out


def experiment_figure(table: pd.DataFrame, title: str):
    """What a choice costs once (build + first run's extra time) beside what it costs per
    decode step; rows that did not run keep their place, labelled with their status."""
    from plotly.subplots import make_subplots
    import plotly.graph_objects as go

    label = table.backend + " / " + table["mode"]
    ran = table.status == "ran"
    once = (pd.to_numeric(table.build_s, errors="coerce")
            + pd.to_numeric(table.warmup_s, errors="coerce").clip(lower=0)).where(ran, 0)
    step = pd.to_numeric(table.decode_step_ms, errors="coerce").where(ran, 0)
    text = table.status.where(~ran, "")
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "once: build (capture incl.) + first run's extra (s)", "steady: decode step (ms)"))
    fig.add_trace(go.Bar(x=label, y=once, text=text, name="once"), 1, 1)
    fig.add_trace(go.Bar(x=label, y=step, text=text, name="per step"), 1, 2)
    fig.update_layout(title=title, showlegend=False, height=420)
    return fig


def record(model: ModelConfig | None = None, workload: Workload | None = None, *,
           skip: dict[str, str] | None = None, repeats: int = 3, device="auto", **steps) -> dict:
    """`make record`: the experiment on ``ModelConfig.bench_1b`` (~1B parameters) in bf16 (the
    tiny model on CPU), then :func:`labkit.lessons.putting_it_together.engine_steps.record_steps`
    (``**steps``: its sizes) on the same weights."""
    from labkit.lessons.putting_it_together.engine_steps import record_steps

    dev = select_device(device)
    config = model or (ModelConfig.bench_1b() if dev.type == "cuda" else ModelConfig.tiny())
    if skip is None and dev.type == "cuda":
        skip = slow_here(dev)
    t0 = time.perf_counter()
    weights = random_model(config, device=dev)
    out = run_experiment(weights, workload or Workload(), skip=skip, repeats=repeats).to_dict()
    out["seconds"] = {"experiment": time.perf_counter() - t0}
    more = record_steps(weights, **steps)
    out["seconds"].update(more.pop("seconds"))
    return out | more
