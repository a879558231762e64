"""The stall a long prompt causes to everyone already decoding, with and without chunked
prefill. Without chunking, the prompt is prefilled in one step, and every running request waits
for that whole step before its next token. Chunked prefill cuts the prompt into pieces that fit
a small token budget beside the decodes, so each step stays short (mixed steps: some prefill
tokens, some decode tokens), and the long prompt shares every step it needs.

Every function drives a real :class:`~labkit.engine.LLM` through ``add_request`` + ``step``;
``record_engine`` runs these and ``latency.latency_sweep`` at H200 sizes for
``forward.record``.
"""
from __future__ import annotations

import gc
import math
import random
import time
from dataclasses import dataclass
from typing import Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.engine import LLM, SamplingParams
from labkit.lessons.prefill_vs_decode.latency import latency_sweep, random_prompts, warm_up
from labkit.measure.bench import TritonCompiles
from labkit.tools.recorded import json_columns


@dataclass
class Interference:
    """One run: requests decoding, then a long prompt arrives."""
    chunked: bool
    budget: int                 # max_num_batched_tokens
    gaps: pd.DataFrame          # running requests: request, token, t_ms (since the long
    #                             prompt arrived), gap_ms (since that request's previous token)
    steps: pd.DataFrame         # llm.history_table() rows of this run
    long_ttft_ms: float
    triton_compiles: int | None = None  # during the timed run (None: not counted)
    # Async scheduling launches step N+1 before it reads step N's tokens, so a step's
    # launch-to-tokens span then covers its neighbour's launch too (a recording without the
    # flag ran the engine's CUDA default: async).
    async_scheduling: bool = True
    # One entry per interleaved round (``interference_pair(rounds=...)``): that round's
    # long_ttft_ms, worst_gap_ms and prefill_gap_ms; this run's gaps and steps are one of them.
    # None: a single run (an older recording).
    round_figures: list[dict] | None = None
    # The engine's cudagraph_mode (None: a recording from before the engine had modes, whose
    # only graphs were full decode graphs).
    cudagraph_mode: str | None = None

    def to_dict(self) -> dict:
        """Plain JSON: missing values (an eager step's graph_batch) as None, not NaN."""
        return {"chunked": self.chunked, "budget": self.budget, "long_ttft_ms": self.long_ttft_ms,
                "gaps": json_columns(self.gaps), "steps": json_columns(self.steps),
                "triton_compiles": self.triton_compiles,
                "async_scheduling": self.async_scheduling, "round_figures": self.round_figures,
                "cudagraph_mode": self.cudagraph_mode}

    @classmethod
    def from_dict(cls, d: dict) -> "Interference":
        return cls(d["chunked"], d["budget"], pd.DataFrame(d["gaps"]), pd.DataFrame(d["steps"]),
                   d["long_ttft_ms"], d.get("triton_compiles"), d.get("async_scheduling", True),
                   d.get("round_figures"), d.get("cudagraph_mode"))

    def per_round(self, name: str) -> list[float]:
        """``name`` (a key of ``figures()``) in each round, in round order; this run's own
        value when it ran once (or its recording kept no such figure per round)."""
        if self.round_figures and all(name in f for f in self.round_figures):
            return [math.nan if f[name] is None else float(f[name]) for f in self.round_figures]
        return [float(getattr(self, name))]

    def figures(self) -> dict:
        return {"long_ttft_ms": self.long_ttft_ms, "worst_gap_ms": self.worst_gap_ms,
                "prefill_gap_ms": self.prefill_gap_ms,
                "mixed_step_ms": None if math.isnan(self.mixed_step_ms) else self.mixed_step_ms}

    @property
    def label(self) -> str:
        mode = f", {self.cudagraph_mode}" if self.cudagraph_mode else ""
        return f"chunked prefill {'on' if self.chunked else 'off'} (budget {self.budget}{mode})"

    @property
    def mixed_step_ms(self) -> float:
        """Median time of the steps that mixed prompt tokens with decodes (NaN: none did)."""
        mixed = self.step_ms[self.mixed]
        return float(mixed.median()) if len(mixed) else math.nan

    @property
    def step_ms(self) -> pd.Series:
        """Each step's time. Synchronous engine: from its synchronised start to its tokens read.
        Async: the interval from the previous step's tokens to this one's (what a running
        request waits), which includes launching the next step."""
        if not self.async_scheduling:
            return self.steps.duration_ms
        ends = self.steps.start_ms + self.steps.duration_ms
        return ends.diff().fillna(self.steps.duration_ms)

    @property
    def step_time_label(self) -> str:
        return ("step ms (synchronised start to tokens)" if not self.async_scheduling else
                "ms since the previous step's tokens (async)")

    @property
    def mixed(self) -> pd.Series:
        """Steps that computed prompt tokens and decode tokens together."""
        return (self.steps.num_prefill_tokens > 0) & (self.steps.num_decode_tokens > 0)

    @property
    def decode_only(self) -> pd.Series:
        return (self.steps.num_prefill_tokens == 0) & (self.steps.num_decode_tokens > 0)

    @property
    def worst_gap_ms(self) -> float:
        """Longest wait between two tokens of a running request after the long prompt came."""
        return float(self.gaps[self.gaps.t_ms > 0].gap_ms.max())

    @property
    def prefill_gap_ms(self) -> float:
        """Median wait between tokens while the long prompt was being prefilled (up to its
        first token): the stall without chunking, the chunked steps with it."""
        window = self.gaps[(self.gaps.t_ms > 0) & (self.gaps.t_ms <= self.long_ttft_ms + 1.0)]
        return float(window.gap_ms.median())

    @property
    def steady_gap_ms(self) -> float:
        """Median wait between tokens before the long prompt came."""
        before = self.gaps[self.gaps.t_ms <= 0].gap_ms
        return float(before.median()) if len(before) else float("nan")


