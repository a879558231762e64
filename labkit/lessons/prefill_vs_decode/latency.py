"""What the user of an engine waits for: TTFT (time to first token), the wait for a request's
prefill, which grows with its prompt and with every prompt ahead of it in the step budget; and
TPOT (time per output token), the decode step time shared by all running requests, which grows
slowly with the batch while decode stays memory-bound. ``latency_sweep`` drives a real
:class:`~labkit.engine.LLM` through ``generate`` and reads both from its outputs."""
from __future__ import annotations

import random
from typing import Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from labkit.engine import LLM, SamplingParams
from labkit.measure.bench import TritonCompiles


def random_prompts(num: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``num`` prompts of ``length`` token ids; distinct seeds give prompts the prefix cache
    cannot serve, so every measurement pays its full prefill."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def warm_up(llm: LLM) -> None:
    """A small request first: first-call costs (allocations, lazy set-up) are not measured."""
    llm.generate(random_prompts(2, 8, llm.config.vocab_size, -1), SamplingParams(max_tokens=3))


def latency_sweep(llm: LLM, cases: Sequence[tuple[int, int]], max_tokens: int = 16,
                  seed: int = 0, rounds: int = 3, rehearse: bool = True) -> pd.DataFrame:
    """For each (batch, prompt_len): ``batch`` requests arriving at once; mean and worst TTFT,
    mean TPOT (ms), each the median over ``rounds`` interleaved rounds (every case once per
    round, fresh token ids each time) with its range (``_low``/``_high``); ``prefill_steps``,
    the engine steps that computed prompt tokens (the schedule TTFT waits for); and the Triton
    compiles that still happened inside the timed runs (0 under the interpreter; ``compiled``
    names the kernels). Every case runs once untimed first, whole (other token ids, as many
    tokens out): a GPU compiles Triton kernel variants for new shapes on first use, and a TTFT
    must not include a compile. A shorter rehearsal is not enough: with two tokens out, requests
    never decode together in the step shapes of the timed run. ``rehearse=False`` skips it
    where nothing compiles (Triton's interpreter)."""
    bad = [(n, c) for n, c in enumerate(cases) if min(c) < 1]
    if bad:
        raise ValueError(f"case {bad[0][0]}: batch and prompt_len must be >= 1, got {bad[0][1]}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    vocab = llm.config.vocab_size
    warm_up(llm)
    for n, (batch, prompt_len) in enumerate(cases if rehearse else ()):
        llm.generate(random_prompts(batch, prompt_len, vocab, -2 - n),
                     SamplingParams(max_tokens=max_tokens))
    runs: dict[int, list[dict]] = {n: [] for n in range(len(cases))}
    for r in range(rounds):
        for n, (batch, prompt_len) in enumerate(cases):
            first = len(llm.step_history)
            with TritonCompiles() as compiles:
                outs = llm.generate(random_prompts(batch, prompt_len, vocab,
                                                   seed + n + 1000 * r),
                                    SamplingParams(max_tokens=max_tokens))
            bad = [o.error for o in outs if not o.ok]
            if bad:
                raise ValueError(f"case (batch {batch}, prompt {prompt_len}) was refused: "
                                 f"{bad[0]}")
            steps = [h.stats for h in llm.step_history[first:]]
            ttft = pd.Series([o.ttft_s for o in outs]) * 1e3
            tpot = pd.Series([o.tpot_s for o in outs if o.tpot_s is not None]) * 1e3
            runs[n].append({"ttft_ms": ttft.mean(), "ttft_max_ms": ttft.max(),
                            "tpot_ms": tpot.mean() if len(tpot) else float("nan"),
                            "prefill_steps": sum(s.num_prefill_tokens > 0 for s in steps),
                            "compiles": compiles.count, "kernels": list(compiles.kernels)})
    rows = []
    for n, (batch, prompt_len) in enumerate(cases):
        per_round = pd.DataFrame(runs[n])
        row = {"batch": batch, "prompt_len": prompt_len, "max_tokens": max_tokens,
               "rounds": rounds}
        for col in ("ttft_ms", "ttft_max_ms", "tpot_ms"):
            stem = col[:-3]
            row.update({col: per_round[col].median(), f"{stem}_low_ms": per_round[col].min(),
                        f"{stem}_high_ms": per_round[col].max()})
        row.update({"prefill_steps": int(per_round.prefill_steps.max()),
                    "triton_compiles": int(per_round.compiles.sum()),
                    "compiled": ", ".join(sorted({k for ks in per_round.kernels for k in ks}))})
        rows.append(row)
    return pd.DataFrame(rows)


def latency_figure(df: pd.DataFrame, x: str, title: str) -> go.Figure:
    """TTFT (mean and worst request) and TPOT over ``x`` ("batch" or "prompt_len")."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT (ms)", "TPOT (ms)"))
    d = df.sort_values(x)
    fig.add_scatter(x=d[x], y=d.ttft_ms, mode="lines+markers", name="TTFT, mean", row=1, col=1)
    fig.add_scatter(x=d[x], y=d.ttft_max_ms, mode="lines+markers", name="TTFT, worst request",
                    line=dict(dash="dot"), row=1, col=1)
    fig.add_scatter(x=d[x], y=d.tpot_ms, mode="lines+markers", name="TPOT, mean", row=1, col=2)
    label = {"batch": "requests arriving together", "prompt_len": "prompt tokens"}.get(x, x)
    fig.update_xaxes(title_text=label, type="log")
    fig.update_yaxes(rangemode="tozero")
    return fig.update_layout(title=title, height=400)
