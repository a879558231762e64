"""What notebooks 07 and 07a claim: every sentence that states a measured fact, computed from
the tables of ``forward``, ``bounds``, ``latency`` and ``chunked_prefill`` and checked by them.

Each function takes the tables (live, or from the recording, ``recorded=`` the recording) and
returns its claims. A time with a range comes from interleaved rounds (``_low``/``_high``
columns); a table without them reads as one round. A condition holds only when the whole range
clears it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import pairwise

import pandas as pd

# part 4 (chunked prefill) lives in chunked_claims.py; the notebook reads it from here
from labkit.lessons.prefill_vs_decode.chunked_claims import (  # noqa: F401
    SAME_WORK,
    chunk_host_claim,
    interference_claims,
    piecewise_chunk_claims,
)
from labkit.lessons.prefill_vs_decode.where import on as _on
from labkit.measure.rounds import Spread
from labkit.teaching import claim


def _range(row, col: str) -> tuple[float, float]:
    """(low, high) of a column from its ``_low``/``_high`` neighbours, or the value twice."""
    stem = col.removesuffix("_ms")
    for lo, hi in ((f"{col}_low", f"{col}_high"), (f"{stem}_low_ms", f"{stem}_high_ms")):
        if lo in row and hi in row and not pd.isna(row[lo]):
            return float(row[lo]), float(row[hi])
    return float(row[col]), float(row[col])


def _timed(points: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The points that measure GPU time where there are any (graph replays), else eager;
    unfused only."""
    if "fused" in points:
        points = points[~points.fused.astype(bool)]
    if "graph" in set(points["mode"]):
        return points[points["mode"] == "graph"], "replayed from a graph (GPU time)"
    return points[points["mode"] == "eager"], "launched eagerly"


def _times(a, b) -> int | float:
    """``a / b`` of two counts (rows, tokens), an int where whole: 16, not np.float64(16.0)."""
    a, b = int(a), int(b)
    return a // b if a % b == 0 else a / b


def _pct(values: Sequence[float]) -> str:
    return ", ".join(f"{v:.0%}" for v in values)


# ----------------------------------------------------------------------- part 1: the roofline
PLATEAU = 0.75  # past its best length, a prefill near the ceiling keeps this share of the best


def roofline_claims(points: pd.DataFrame, peaks: dict, *, device: str | None = None,
                    recorded=None, decode_memory_bound: bool = True) -> list:
    """Prefill's throughput rises with its length toward the matmul ceiling: where the longest
    prompt is the best (a GPU), every step up in S beats the one below across their ranges;
    where it is not (one CPU thread nears its ceiling by a few hundred tokens, then attention's
    S^2 work grows), the shortest is the lowest, the lengths rise step by step until the first
    within ``PLATEAU`` of the best, and none after falls below that. The ridge falls between
    the smallest decode and the longest prefill, and (``decode_memory_bound``: a GPU's ridge,
    far above a CPU's) every measured decode batch stays left of the ridge."""
    timed, how = _timed(points)
    where = _on(recorded, device)
    ridge = peaks["matmul_TFLOPs"] * 1e3 / peaks["copy_GBps"]
    pre = timed[timed.kind == "prefill"].sort_values("tokens")
    dec = timed[timed.kind == "decode"].sort_values("batch")
    ceiling = peaks["matmul_TFLOPs"]
    lows = [_range(r, "tflops")[0] for _, r in pre.iterrows()]
    highs = [_range(r, "tflops")[1] for _, r in pre.iterrows()]
    peak = int(pre.tflops.to_numpy().argmax()) if len(pre) else 0
    top = float(pre.tflops.iloc[peak] / ceiling) if len(pre) else 0.0

    def steps_up(upto: int) -> bool:  # each length above the one before across its range
        return all(lo > hi for lo, hi in zip(lows[1:upto + 1], highs[:upto]))
    if peak == len(pre) - 1:  # a GPU: the longest prompt is the best
        rising = len(pre) >= 2 and steps_up(len(pre) - 1)
        shape = ("each length above the one before across its range; the longest gets closest, "
                 f"at {top:.0%}")
    else:  # one CPU thread nears its ceiling by a few hundred tokens, then attention's S^2 grows
        near = (pre.tflops >= PLATEAU * pre.tflops.iloc[peak]).to_numpy()
        knee = int(near.argmax())  # the first length near the best
        rising = knee >= 1 and bool(near[knee:].all()) and steps_up(knee) and \
            all(highs[0] < lo for lo in lows[1:])
        shape = (f"S = {int(pre.tokens.iloc[0])} the lowest across the rounds, and from S = "
                 f"{int(pre.tokens.iloc[knee])} on every prompt at least {PLATEAU:.0%} of the "
                 f"best ({top:.0%} at S = {int(pre.tokens.iloc[peak])}): the ceiling is near")
    made = [
        claim("Prefill's throughput rises with the prompt{where}, {how}: S = {lens} reach {shares} "
              "of the measured matmul ceiling ({ceiling:,.3g} TFLOP/s), {shape}.",
              rising, where=where, how=how, lens=", ".join(str(t) for t in pre.tokens),
              shares=_pct(pre.tflops / ceiling), ceiling=ceiling, shape=shape, top=top,
              recorded=recorded),
        claim("The ridge{where} is {ridge:,.1f} FLOP/B (matmul ceiling / copy bandwidth): decode "
              "at B={b0} ({d0:.2f} FLOP/B) sits left of it, prefill at S={s1} ({p1:,.0f} FLOP/B) "
              "right of it.",
              bool(pre.flops_per_byte.max() > ridge > dec.flops_per_byte.min()),
              where=where, ridge=ridge, b0=int(dec.batch.iloc[0]),
              d0=float(dec.flops_per_byte.iloc[0]), s1=int(pre.tokens.iloc[-1]),
              p1=float(pre.flops_per_byte.iloc[-1]), recorded=recorded)]
    if decode_memory_bound:
        made.append(claim(
            "Decode stays memory-bound{where}: at B = {batches} its intensity is {lo:.1f}-{hi:.1f} "
            "FLOP/B, all left of the ridge ({ridge:,.0f}); {how} it moves {bw} of the copy "
            "bandwidth and reaches at most {tf:.0%} of the matmul ceiling.",
            bool((dec.flops_per_byte < ridge).all()), where=where,
            batches=", ".join(str(b) for b in dec.batch), lo=float(dec.flops_per_byte.min()),
            hi=float(dec.flops_per_byte.max()), ridge=ridge, how=how,
            bw=_pct(dec.gbps / peaks["copy_GBps"]), tf=float((dec.tflops / ceiling).max()),
            recorded=recorded))
    return made