def _scenario(llm: LLM, num_running: int, running_prompt_len: int, running_tokens: int,
              long_prompt_len: int, arrive_after_steps: int, seed: int):
    """Run the scenario; returns (outputs, t0, t_long, running ids, long id)."""
    vocab = llm.config.vocab_size
    outputs = {}
    t0 = time.perf_counter()  # the running requests arrive now
    running = [llm.add_request(p, SamplingParams(max_tokens=running_tokens))
               for p in random_prompts(num_running, running_prompt_len, vocab, seed)]
    for _ in range(arrive_after_steps):
        outputs.update({o.request_id: o for o in llm.step()})
    t_long = time.perf_counter()
    long_id = llm.add_request(random_prompts(1, long_prompt_len, vocab, seed + 1)[0],
                              SamplingParams(max_tokens=2))
    while llm.has_unfinished_requests():
        outputs.update({o.request_id: o for o in llm.step()})
    errors = [o.error for o in outputs.values() if not o.ok]
    if errors:
        raise ValueError(f"a request was refused: {errors[0]}")
    return outputs, t0, t_long, running, long_id


def interference_run(llm: LLM, *, num_running: int = 4, running_prompt_len: int = 16,
                     running_tokens: int = 32, long_prompt_len: int = 512,
                     arrive_after_steps: int = 4, seed: int = 0,
                     rehearse: bool = True) -> Interference:
    """``num_running`` short requests start decoding; after ``arrive_after_steps`` steps a prompt
    of ``long_prompt_len`` tokens arrives; step until all finish. The same scenario runs once
    untimed first (other token ids), so the kernels of its step shapes are compiled before the
    timed run (``rehearse=False``: the engine has run this scenario already); ``triton_compiles``
    counts any compiles that still happen inside the timed run."""
    if arrive_after_steps >= running_tokens - 2:
        raise ValueError(f"arrive_after_steps={arrive_after_steps} leaves the running requests "
                         f"(running_tokens={running_tokens}) no tokens to show the stall on; "
                         "raise running_tokens or arrive earlier")
    if llm.has_unfinished_requests():
        raise RuntimeError("interference_run needs an idle engine: finish its requests first")
    sched = llm.scheduler.config
    shape = (num_running, running_prompt_len, running_tokens, long_prompt_len,
             arrive_after_steps)
    if rehearse:
        warm_up(llm)
        _scenario(llm, *shape, seed=seed + 1000)
    first_step = len(llm.step_history)
    with TritonCompiles() as compiles:
        outputs, t0, t_long, running, long_id = _scenario(llm, *shape, seed=seed)
    rows = []
    for rid in running:
        times = [(t0 + t - t_long) * 1e3 for t in outputs[rid].token_times_s]
        rows += [{"request": rid, "token": k + 2, "t_ms": t, "gap_ms": t - prev}
                 for k, (prev, t) in enumerate(zip(times, times[1:]))]
    steps = llm.history_table().iloc[first_step:].reset_index(drop=True)
    return Interference(sched.enable_chunked_prefill, sched.max_num_batched_tokens,
                        pd.DataFrame(rows), steps, outputs[long_id].ttft_s * 1e3,
                        compiles.count, llm.async_scheduling)


