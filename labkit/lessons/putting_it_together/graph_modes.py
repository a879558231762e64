"""Which steps replay a graph: the engine's four ``cudagraph_mode`` values, with and without
async scheduling, on one model and one workload.

Only ``cudagraph_mode`` and ``async_scheduling`` change from row to row; the backend, the fused
ops, the weights and the requests are fixed. Each row's engine is built once (its capture time
and graph count are measured then), warmed by one run, then every round times one run of every
row in a fresh shuffled order, so drift lands on every row alike and each row reports its median
with its range. Each run's steps say how they ran (``StepRecord.graph``: "full", "piecewise" or
"eager"), so the table shows which steps each mode replays and how many tokens padding cost.
A mode the device cannot run stays in the table with the engine's reason.
"""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

import pandas as pd

from labkit import check_positive_int
from labkit.device import free_memory
from labkit.engine import LLM, LlamaModel
from labkit.engine.runner import CUDAGRAPH_MODES
from labkit.lessons.putting_it_together.experiment import timed_generate
from labkit.lessons.putting_it_together.workload import Workload, engine_options
from labkit.measure.rounds import Spread
from labkit.teaching import claim

COLUMNS = ["cudagraph_mode", "async_scheduling", "status", "reason", "graphs", "capture_ms",
           "steady_s", "steady_low_s", "steady_high_s", "output_tok_s", "mixed_step_ms",
           "steps", "full_steps", "piecewise_steps", "eager_steps", "mixed_steps",
           "mixed_replayed", "padded_tokens", "same_tokens", "same_first_tokens",
           "graph_MiB_predicted", "graph_MiB"]


@dataclass
class ModeExperiment:
    table: pd.DataFrame              # one row per (cudagraph_mode, async_scheduling), COLUMNS
    rounds: pd.DataFrame             # one row per row and round: seconds, mixed_step_ms
    device: str
    # The share of requests whose first token the eager engine repeats when the same requests
    # arrive in the reverse order (other batches, other reduction orders): what the modes'
    # same_first_tokens is compared with. None: no eager, synchronous row ran.
    baseline_first_tokens: float | None = None
    num_requests: int = 0

    def row(self, mode: str, async_scheduling: bool):
        t = self.table
        hit = t[(t.cudagraph_mode == mode) & (t.async_scheduling == async_scheduling)]
        return hit.iloc[0] if len(hit) else None

    def spread(self, mode: str, async_scheduling: bool, col: str = "seconds") -> Spread | None:
        r = self.rounds
        hit = r[(r.cudagraph_mode == mode) & (r.async_scheduling == async_scheduling)]
        values = [v for v in hit[col] if pd.notna(v)]
        return Spread.of(values) if values else None


def _mixed(stats) -> bool:
    return stats.num_prefill_tokens > 0 and stats.num_decode_tokens > 0


def _run_figures(run) -> dict:
    kinds = [s.graph for s in run.steps]
    mixed = [s for s in run.steps if _mixed(s.stats)]
    return {"seconds": run.seconds, "steps": len(kinds), "full_steps": kinds.count("full"),
            "piecewise_steps": kinds.count("piecewise"), "eager_steps": kinds.count("eager"),
            "mixed_steps": len(mixed), "mixed_replayed": sum(s.graph != "eager" for s in mixed),
            "padded_tokens": sum(s.padded_tokens for s in run.steps),
            # step durations mean something only where the host waits for each step
            "mixed_step_ms": statistics.median(s.duration_s for s in mixed) * 1e3
            if mixed else float("nan")}