def batching_claim(points: pd.DataFrame, *, device: str | None = None, recorded=None):
    """A decode step of B rows costs less than B steps of one row (the weights are read once)."""
    timed, how = _timed(points)
    dec = timed[timed.kind == "decode"].sort_values("batch")
    small, big = dec.iloc[0], dec.iloc[-1]
    per = _times(big.batch, small.batch)
    return claim("A decode step of {b1} rows takes {ms1:.3g} ms{where} ({how}), against {ms0:.3g} "
                 "ms for {b0} row(s): {x:.1f}x the time for {per:.0f}x the rows, since the rows "
                 "share one read of the weights.",
                 bool(_range(big, "ms")[1] < per * _range(small, "ms")[0]),
                 b1=int(big.batch), ms1=float(big.ms), where=_on(recorded, device), how=how,
                 ms0=float(small.ms), b0=int(small.batch), x=float(big.ms / small.ms), per=per,
                 recorded=recorded)


# ----------------------------------------------------------------------- part 3: host or GPU
def graph_claims(points: pd.DataFrame, *, device: str | None = None, recorded=None,
                 decode_gain: float = 1.3, prefill_gain: float = 1.15) -> list:
    """Graph replay speeds up the smallest decode step by more than ``decode_gain`` and the
    longest prefill by less than ``prefill_gain`` (both across the rounds' ranges)."""
    if "fused" in points:
        points = points[~points.fused.astype(bool)]
    wide = {m: points[points["mode"] == m].set_index("shape") for m in ("eager", "graph")}
    rows = points[points["mode"] == "eager"]
    small = rows[rows.kind == "decode"].sort_values("batch").iloc[0]["shape"]
    long = rows[rows.kind == "prefill"].sort_values("tokens").iloc[-1]["shape"]

    def gain(shape):  # the range: the slowest eager over the fastest replay and the reverse
        (elo, ehi), (glo, ghi) = (_range(wide[m].loc[shape], "ms") for m in ("eager", "graph"))
        return wide["eager"].loc[shape].ms / wide["graph"].loc[shape].ms, elo / ghi, ehi / glo

    where = _on(recorded, device)
    d, p = gain(small), gain(long)
    return [
        claim("Replaying {small} from a CUDA Graph takes it from {e:.3g} to {g:.3g} ms{where}: "
              "{x:.1f}x ({lo:.1f}-{hi:.1f}x over the rounds), more than the {target}x target.",
              bool(d[1] > decode_gain), small=small, e=float(wide["eager"].loc[small].ms),
              g=float(wide["graph"].loc[small].ms), where=where, x=d[0], lo=d[1], hi=d[2],
              target=decode_gain, recorded=recorded),
        claim("For {long} replay changes little{where}: {e:.3g} ms eager, {g:.3g} ms replayed, "
              "{x:.2f}x ({lo:.2f}-{hi:.2f}x), under the {target}x bound: its kernels run long "
              "enough to hide the launches.", bool(p[2] < prefill_gain), long=long,
              e=float(wide["eager"].loc[long].ms), g=float(wide["graph"].loc[long].ms),
              where=where, x=p[0], lo=p[1], hi=p[2], target=prefill_gain, recorded=recorded)]