def summary_table(runs: Sequence[Interference]) -> pd.DataFrame:
    """One row per run: the running requests' gaps, the long prompt's TTFT and the steps. The
    counts (token budget, steps, compiles, mixed steps) are integer columns; a run that did not
    count its compiles shows <NA>."""
    table = pd.DataFrame([{
        "cudagraph_mode": r.cudagraph_mode or "full decode graphs",
        "chunked prefill": "on" if r.chunked else "off", "token budget": r.budget,
        "steady gap (ms)": r.steady_gap_ms, "gap during the prefill (ms)": r.prefill_gap_ms,
        "worst gap after arrival (ms)": r.worst_gap_ms,
        "long prompt TTFT (ms)": r.long_ttft_ms, "steps": len(r.steps),
        "Triton compiles in the run": r.triton_compiles, "mixed steps": int(r.mixed.sum()),
        "median mixed step (ms)": r.step_ms[r.mixed].median() if r.mixed.any() else math.nan,
        "median decode-only step (ms)": r.step_ms[r.decode_only].median(),
        "async scheduling": r.async_scheduling} for r in runs])
    return table.astype({"token budget": int, "steps": int, "mixed steps": int,
                         "Triton compiles in the run": "Int64"})


STEP_COUNTS = ("num_prefill_tokens", "num_decode_tokens", "num_running", "graph_batch")


def step_table(run: Interference) -> pd.DataFrame:
    """The run's steps as ``llm.history_table()`` gave them: each step's prompt and decode
    tokens, the requests running, the graph batch a replayed step used (<NA>: run eagerly) and
    its time (``Interference.step_ms``). The counts are integer columns."""
    counts = {c: run.steps[c].astype("Int64") for c in STEP_COUNTS if c in run.steps}
    return pd.DataFrame(counts).assign(step_ms=run.step_ms)


def gaps_figure(runs: Sequence[Interference], title: str) -> go.Figure:
    """Time between tokens of the running requests, over time since the long prompt came."""
    fig = go.Figure()
    for r in runs:
        g = r.gaps.groupby("token", as_index=False).agg(t_ms=("t_ms", "mean"),
                                                         gap_ms=("gap_ms", "max"))
        # "vh": the wait ending at a token is drawn over the interval it lasted
        fig.add_scatter(x=g.t_ms, y=g.gap_ms, mode="lines+markers", line_shape="vh",
                        name=r.label)
    fig.add_vline(x=0, line_dash="dash", annotation_text="long prompt arrives")
    fig.update_layout(title=title, height=420, xaxis_title="ms since the long prompt arrived",
                      yaxis_title="time since the previous token (ms, worst request)")
    return fig


