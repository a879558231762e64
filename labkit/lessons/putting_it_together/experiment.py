"""The controlled experiment: one model, one workload, every attention backend x eager / graph.

Forcing a backend, or turning graphs off, is a claim that it is faster (or needed) here. The
claim is checked by changing ONE thing at a time: the same weights, the same token-id prompts
and output lengths (greedy, no stop tokens, prefix caching off, so every run does the same
work), one row per (backend, mode). Each row reports what the choice costs once (building the
engine, graph capture included; the cold first run's time above the steady runs: kernel JIT,
warm-up) and in steady state (decode step time, TPOT, throughput, graph memory, padded rows),
each the median over rounds that run every row in a fresh shuffled order, with its range. A
row that cannot run here stays in the table with the reason: a refusal is a result too; a row
whose first tokens are not the model's (:mod:`~labkit.lessons.putting_it_together.first_token`)
has not passed, and no conclusion uses it.

The timeline of a few steps and the padding study are in
:mod:`labkit.lessons.putting_it_together.engine_steps`; :func:`record` measures all three on a
GPU. The requests are a :class:`~labkit.lessons.putting_it_together.workload.Workload`.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import torch

from labkit import check_positive_int
from labkit.attention import BACKENDS, PRIORITY, BackendUnavailable
from labkit.device import free_memory, select_device, synchronize
from labkit.engine import LLM, LlamaModel, ModelConfig, random_model
from labkit.lessons.putting_it_together.first_token import (
    first_token_check,
    first_token_truth,
)
from labkit.lessons.putting_it_together.peers import graph_limit, slow_here
from labkit.lessons.putting_it_together.workload import Workload, engine_options
from labkit.tools.recorded import json_columns

MODES = ("eager", "graph")
# A graph row replays full decode graphs and nothing else, so a backend that cannot be captured
# whole is refused there, not served piecewise under the same label (notebook 08's
# cudagraph_mode section compares the modes).
GRAPH_ROWS = "full_decode_only"
COLUMNS = ["backend", "mode", "status", "passed", "chosen", "reason", "rounds", "build_s",
           "capture_ms", "capture_low_ms", "capture_high_ms", "graphs", "first_run_s",
           "steady_run_s", "steady_low_s", "steady_high_s", "warmup_s", "decode_step_ms",
           "decode_step_low_ms", "decode_step_high_ms", "tpot_ms", "ttft_ms", "output_tok_s",
           "steps", "graph_steps", "padded_rows", "pool_padded_rows", "graph_MiB", "engine_MiB",
           "kv_cache_MiB", "warm_start", "same_first_token", "first_token_ok",
           "first_token_ties"]
# Columns that count (rounds, graphs, steps, rows, near-ties): integers, <NA> where a row did not
# run, never 45.0 (a NaN beside a count makes a float column of it).
COUNTS = ("rounds", "graphs", "steps", "graph_steps", "padded_rows", "pool_padded_rows",
          "first_token_ties")
# What one round of a row measures; the table shows each one's median over the rounds.
ROUND_COLUMNS = ["build_s", "capture_ms", "first_run_s", "steady_run_s", "decode_step_ms",
                 "tpot_ms", "ttft_ms", "output_tok_s"]
# Quantities whose range over the rounds the table keeps beside the median.
RANGED = {"capture_ms": ("capture_low_ms", "capture_high_ms"),
          "steady_run_s": ("steady_low_s", "steady_high_s"),
          "decode_step_ms": ("decode_step_low_ms", "decode_step_high_ms")}


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


def _release(dev: torch.device) -> None:
    """Hand a finished row's memory back before the next row builds (on a GPU: its KV cache and
    graphs). A CPU has no cache to empty, and the collection it costs, per row and round, is
    slower than the row."""
    if dev.type == "cuda":
        free_memory(dev)


def with_counts(table: pd.DataFrame) -> pd.DataFrame:
    """``table`` with its :data:`COUNTS` columns as integers (Int64: <NA> where a row did not
    run). A count that is not whole raises: it would be a bug, not a count."""
    return table.astype({c: "Int64" for c in COUNTS if c in table})


def warmup_s(first_s: float, steady_s) -> float:
    """What the first run paid beyond steady state: its time above the slowest steady run.

    Compilation, loading and first-touch allocation only add time, so a first run inside the
    steady runs' range paid nothing that can be told from noise: 0, not the negative
    difference a subtraction from their median gives (a row warmed up by an earlier one)."""
    return max(0.0, first_s - max(steady_s))


def run_one(model: LlamaModel, workload: Workload, backend: str, mode: str,
            skip: dict[str, str] | None = None, repeats: int = 1
            ) -> tuple[dict, list[str], list | None]:
    """One round of one row: build the engine (graph capture included), a first run, then
    ``repeats`` steady runs. Returns the row (steady figures from the median steady run,
    ``steady_runs_s`` all of them), its selection log and the tokens (None if it did not run).

    The row's ``status``: "ran"; "refused" (the backend's declaration rules it out: the engine
    raised ``BackendUnavailable``; for a graph row the reason names whose limit it is, from
    :func:`~labkit.lessons.putting_it_together.peers.graph_limit`, instead of running eagerly
    in silence); "cannot run" (the mode needs what the device lacks: CUDA Graphs need CUDA);
    "skipped" (in ``skip``: too slow here); "failed" (it started and raised; the error is the
    reason)."""
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
    _release(dev)
    mem0 = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
    t0 = time.perf_counter()
    try:
        llm = LLM(model, backend=backend, enforce_eager=mode == "eager",
                  cudagraph_mode=GRAPH_ROWS if mode == "graph" else None,
                  **engine_options(workload))
    except BackendUnavailable as e:
        why = "; ".join(e.reasons.get(backend, [])) or str(e).splitlines()[0]
        limit = graph_limit(backend) if mode == "graph" else None
        if limit and "limit of" not in why:  # the declaration says whose limit, and why
            why = f"{why}; limit of {limit}"
        elif limit:
            why = f"{why}: {limit.split(': ', 1)[1]}"
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
        _release(dev)
        return row | {"status": "failed", "reason": f"{type(e).__name__}: {e}"[:300]}, [], None
    run = runs[len(runs) // 2]
    n_out = sum(len(o.token_ids) for o in run.outputs)
    row.update(status="ran", first_run_s=first.seconds, steady_run_s=run.seconds,
               steady_runs_s=[r.seconds for r in runs],
               decode_step_ms=run.decode_step_ms,
               tpot_ms=_median_ms([o.tpot_s for o in run.outputs]),
               ttft_ms=_median_ms([o.ttft_s for o in run.outputs]),
               output_tok_s=n_out / run.seconds, steps=len(run.steps),
               graph_steps=sum(s.graph_batch is not None for s in run.steps),
               padded_rows=sum(s.stats.padded_rows for s in run.steps),
               pool_padded_rows=run.pool_padded_rows)
    log = llm.selection_log
    del llm
    _release(dev)
    return row, log, [o.token_ids for o in run.outputs]


@dataclass
class Experiment:
    table: pd.DataFrame                               # one row per (backend, mode), COLUMNS
    selection_logs: dict[str, list[str]] = field(default_factory=dict)  # "backend/mode" -> log
    model: dict = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    rounds: pd.DataFrame = field(default_factory=pd.DataFrame)  # one row per row and round
    first_token_tie_max: float = 0.0                  # the largest tie tolerance of a prompt

    def to_dict(self) -> dict:
        return {"table": json_columns(self.table), "selection_logs": self.selection_logs,
                "model": self.model, "workload": self.workload,
                "rounds": json_columns(self.rounds),
                "first_token_tie_max": self.first_token_tie_max}

    @classmethod
    def from_dict(cls, d: dict) -> Experiment:
        table = with_counts(pd.DataFrame(d["table"]).reindex(columns=COLUMNS))
        if "rounds" not in d:  # one round: no steady range to take a warm-up against
            table["warmup_s"] = float("nan")
        return cls(table, d["selection_logs"],
                   d["model"], d["workload"], pd.DataFrame(d.get("rounds", {})),
                   d.get("first_token_tie_max", 0.0))

    @property
    def conclusive(self) -> pd.DataFrame:
        """The rows conclusions may be drawn from: they ran and passed the first-token check."""
        t = self.table
        return t[(t.status == "ran") & t.passed.eq(True)]  # NaN: not run


def _combine(rounds: list[dict]) -> dict:
    """One row from its rounds: medians, the ranges of RANGED, the cold first run's warm-up."""
    first = rounds[0]
    bad = next((r for r in rounds if r["status"] != "ran"), None)
    if bad is not None:  # a row that failed in any round failed
        return bad | {"rounds": len(rounds)}
    row = dict(first)
    for col in ROUND_COLUMNS:
        row[col] = statistics.median(r[col] for r in rounds)
    for col, (lo, hi) in RANGED.items():
        row[lo], row[hi] = min(r[col] for r in rounds), max(r[col] for r in rounds)
    steady = [s for r in rounds for s in r["steady_runs_s"]]
    # The first round's first run is the cold one: later rounds find every kernel compiled.
    row.update(rounds=len(rounds), first_run_s=first["first_run_s"],
               warmup_s=warmup_s(first["first_run_s"], steady))
    row.pop("steady_runs_s")
    return row