def run_modes(model: LlamaModel, workload: Workload, *, modes=CUDAGRAPH_MODES,
              async_options=(False, True), rounds: int = 3, seed: int = 0,
              backend: str = "auto", **engine_kwargs) -> ModeExperiment:
    """Every (mode, async) row: built once, one warm run, then ``rounds`` shuffled rounds of one
    timed run each. ``engine_kwargs`` go to every engine (``cudagraph_capture_sizes``, say).
    The fused ops are fixed for every row (on with CUDA, off on CPU, where the stand-in that
    captures the pieces records torch ops only), so the mode is the only difference."""
    check_positive_int("rounds", rounds, hint="shuffled passes over every row")
    dev = model.embed_tokens.device
    prompts, params = workload.requests(model.config.vocab_size)
    options = {**engine_options(workload), "backend": backend,
               "fused_ops": dev.type == "cuda", **engine_kwargs}
    cells = [(m, a) for m in modes for a in async_options]
    engines, rows = {}, {}
    for cell in cells:
        mode, async_on = cell
        row = dict.fromkeys(COLUMNS, float("nan")) | {"cudagraph_mode": mode,
                                                      "async_scheduling": async_on,
                                                      "reason": ""}
        try:
            llm = LLM(model, cudagraph_mode=mode, async_scheduling=async_on, **options)
        except ValueError as e:
            rows[cell] = row | {"status": "cannot run", "reason": str(e).split(": on CPU")[0]}
            continue
        runner = llm.runner
        graphs = (len(runner.graphs.stats.buckets) if runner.graphs else 0) + \
            (runner.piecewise.stats.num_graphs if runner.piecewise else 0)
        capture = (runner.graphs.stats.capture_ms if runner.graphs else 0.0) + \
            (runner.piecewise.stats.capture_ms if runner.piecewise else 0.0)
        memory = runner.graph_memory()
        predicted = [m["predicted_bytes"] for m in memory]
        rows[cell] = row | {"status": "ran", "graphs": graphs, "capture_ms": capture,
                            "graph_MiB": sum(m["measured_bytes"] for m in memory) / 2**20,
                            "graph_MiB_predicted": float("nan") if None in predicted
                            else sum(predicted) / 2**20}
        timed_generate(llm, prompts, params)  # warm: first-call compiles and allocations
        engines[cell] = llm
    rng, per, tokens = random.Random(seed), {c: [] for c in engines}, {}
    for r in range(rounds):
        for position, cell in enumerate(rng.sample(list(engines), len(engines))):
            run = timed_generate(engines[cell], prompts, params)
            per[cell].append({"round": r, "position": position, "cudagraph_mode": cell[0],
                              "async_scheduling": cell[1], **_run_figures(run)})
            tokens.setdefault(cell, [o.token_ids for o in run.outputs])
    base = tokens.get(("none", False), next(iter(tokens.values()), None))
    baseline = None
    if ("none", False) in engines:  # eager against itself, the requests in the reverse order
        again = timed_generate(engines["none", False], prompts[::-1], params[::-1])
        baseline = _same_first(base, [o.token_ids for o in again.outputs][::-1])
    for cell, runs in per.items():
        seconds = [x["seconds"] for x in runs]
        last = runs[-1]
        n_out = sum(p.max_tokens for p in params)
        rows[cell].update(
            steady_s=statistics.median(seconds), steady_low_s=min(seconds),
            steady_high_s=max(seconds), output_tok_s=n_out / statistics.median(seconds),
            mixed_step_ms=statistics.median(x["mixed_step_ms"] for x in runs),
            **{k: last[k] for k in ("steps", "full_steps", "piecewise_steps", "eager_steps",
                                     "mixed_steps", "mixed_replayed", "padded_tokens")},
            same_tokens=tokens[cell] == base, same_first_tokens=_same_first(base, tokens[cell]))
    engines.clear()
    if dev.type == "cuda":
        free_memory(dev)
    table = pd.DataFrame([rows[c] for c in cells]).reindex(columns=COLUMNS)
    table = table.astype({c: "Int64" for c in ("graphs", "steps", "full_steps",
                                               "piecewise_steps", "eager_steps", "mixed_steps",
                                               "mixed_replayed", "padded_tokens")})
    return ModeExperiment(table, pd.DataFrame([x for runs in per.values() for x in runs]),
                          str(dev), baseline, len(prompts))


def _same_first(a: list[list[int]], b: list[list[int]]) -> float:
    """The share of requests whose first generated token is the same in ``a`` and ``b``."""
    return sum(x[:1] == y[:1] for x, y in zip(a, b)) / max(len(a), 1)


def pieces_table(model: LlamaModel) -> pd.DataFrame:
    """Where the piecewise graphs cut the forward: each piece, what it computes, and the eager
    attention that follows it."""
    n = len(model.layers)
    rows = []
    for i in range(n + 1):  # PiecewiseForward's pieces: one more than the layers
        before = "embed" if i == 0 else f"layer {i - 1}: o_proj, norm, MLP"
        after = f"layer {i}: norm, qkv_proj, RoPE" if i < n else "final norm"
        rows.append({"piece": i, "captured (per token bucket)": f"{before}; {after}",
                     "then, eager": f"layer {i} attention: store K/V, read the paged cache"
                     if i < n else "logits of the sampled rows"})
    return pd.DataFrame(rows)


# ----------------------------------------------------------------------- what the notebook claims
MEMORY_ERROR, SEGMENT_MIB = 0.25, 2  # a prediction's bound: a share, or one 2 MiB segment