def composition_figure(runs: Sequence[Interference], title: str) -> go.Figure:
    """Per step: prefill and decode tokens (stacked bars) and the step's time (line,
    ``Interference.step_ms``: synchronised when the engine ran without async scheduling)."""
    fig = make_subplots(rows=len(runs), cols=1, specs=[[{"secondary_y": True}]] * len(runs),
                        subplot_titles=[r.label for r in runs])
    top_ms = max(r.step_ms.max() for r in runs)  # one time scale for every run
    for i, r in enumerate(runs, start=1):
        s, first = r.steps, i == 1
        fig.add_bar(x=s.index, y=s.num_decode_tokens, name="decode tokens", row=i, col=1,
                    marker_color="#d62728", showlegend=first)
        fig.add_bar(x=s.index, y=s.num_prefill_tokens, name="prefill tokens", row=i, col=1,
                    marker_color="#1f77b4", showlegend=first)
        fig.add_scatter(x=s.index, y=r.step_ms, mode="lines+markers", name="step time",
                        line=dict(color="black"), row=i, col=1, secondary_y=True,
                        showlegend=first)
        fig.update_yaxes(title_text="tokens (log)", type="log", row=i, col=1, secondary_y=False)
        fig.update_yaxes(title_text=r.step_time_label, range=[0, 1.05 * top_ms], row=i, col=1,
                         secondary_y=True, tickmode="auto", showgrid=False)
    fig.update_xaxes(title_text="step of the run")
    return fig.update_layout(title=title, barmode="stack", height=300 * len(runs) + 120)


def interference_pair(model, *, num_running: int = 4, running_tokens: int = 32,
                      long_prompt: int = 512, chunk_budget: int = 64, arrive_after: int = 4,
                      kv_cache_memory: int | None = None, rounds: int = 1, seed: int = 0,
                      cudagraph_mode: str | None = None) -> list[Interference]:
    """``interference_run`` on two engines over ``model``: chunked prefill on with a budget of
    ``chunk_budget`` tokens, then off with a budget that holds the whole prompt beside the
    decodes. Both run without async scheduling, which would launch step N+1 before reading
    step N's tokens: synchronised, each step is timed from its start to its tokens.

    With ``rounds`` > 1 both engines stay built and the scenario runs once per round on each,
    the two in a shuffled order (``seed``), so a drift of the machine lands on both alike:
    each returned run keeps every round's figures (``round_figures``), and its own gaps and
    steps are those of the round with the median long-prompt TTFT. ``cudagraph_mode`` goes to
    both engines."""
    return interference_modes(model, modes=(cudagraph_mode,), num_running=num_running,
                              running_tokens=running_tokens, long_prompt=long_prompt,
                              chunk_budget=chunk_budget, arrive_after=arrive_after,
                              kv_cache_memory=kv_cache_memory, rounds=rounds, seed=seed)


def interference_modes(model, *, modes: Sequence[str | None], num_running: int = 4,
                       running_tokens: int = 32, long_prompt: int = 512, chunk_budget: int = 64,
                       arrive_after: int = 4, kv_cache_memory: int | None = None,
                       rounds: int = 1, seed: int = 0) -> list[Interference]:
    """``interference_pair`` once per ``cudagraph_mode`` of ``modes`` (None: the device's
    default), all in the same rounds: 2 x len(modes) engines, chunked then whole for each mode
    in order, every round running all of them in a fresh shuffled order. Each run records its
    engine's mode (``Interference.cudagraph_mode``)."""
    if not modes:
        raise ValueError("modes must name at least one cudagraph_mode (None: the default)")
    configs = [(chunked, budget, mode) for mode in modes
               for chunked, budget in ((True, chunk_budget), (False, long_prompt + num_running))]
    return interleaved_runs(model, configs, num_running=num_running,
                            running_tokens=running_tokens, long_prompt=long_prompt,
                            arrive_after=arrive_after, kv_cache_memory=kv_cache_memory,
                            rounds=rounds, seed=seed)


