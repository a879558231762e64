"""Notebook 11's claims: each sentence rendered from the measurements' tables and checked."""
from __future__ import annotations

import pandas as pd

from labkit.teaching import claim


def draft_claim(result: dict):
    return claim("A one-layer draft with random weights of its own proposed {p} tokens and the "
                 "target accepted {a}: two random models seldom agree, and a real draft is "
                 "trained to imitate its target; the outputs still equal plain decoding's.",
                 result["same_tokens"] and result["proposed"] > 0, p=result["proposed"],
                 a=result["accepted"])


# --- claims ------------------------------------------------------------------------------------

def formula_claim(check: pd.DataFrame):
    """The controlled draft's tokens per full verify against (1 - a^(k+1)) / (1 - a)."""
    off = (check.tokens_per_verify / check.expected - 1).abs()
    worst = check.loc[off.idxmax()]
    return claim("Over {n} (acceptance, k) settings and {v} verify steps, the controlled draft "
                 "emitted within {off:.0%} of the tokens per step that (1 - a^(k+1)) / (1 - a) "
                 "predicts (worst: a = {a}, k = {k}: {got:.2f} against {want:.2f}).",
                 off.max() < 0.1, n=len(check), v=int(check.verifies.sum()), off=off.max(),
                 a=worst.acceptance, k=int(worst.k), got=worst.tokens_per_verify,
                 want=worst.expected)


def cost_claim(costs: pd.DataFrame, where: str):
    """Verify steps cost little more than decode steps when the step is not compute-bound."""
    k4 = costs[costs.k == 4]
    worst = k4.loc[k4.high.idxmax()]
    return claim("A verify step of k = 4 (5 tokens per request) cost {lo:.2f}-{hi:.2f}x a "
                 "one-token decode step at batch {b} {where}, the worst batch size over the "
                 "rounds: far less than the 5x its tokens would cost if a step's time grew with "
                 "its tokens.", worst.high < 3.5, lo=worst.low, hi=worst.high,
                 b=int(worst.batch), where=where)


def gpu_cost_claim(costs: pd.DataFrame, where: str):
    """On the GPU's clock, what a k = 4 verify step costs at batch 1 beside its wall time: a
    step's wall time holds the host's scheduling and read-back too, which hides the kernels'
    own ratio."""
    row = costs[(costs.k == 4) & (costs.batch == costs.batch.min())].iloc[0]
    return claim("On the GPU's own clock a verify step of k = 4 at batch {b} cost "
                 "{lo:.2f}-{hi:.2f}x a decode step (medians of device time: decode {d:.2f} ms, "
                 "verify {v:.2f} ms) {where}, where their wall times gave {wlo:.2f}-{whi:.2f}x: "
                 "four more tokens a request ride on the same weight reads, less than 2x for 5x "
                 "the tokens.",
                 row.gpu_high < 2, b=int(row.batch), lo=row.gpu_low, hi=row.gpu_high,
                 d=row.decode_gpu_ms, v=row.verify_gpu_ms, wlo=row.low, whi=row.high,
                 where=where)


def _shares(column: pd.Series) -> str:
    """A range of shares by cell, one figure when every cell has the same ("100%", not
    "100%-100%")."""
    lo, hi = f"{column.min():.0%}", f"{column.max():.0%}"
    return lo if lo == hi else f"{lo}-{hi}"


def graph_claim(costs: pd.DataFrame, gpu: bool, where: str):
    """Which steps the cost comparison timed: on a GPU, every cell's medians are over steps that
    replayed a full graph (and there were some); on a CPU none did."""
    verify, decode = costs.full_verify_share, costs.full_decode_share
    if gpu:
        return claim("{v} of the verify steps (by cell) replayed a full CUDA Graph captured "
                     "for their request bucket and k + 1 tokens a request, and {d} of the "
                     "decode steps a full decode graph {where}; each median above is over those "
                     "replays alone, a graph replay against a graph replay (the rest, beside a "
                     "prefill or with drafts cut short near a request's end, are not timed).",
                     verify.min() > 0 and decode.min() > 0, v=_shares(verify),
                     d=_shares(decode), where=where)
    return claim("{v:.0%} of the timed verify steps and {d:.0%} of the decode steps replayed a "
                 "full CUDA Graph {where}: full graphs need a CUDA device, so every step here "
                 "ran eagerly.", verify.max() == 0 and decode.max() == 0, v=verify.max(),
                 d=decode.max(), where=where)