def bound_claims(overhead: pd.DataFrame, *, device: str | None = None, recorded=None,
                 slack: float = 0.5) -> list:
    """What bounds an eager step (``bounds.overhead_table``). With GPU time (replays): no eager
    step beats max(issue floor, GPU time) by more than ``1 - slack`` of it, and the floor is
    the larger term for the small steps. Without (a CPU): the floor is part of every step
    (never above it), a larger share of the smallest decode than of the longest prefill."""
    where = _on(recorded, device)
    if "model_ms" in overhead:
        host = overhead[overhead.bound == "host"]
        ratio = overhead.ms / overhead.model_ms
        return [claim(
            "Launches are asynchronous, so an eager step{where} takes about max(host issue "
            "floor, GPU time), not their sum: eager / that bound is {lo:.2f}-{hi:.2f} over the "
            "{n} shapes (none below {slack}: the floor is a program of its own, timed in the "
            "same rounds, and carries the host's noise); the host's floor is the larger term "
            "for {hosts} ({k} of {n}).", bool((ratio >= slack).all() and len(host) >= 1), where=where,
            lo=float(ratio.min()), hi=float(ratio.max()), n=len(overhead), slack=slack,
            hosts=", ".join(host["shape"]) or "none", k=len(host), recorded=recorded)]
    dec = overhead[overhead.kind == "decode"].sort_values("flops_per_byte")
    pre = overhead[overhead.kind == "prefill"].sort_values("flops_per_byte")
    d, p = dec.iloc[0], pre.iloc[-1]
    return [claim(
        "Issuing the ops{where} costs {fd:.2g} ms of the {md:.3g} ms {sd} step ({shd:.0%}) and "
        "{fp:.2g} ms of the {mp:.3g} ms {sp} ({shp:.1%}); no step is shorter than its floor "
        "(the largest share is {top:.0%}).",
        bool(not overhead.floor_over_step.any() and d.floor_share > 3 * p.floor_share),
        where=where, fd=float(d.issue_floor_ms), md=float(d.ms), sd=d["shape"],
        shd=float(d.floor_share), fp=float(p.issue_floor_ms), mp=float(p.ms), sp=p["shape"],
        shp=float(p.floor_share), top=float(overhead.floor_share.max()), recorded=recorded)]


def kernel_claims(summary: dict, num_layers: int, eager_ms: float | None = None, *,
                  device: str | None = None, recorded=None, fused_summary: dict | None = None
                  ) -> list:
    """From the profiler's summary of one eager decode step: on a GPU, its kernels per layer,
    the host time per kernel (``eager_ms``, the unprofiled eager step, over its kernel count)
    against a kernel's own GPU time, and how busy the GPU was; with ``fused_summary``, how many
    kernels the fused layer ops leave. On a CPU: its top-level op calls per layer."""
    where = _on(recorded, device)
    if "kernel_count" not in summary:
        ops = summary["top_level_ops"]
        return [claim("The eager decode step{where} makes {ops} top-level op calls for its "
                      "{L} layers, {per:.0f} a layer (the embedding, final norm and LM head "
                      "included): a layer is many more ops than its four matmuls.",
                      bool(ops / num_layers > 4), where=where, ops=ops, L=num_layers,
                      per=ops / num_layers)]
    if eager_ms is None:
        raise ValueError("a GPU profile's claim needs eager_ms, the unprofiled eager step's time")
    k = summary["kernel_count"]
    host_us = eager_ms * 1e3 / k
    made = [
        claim("The eager decode step{where} runs {k} kernels, {per:.0f} a layer over {L} layers "
              "(the embedding and LM head included). Unprofiled it takes {ms:.3g} ms: "
              "{host:.1f} us of host time per kernel, while a kernel runs {gpu:.2f} us on the "
              "GPU on average, so the GPU was busy {busy:.0%} of the step: launch-bound.",
              bool(host_us > summary["mean_kernel_us"] and summary["gpu_busy_fraction"] < 0.5),
              where=where, k=k, per=k / num_layers, L=num_layers, ms=eager_ms, host=host_us,
              gpu=summary["mean_kernel_us"], busy=summary["gpu_busy_fraction"],
              recorded=recorded)]
    if fused_summary is not None and "kernel_count" in fused_summary:
        fk = fused_summary["kernel_count"]
        made.append(claim(
            "With the fused layer ops the same step runs {fk} kernels ({fper:.0f} a layer) "
            "instead of {k}{where}.", bool(fk < k), fk=fk, fper=fk / num_layers, k=k,
            where=where, recorded=recorded))
    return made