def interleaved_runs(model, configs: Sequence[tuple[bool, int, str | None]], *,
                     num_running: int, running_tokens: int, long_prompt: int,
                     arrive_after: int, kv_cache_memory: int | None = None, rounds: int = 1,
                     seed: int = 0) -> list[Interference]:
    """One ``interference_run`` per ``(chunked, token budget, cudagraph_mode)`` of ``configs``,
    each on its own engine over ``model``. ``rounds`` 1: one engine at a time, each built after
    the last is freed. More: every engine is built first, then every round runs all of them in
    a fresh shuffled order, and each config reports its median round by the long prompt's TTFT
    with every round's figures beside it (``Interference.round_figures``)."""
    if rounds != 1 and rounds < 3:
        raise ValueError(f"rounds must be 1 or at least 3 (a range needs three), got {rounds}")
    shape = dict(num_running=num_running, running_tokens=running_tokens,
                 long_prompt_len=long_prompt, arrive_after_steps=arrive_after)

    def engine(chunked: bool, budget: int, mode: str | None) -> LLM:
        gc.collect()  # free the previous engine (and its KV cache) before making the next
        return LLM(model, enable_prefix_caching=False, enable_chunked_prefill=chunked,
                   max_num_batched_tokens=budget, max_num_seqs=num_running + 1,
                   kv_cache_memory=kv_cache_memory, async_scheduling=False,
                   cudagraph_mode=mode)

    def run(llm: LLM, **kw) -> Interference:
        result = interference_run(llm, **shape, **kw)
        result.cudagraph_mode = llm.cudagraph_mode
        return result

    if rounds == 1:
        return [run(engine(*c)) for c in configs]
    engines = [engine(*c) for c in configs]
    rng, per = random.Random(seed), [[] for _ in configs]
    for r in range(rounds):
        for i in rng.sample(range(len(configs)), len(configs)):
            per[i].append(run(engines[i], rehearse=r == 0))
    runs = []
    for done in per:
        by_ttft = sorted(done, key=lambda run: run.long_ttft_ms)
        chosen = by_ttft[len(by_ttft) // 2]
        chosen.round_figures = [run.figures() for run in done]
        runs.append(chosen)
    del engines
    return runs


def record_engine(model, *, latency_batches: Sequence[int] = (1, 4, 16, 64),
                  latency_prompt: int = 512, latency_prompts: Sequence[int] = (
                      128, 512, 1024, 2048, 3072), latency_batch: int = 4, max_tokens: int = 32,
                  num_running: int = 16, running_tokens: int = 64, long_prompt: int = 3584,
                  chunk_budget: int = 512, arrive_after: int = 8,
                  kv_cache_memory: int | None = 8 * 2**30, rounds: int = 3,
                  modes: Sequence[str] | None = None) -> dict:
    """The engine half of ``forward.record``: TTFT/TPOT sweeps (one LLM, default token budget,
    ``rounds`` interleaved rounds), then ``interference_modes`` over ``modes`` (mixed steps
    eager, then replayed piecewise; decode steps replay full graphs in both), all on ``model``.
    Defaults: the H200 sizes for bench_1b; ``modes`` on CPU: "none" only (full graphs need
    CUDA, and the CPU stand-in of piecewise graphs is no faster)."""
    if modes is None:
        modes = (("full_decode_only", "full_and_piecewise") if
                 model.embed_tokens.device.type == "cuda" else ("none",))
    llm = LLM(model, enable_prefix_caching=False, kv_cache_memory=kv_cache_memory,
              max_num_seqs=max(*latency_batches, latency_batch))
    by_batch = latency_sweep(llm, [(b, latency_prompt) for b in latency_batches], max_tokens,
                             rounds=rounds)
    by_prompt = latency_sweep(llm, [(latency_batch, n) for n in latency_prompts], max_tokens,
                              seed=100, rounds=rounds)
    del llm
    runs = interference_modes(model, modes=modes, num_running=num_running,
                              running_tokens=running_tokens, long_prompt=long_prompt,
                              chunk_budget=chunk_budget, arrive_after=arrive_after,
                              kv_cache_memory=kv_cache_memory, rounds=rounds)
    return {"by_batch": by_batch.to_dict(orient="list"),
            "by_prompt": by_prompt.to_dict(orient="list"),
            "interference": [r.to_dict() for r in runs]}