def mode_claims(exp: ModeExperiment) -> list:
    """What the table shows on this machine: every mode that ran gave eager's greedy tokens;
    piecewise replays the mixed steps full_decode_only runs eagerly; on a GPU, replaying them
    makes a mixed step faster, round by round."""
    t = exp.table
    ran = t[t.status == "ran"]
    made = [claim("Every mode that ran here ({modes}) generated the same greedy tokens as the "
                  "eager, synchronous engine: a graph replays exactly the work it captured.",
                  len(ran) > 1 and bool(ran.same_tokens.eq(True).all()),
                  modes=", ".join(sorted(set(ran.cudagraph_mode))))]
    pw, full = exp.row("piecewise", False), exp.row("full_decode_only", False)
    if pw is not None and pw.status == "ran":
        made.append(claim(
            "With cudagraph_mode='piecewise', {replayed} of the {mixed} steps that mixed prefill "
            "chunks with decodes replayed graphs (attention eager between the pieces){full}.",
            pw.mixed_steps > 0 and pw.mixed_replayed == pw.mixed_steps
            and (full is None or full.status != "ran" or full.mixed_replayed == 0),
            replayed=int(pw.mixed_replayed), mixed=int(pw.mixed_steps),
            full="" if full is None or full.status != "ran" else
            f"; with 'full_decode_only', {int(full.mixed_replayed)} did"))
    if exp.baseline_first_tokens is not None and len(ran):
        worst = float(ran.same_first_tokens.min())
        slack = 1 / max(exp.num_requests, 1)
        made.append(claim(
            "Every mode repeated the eager engine's first token for at least {worst:.0%} of the "
            "{n} requests; eager itself, given the same requests in the reverse order (other "
            "batches, other reduction orders), repeats {base:.0%}: no mode differs from eager "
            "by more than eager differs from itself, give or take one request.",
            worst >= exp.baseline_first_tokens - slack - 1e-9, worst=worst,
            n=exp.num_requests, base=exp.baseline_first_tokens))
    captured = ran[pd.to_numeric(ran.graph_MiB, errors="coerce") > 0]
    if exp.device.startswith("cuda") and len(captured):
        off = (captured.graph_MiB_predicted - captured.graph_MiB).abs()
        ok = off <= (MEMORY_ERROR * captured.graph_MiB).clip(lower=SEGMENT_MIB)
        rows = ", ".join(f"{m}: {p:.1f} predicted, {g:.1f} taken" for m, p, g in zip(
            captured.cudagraph_mode, captured.graph_MiB_predicted, captured.graph_MiB))
        made.append(claim(
            "Each mode's graph memory, predicted before capture from one eager run of its "
            "largest graph inside a private pool, came within {err:.0%} or {seg} MiB (one "
            "allocator segment) of what capture took, at worst {worst:.1f} MiB off (MiB, async "
            "off and on: {rows}).", bool(off.notna().all() and ok.all()), err=MEMORY_ERROR,
            seg=SEGMENT_MIB, worst=float(off.max()), rows=rows))
    eager_mixed = exp.spread("none", False, "mixed_step_ms")
    pw_mixed = exp.spread("piecewise", False, "mixed_step_ms")
    if exp.device.startswith("cuda") and eager_mixed and pw_mixed:
        ratio = Spread.of([a / b for a, b in zip(eager_mixed.values, pw_mixed.values)])
        made.append(claim(
            "A mixed step took {eager:.2f} ms eager and {pw:.2f} ms replayed piecewise: "
            "{ratio:.2fx} faster, every round (synchronous engine, host waiting for each step).",
            ratio.above(1.0), eager=eager_mixed, pw=pw_mixed, ratio=ratio))
    return made


def compact(exp: ModeExperiment) -> pd.DataFrame:
    """The table a reader compares: how each row's steps ran, its time with the range over the
    rounds, and the reason of a row that could not run."""
    t = exp.table
    out = t[["cudagraph_mode", "async_scheduling", "status", "graphs"]].copy()
    out["capture_ms"] = pd.to_numeric(t.capture_ms, errors="coerce").round(0)
    out["run_s (range)"] = [
        "" if pd.isna(m) else f"{m:.3f} ({a:.3f}-{b:.3f})"
        for m, a, b in zip(t.steady_s, t.steady_low_s, t.steady_high_s)]
    out["output_tok_s"] = pd.to_numeric(t.output_tok_s, errors="coerce").round(0)
    for col in ("graph_MiB_predicted", "graph_MiB"):
        out[col] = pd.to_numeric(t[col], errors="coerce").round(1)
    for col in ("full_steps", "piecewise_steps", "eager_steps", "mixed_steps",
                "mixed_replayed", "padded_tokens", "same_tokens", "same_first_tokens",
                "reason"):
        out[col] = t[col]
    return out