def run_experiment(model: ModelConfig | LlamaModel, workload: Workload, *,
                   backends=None, modes=MODES, skip: dict[str, str] | None = None,
                   device="auto", dtype: torch.dtype | None = None, seed: int = 0,
                   rounds: int = 3, repeats: int = 1) -> Experiment:
    """Every backend (``PRIORITY`` order, then "auto") x ``modes`` on one model and workload,
    in ``rounds`` rounds, each running every row in a fresh shuffled order (``seed``), each row
    a fresh engine, a first run and ``repeats`` steady runs: drift of the machine lands on
    every row alike, and each row reports its median with its range over the rounds.

    ``skip``: backends not to run, each with the reason shown in its row. One throwaway
    request through the reference backend first warms up what every row shares (allocator,
    BLAS handles). Compiled kernels stay cached for the process, so a row whose backend ran
    before its first round (the reference included) has ``warm_start``. A row that does not
    refuse in its first round refuses in none: later rounds run only rows that ran.
    """
    if isinstance(model, ModelConfig):
        model = random_model(model, seed=seed, device=select_device(device), dtype=dtype)
    backends = list(backends) if backends is not None else [*PRIORITY, "auto"]
    unknown = [b for b in backends if b != "auto" and b not in BACKENDS]
    if unknown:
        raise ValueError(f"unknown backends {unknown}; known: {['auto', *BACKENDS]}")
    check_positive_int("repeats", repeats, hint="steady runs after the first, per round")
    check_positive_int("rounds", rounds, hint="shuffled passes over every row")
    warmup = Workload(num_requests=1, prompt_len=(4, 4), output_len=(2, 2))
    LLM(model, backend="reference", enforce_eager=True,
        **engine_options(warmup)).generate(*warmup.requests(model.config.vocab_size))
    cells = [(b, m) for b in backends for m in modes]
    per: dict[tuple, list[dict]] = {c: [] for c in cells}
    logs, outputs, ran, order_rows = {}, {}, {"reference"}, []
    rng = random.Random(seed)
    for r in range(rounds):
        for position, cell in enumerate(rng.sample(cells, len(cells))):
            if r and per[cell][0]["status"] != "ran":
                continue
            row, log, outs = run_one(model, workload, *cell, skip, repeats)
            if row["status"] == "ran" and r == 0:
                row["warm_start"] = row["chosen"] in ran
                ran.add(row["chosen"])
            per[cell].append(row)
            if r == 0:
                logs[f"{cell[0]}/{cell[1]}"] = log
            if outs is not None:
                outputs.setdefault(cell, outs)
            if row["status"] == "ran":
                order_rows.append({"round": r, "position": position, "backend": cell[0],
                                   "mode": cell[1], **{c: row[c] for c in ROUND_COLUMNS}})
    rows = [_combine(per[c]) for c in cells]
    prompts = workload.requests(model.config.vocab_size)[0]
    truth = first_token_truth(model, prompts) if outputs else []
    base = next((c for c in outputs if per[c][0]["chosen"] == "reference"),
                next(iter(outputs), None))
    for row, cell in zip(rows, cells):
        if cell in outputs and row["status"] == "ran":
            outs = outputs[cell]
            row["same_first_token"] = float(np.mean([a[:1] == b[:1]
                                                     for a, b in zip(outs, outputs[base])]))
            row["first_token_ok"], row["first_token_ties"] = first_token_check(outs, truth)
            row["passed"] = row["first_token_ok"] == 1.0
    table = with_counts(pd.DataFrame(rows, columns=COLUMNS))
    return Experiment(table, logs, asdict(model.config), asdict(workload),
                      pd.DataFrame(order_rows), max((t["tie"] for t in truth), default=0.0))