def fused_claim(points: pd.DataFrame, fused: pd.DataFrame, *, device: str | None = None,
                recorded=None, target: float = 1.1):
    """Every replayed decode step is faster with the fused layer ops, by more than ``target``
    across the ranges (the slowest fused round against the fastest plain one)."""
    keys = ["shape", "kind", "mode"]
    plain = points[~points.fused.astype(bool)] if "fused" in points else points
    both = plain.merge(fused, on=keys, suffixes=("", "_f"))
    dec = both[(both.kind == "decode") & (both["mode"] == "graph")].sort_values("batch")
    def slowest_gain(r):  # the fastest plain round over the slowest fused one
        fused_high = r["ms_high_f"] if "ms_high_f" in r and not pd.isna(r["ms_high_f"]) \
            else r["ms_f"]
        return _range(r, "ms")[0] / fused_high

    low = [slowest_gain(r) for _, r in dec.iterrows()]
    gains = dec.ms / dec.ms_f
    return claim("Fusing the small layer ops speeds up every replayed decode step{where}: "
                 "{gains} at B = {batches} (slowest rounds: {lows}), each above {target}x.",
                 bool(len(dec) > 0 and min(low) > target), where=_on(recorded, device),
                 gains=", ".join(f"{g:.2f}x" for g in gains),
                 batches=", ".join(str(b) for b in dec.batch),
                 lows=", ".join(f"{g:.2f}x" for g in low), target=target, recorded=recorded)


def context_claim(growth: dict, *, device: str | None = None, recorded=None):
    """A decode step over ``factor`` times the context: its time grows (every round); replayed
    from a graph (memory-bound, on a GPU) by no more than its bytes (10% slack for noise). Eager
    on a CPU the arithmetic and the per-op cost grow with the context too, so there only the
    growth is claimed. The sentence says which growth the time is nearer."""
    r = Spread.of(growth["ratio"])
    b, f = growth["bytes_ratio"], growth["flops_ratio"]
    memory_bound = growth["mode"] == "graph"
    if r.median > b:
        near = "more than its bytes: this step is not bound by memory alone"
    elif abs(math.log(r.median / b)) < abs(math.log(r.median / f)):
        near = "about as much as its bytes"
    else:
        near = ("less than its bytes, nearer its FLOPs: part of the step (the weights, the "
                "per-kernel cost) does not grow with the context")
    return claim("A decode step of {batch} rows over {c1:,} tokens of context instead of {c0:,} "
                 "took {r:.2fx} as long{where} ({mode}); its bytes grow {b:.2f}x and its FLOPs "
                 "{f:.2f}x, so its time grew {near}.",
                 bool(r.above(1.0) and (r.below(1.1 * b) or not memory_bound)),
                 batch=growth["batch"], c1=growth["long_context"], c0=growth["context"], r=r,
                 where=_on(recorded, device), mode=growth["mode"], b=b, f=f, near=near,
                 recorded=recorded)