def speedup_claims(speed: pd.DataFrame, tolerance: float, where: str, exact: bool = True) -> list:
    """The best speed-up, its agreement with the prediction, the speed-up over an async plain
    loop where ``speed`` has one (``speedups(versus_async=True)``) and, where the model computes
    in float32 (``exact``), outputs equal to plain decoding's. In bf16 a verify step's kernels
    round differently from a decode step's, so near ties among random weights may go the other
    way and no equality is claimed."""
    best = speed.loc[speed.speedup.idxmax()]
    off = ((speed.speedup / speed.predicted) - 1).abs()
    if "async_predicted" in speed:  # the async pairs too, where measured
        off = pd.concat([off, ((speed.async_speedup / speed.async_predicted) - 1).abs().dropna()])
    claims = [
        claim("With the controlled draft at acceptance {a} and k = {k}, batch-1 output tokens/s "
              "were {lo:.2f}-{hi:.2f}x plain decoding on the same loop {where} (the upper "
              "bound for a draft of that acceptance: this draft costs nothing).", best.low > 1,
              a=best.acceptance,
              k=int(best.k), lo=best.low, hi=best.high, where=where),
        claim("Every measured speed-up is within {tol:.0%} of expected tokens per step over the "
              "measured relative step cost (largest gap {off:.0%}).", off.max() <= tolerance,
              tol=tolerance, off=off.max()),
    ]
    if "versus_async" in speed:
        top = speed.loc[speed.versus_async.idxmax()]
        claims.append(claim(
            "Against plain decoding with async scheduling (a plain engine's default on a GPU), "
            "the speculating engine on its synchronous loop (each step's drafts wait on the "
            "host for the last step's accepted tokens) gave, at its best setting (acceptance "
            "{a}, k = {k}), {lo:.2f}-{hi:.2f}x {where} (median {m:.2f}x), no more than the "
            "{slo:.2f}-{shi:.2f}x (median {sm:.2f}x) it gave against the same loop: the host "
            "time async scheduling hides is what the synchronous loop pays for. Per output token: "
            "{spec:.2f} ms speculating, {asy:.2f} ms plain with async scheduling, {plain:.2f} ms "
            "plain on the speculating engine's loop (medians over the rounds).",
            bool(top.versus_async <= top.speedup), a=top.acceptance, k=int(top.k),
            lo=top.versus_async_low, hi=top.versus_async_high, m=top.versus_async,
            slo=top.low, shi=top.high, sm=top.speedup, where=where,
            spec=top.spec_ms_per_token, asy=top.async_ms_per_token,
            plain=top.plain_ms_per_token))
    if "async_speedup" in speed and speed.async_speedup.notna().any():
        claims.append(async_claim(speed, where, exact))
    if exact:
        claims.append(claim("Greedy outputs with speculation equal plain decoding's in all {n} "
                            "settings.", bool(speed.same_tokens.all()), n=len(speed)))
    return claims


def async_claim(speed: pd.DataFrame, where: str, exact: bool = True):
    """Async speculation against async plain decoding, beside the synchronous speculating loop
    against the same async plain loop: planning each step before the last one's accepted count
    is read must win back the host time the synchronous loop pays (``async_speedup`` at least
    ``versus_async``, medians); in float32 (``exact``) with plain decoding's tokens."""
    top = speed.loc[speed.async_speedup.idxmax()]
    return claim(
        "With async scheduling on both sides (the speculating engine plans each step before the "
        "last one's accepted count reaches the host, and the device moves the planned row by "
        "it), acceptance {a} and k = {k} gave {lo:.2f}-{hi:.2f}x plain decoding {where} (median "
        "{m:.2f}x), where the synchronous speculating loop gave {vm:.2f}x against the same plain "
        "loop. Per output token: {aspec:.2f} ms async speculating, {asy:.2f} ms async plain.",
        bool(top.async_speedup >= top.versus_async) and (not exact or top.async_same_tokens),
        a=top.acceptance, k=int(top.k), lo=top.async_speedup_low, hi=top.async_speedup_high,
        m=top.async_speedup, vm=top.versus_async, where=where,
        aspec=top.async_spec_ms_per_token, asy=top.async_ms_per_token)


def ngram_claim(table: pd.DataFrame):
    """Lookup's acceptance follows how much the output repeats itself (``repeats``), and lookup
    never changes a greedy output. Rows are (model, workload); the most and least repetitive
    rows are compared: where their repetition differs by a tenth of the tokens or more, the
    first must accept at least the second's share, and it must accept some drafts if a tenth or
    more of its tokens repeat."""
    acceptance = table.acceptance.fillna(0.0)
    hi = table.repeats.idxmax()
    lo = table.repeats.drop(hi).idxmin() if len(table) > 1 else hi
    apart = table.repeats[hi] - table.repeats[lo] >= 0.1  # repetition clearly differs

    def name(row):
        return " on ".join(reversed(row)) if isinstance(row, tuple) else str(row)
    held = (bool(table.same_tokens.all()) and table.proposed.sum() > 0
            and (not apart or acceptance[hi] >= acceptance[lo])
            and (table.repeats[hi] < 0.1 or acceptance[hi] > 0))
    return claim("Prompt lookup's acceptance follows how much the output repeats itself: where "
                 "it repeats most ({hi}: {hr:.0%} of output tokens continue an earlier n-gram) "
                 "the target accepted {ha:.0%} of {hp} drafts, where least ({lo}: {lr:.0%}) "
                 "{la:.0%} of {lp}; every greedy output equals plain decoding's.", held,
                 hi=name(hi), hr=table.repeats[hi], ha=acceptance[hi],
                 hp=int(table.proposed[hi]), lo=name(lo), lr=table.repeats[lo],
                 la=acceptance[lo], lp=int(table.proposed[lo]))