SHOWN = {"rounds": 0, "build_s": 3, "warmup_s": 3, "tpot_ms": 3, "output_tok_s": 0, "steps": 0,
         "graph_steps": 0, "padded_rows": 0, "graph_MiB": 1, "engine_MiB": 1,
         "first_token_ok": 2, "first_token_ties": 0}


def _ranged(table: pd.DataFrame, col: str, digits: int) -> pd.Series:
    """'median (low-high)' of a ranged column; a recording without ranges shows the median."""
    lo, hi = RANGED[col]
    med = pd.to_numeric(table[col], errors="coerce")
    low, high = (pd.to_numeric(table[c], errors="coerce") for c in (lo, hi))
    return pd.Series([("" if pd.isna(m) else f"{m:.{digits}f}" if pd.isna(a) else
                       f"{m:.{digits}f} ({a:.{digits}f}-{b:.{digits}f})")
                      for m, a, b in zip(med, low, high)], index=table.index)


def compact(table: pd.DataFrame) -> pd.DataFrame:
    """The experiment's table with the columns a reader compares first, rounded; the decode
    step and the capture time as their median with the range over the rounds."""
    out = table[["backend", "mode", "status", "passed", "chosen", *SHOWN, "reason"]].copy()
    for col, digits in SHOWN.items():
        out[col] = pd.to_numeric(out[col], errors="coerce").round(digits)
    out = with_counts(out)  # a table built elsewhere (a test, an old recording) shows counts too
    out.insert(5, "decode_step_ms (range)", _ranged(table, "decode_step_ms", 2))
    out.insert(6, "capture_ms (range)", _ranged(table, "capture_ms", 1))
    return out