# ----------------------------------------------------------------------- part 2: TTFT and TPOT
def latency_claims(by_batch: pd.DataFrame, by_prompt: pd.DataFrame, *,
                   device: str | None = None, recorded=None) -> list:
    """What is monotone in the sweeps: the worst TTFT at the largest batch against one request,
    the mean TTFT of the longest prompts against the shortest (both across their ranges), the
    prefill steps the schedule needs (never fewer for longer prompts), and TPOT growing less
    than the batch (every round)."""
    where = _on(recorded, device)
    b = by_batch.sort_values("batch").reset_index(drop=True)
    p = by_prompt.sort_values("prompt_len").reset_index(drop=True)
    b0, b1, p0, p1 = b.iloc[0], b.iloc[-1], p.iloc[0], p.iloc[-1]
    rounds = int(b.get("rounds", pd.Series([1])).iloc[0])
    made = [
        claim("{n1} requests of {plen} tokens arriving together{where}: the last first token "
              "comes {w1:.1f} ms after arrival ({w1lo:.1f}-{w1hi:.1f}, {rounds} round(s)), "
              "against {w0:.1f} ms ({w0lo:.1f}-{w0hi:.1f}) for {n0}: its prompt waits behind "
              "the others' prefill.",
              bool(_range(b1, "ttft_max_ms")[0] > _range(b0, "ttft_max_ms")[1]), n1=int(b1.batch),
              plen=int(b1.prompt_len), where=where, w1=float(b1.ttft_max_ms),
              w1lo=_range(b1, "ttft_max_ms")[0], w1hi=_range(b1, "ttft_max_ms")[1],
              rounds=rounds, w0=float(b0.ttft_max_ms), w0lo=_range(b0, "ttft_max_ms")[0],
              w0hi=_range(b0, "ttft_max_ms")[1], n0=int(b0.batch), recorded=recorded),
        claim("{n} requests of {l1} tokens{where} wait {t1:.1f} ms for their first tokens on "
              "average ({t1lo:.1f}-{t1hi:.1f}), against {t0:.1f} ms ({t0lo:.1f}-{t0hi:.1f}) "
              "at {l0} tokens: {x:.1f}x for {px:.0f}x the prompt.",
              bool(_range(p1, "ttft_ms")[0] > _range(p0, "ttft_ms")[1]), n=int(p1.batch),
              l1=int(p1.prompt_len), where=where, t1=float(p1.ttft_ms),
              t1lo=_range(p1, "ttft_ms")[0], t1hi=_range(p1, "ttft_ms")[1],
              t0=float(p0.ttft_ms), t0lo=_range(p0, "ttft_ms")[0], t0hi=_range(p0, "ttft_ms")[1],
              l0=int(p0.prompt_len), x=float(p1.ttft_ms / p0.ttft_ms),
              px=_times(p1.prompt_len, p0.prompt_len), recorded=recorded)]
    tpot_hi = _range(b1, "tpot_ms")[1] / _range(b0, "tpot_ms")[0]
    per = _times(b1.batch, b0.batch)
    made.append(claim(
        "TPOT{where} grows {x:.1f}x (at most {hi:.1f}x over the rounds) from {n0} to {n1} "
        "requests, {per:.0f}x the rows: {t0:.2f} -> {t1:.2f} ms per token.",
        bool(tpot_hi < per), where=where, x=float(b1.tpot_ms / b0.tpot_ms), hi=tpot_hi,
        n0=int(b0.batch), n1=int(b1.batch), per=per, t0=float(b0.tpot_ms),
        t1=float(b1.tpot_ms), recorded=recorded))
    if "prefill_steps" in p:
        steps = p.prefill_steps.tolist()
        made.append(claim(
            "The schedule{where} prefills {n} prompts of {lens} tokens in {steps} step(s): "
            "never fewer for a longer prompt. TTFT counts these steps, so it follows the step "
            "count and each step's time more than the token count.",
            bool(all(a <= b for a, b in pairwise(steps)) and steps[-1] > steps[0]),
            where=where, n=int(p1.batch), lens=", ".join(str(x) for x in p.prompt_len),
            steps=", ".join(str(s) for s in steps), recorded=recorded))
    return made


def missing(data: dict, fields: Sequence[str]) -> list[str]:
    """The dotted ``fields`` (``points.floor_ms``) a recording lacks."""
    def has(node, parts):
        return not parts or (isinstance(node, dict) and parts[0] in node
                             and has(node[parts[0]], parts[1:]))
    return [f for f in fields if not has(data, f.split("."))]


def knee_claim(knees: dict, ridge: float, *, device: str | None = None, recorded=None):
    """``knees``: context -> ``cost.knee_batch`` at ``ridge`` (None: never). With the weights
    alone (context 0) decode reaches the ridge at some batch; at the longest context it never
    does."""
    longest = max(knees)
    return claim("At the ridge{where} ({ridge:,.0f} FLOP/B), bench_1b decode with the weights "
                 "alone turns compute-bound from a batch of {knee}; with {ctx:,} tokens of "
                 "context per row it never does.",
                 bool(knees.get(0) is not None and knees[longest] is None),
                 where=_on(recorded, device), ridge=ridge, knee=knees.get(0), ctx=longest,
                 recorded=recorded)