def experiment_figure(table: pd.DataFrame, title: str):
    """What a choice costs once (build + first run's extra time) beside what it costs per
    decode step (median, error bars the range over the rounds); rows that did not run keep
    their place, labelled with their status, and rows that failed the first-token check say so."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    label = table.backend + " / " + table["mode"]
    ran = table.status == "ran"
    num = {c: pd.to_numeric(table[c], errors="coerce") for c in
           ("build_s", "warmup_s", "decode_step_ms", "decode_step_low_ms", "decode_step_high_ms")}
    once = (num["build_s"] + num["warmup_s"].fillna(0)).where(ran, 0)
    step = num["decode_step_ms"].where(ran, 0)
    bars = {"type": "data", "symmetric": False,
                "array": (num["decode_step_high_ms"] - num["decode_step_ms"]).fillna(0),
                "arrayminus": (num["decode_step_ms"] - num["decode_step_low_ms"]).fillna(0)}
    text = table.status.where(~ran, "").where(~ran | ~table.passed.eq(False),
                                              "did not pass")
    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "once: build (capture incl.) + first run's extra (s)",
        "steady: decode step (ms), range over rounds"))
    fig.add_trace(go.Bar(x=label, y=once, text=text, name="once"), 1, 1)
    fig.add_trace(go.Bar(x=label, y=step, text=text, name="per step", error_y=bars), 1, 2)
    fig.update_layout(title=title, showlegend=False, height=420)
    return fig


def record(model: ModelConfig | None = None, workload: Workload | None = None, *,
           skip: dict[str, str] | None = None, rounds: int = 3, repeats: int = 1,
           device="auto", **steps) -> dict:
    """`make record`: the experiment on ``ModelConfig.bench_1b`` (~1B parameters) in bf16 (the
    tiny model on CPU) in ``rounds`` shuffled rounds, then
    :func:`labkit.lessons.putting_it_together.engine_steps.record_steps` (``**steps``: its
    sizes) on the same weights."""
    from labkit.lessons.putting_it_together.engine_steps import record_steps

    dev = select_device(device)
    config = model or (ModelConfig.bench_1b() if dev.type == "cuda" else ModelConfig.tiny())
    if skip is None and dev.type == "cuda":
        skip = slow_here(dev)
    t0 = time.perf_counter()
    weights = random_model(config, device=dev)
    out = run_experiment(weights, workload or Workload(), skip=skip, rounds=rounds,
                         repeats=repeats).to_dict()
    out["seconds"] = {"experiment": time.perf_counter() - t0}
    more = record_steps(weights, **steps)
    out["seconds"].update(more.pop("seconds"))
    return out | more
