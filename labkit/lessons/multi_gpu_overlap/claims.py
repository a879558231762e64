"""What notebook 09 claims, each computed from a run or a recording."""
from __future__ import annotations

import itertools

import pandas as pd

from labkit.distributed.tensor_parallel import DTYPES
from labkit.lessons.multi_gpu_overlap.metrics import (
    BOUND_TOLERANCE,
    BOUNDS,
    gain_verdict,
    out_of_model,
)
from labkit.lessons.multi_gpu_overlap.result import TPResult
from labkit.teaching import claim

# ----------------------------------------------------------------------- what the notebook claims
SIDE_BY_SIDE = 0.25      # share of NCCL's kernel time that must run beside a matmul, every rank
LATENCY_FACTOR = 4.0     # how much faster per byte a prefill all-reduce must run than a decode one


def where_of(backend: str, recorded=None, gpu: str | None = None) -> str:
    """'on 2 x NVIDIA H200' (recorded or live over NCCL) or 'on this machine's CPU (gloo)'."""
    if recorded is not None:
        return f"on 2 x {recorded.fingerprint['gpu']} (recorded)"
    return f"on 2 x {gpu}" if backend == "nccl" else "on this machine's CPU (gloo)"


def split_claim(one_partial_off: float, sum_off: float):
    """The two partials need each other: one alone is far from y, their sum is y."""
    return claim("One rank's partial alone misses the layer's output by up to {one:.3f}; the two "
                 "partials summed match it to {both:.1e}: the output needs exactly one "
                 "all-reduce.", sum_off < 1e-5 < one_partial_off, one=one_partial_off,
                 both=sum_off)


def correctness_claim(errors: pd.DataFrame, tol: float, dtype: str, where: str):
    worst = float(errors.max().max())
    return claim("Every schedule, on both ranks {where}, matches the whole layer on one device: "
                 "worst relative error {worst:.1e}, under the {tol:.0e} that {dtype} allows.",
                 worst < tol, where=where, worst=worst, tol=tol, dtype=dtype)


def schedule_claims(results: list[TPResult], where: str, recorded=None) -> list:
    """What the traced steps launched, on every rank of every result: the serial step one
    all-reduce after its last matmul, the overlapped one all but its last chunk's before."""
    serial = [s for r in results for s in r.trace("serial").summary.values()]
    chunks = {r.experiment.trace_chunks for r in results}
    overlapped = [(r.experiment.trace_chunks, s) for r in results
                  for s in r.trace("overlapped").summary.values()]
    return [
        claim("The traced serial step {where} ran one all-reduce per rank, launched after the "
              "last matmul: {early} launched early.",
              all(s["collectives"] == 1 and s["launched_early"] == 0 for s in serial),
              where=where, early=max(s["launched_early"] for s in serial), recorded=recorded),
        claim("The traced overlapped step {where} ran {chunks} all-reduces per rank and "
              "launched {early} of them before the last matmul: each chunk's sum was in flight "
              "while a later chunk computed.",
              all(s["collectives"] == k and s["launched_early"] == k - 1 for k, s in overlapped),
              where=where, chunks="/".join(map(str, sorted(chunks))),
              early="/".join(sorted({str(s["launched_early"]) for _, s in overlapped})),
              recorded=recorded)]


def gpu_trace_claims(results: list[TPResult], where: str, recorded=None) -> list:
    """On GPU traces: NCCL ran beside the matmuls, and ran longer there than alone."""
    hidden = [s["comm_hidden_fraction"] for r in results
              for s in r.trace("overlapped").summary.values()]
    stretch = [r.comm_stretch() for r in results]
    return [
        claim("In the traced overlapped step {where}, NCCL's kernels ran beside a matmul for "
              "{lo:.0%}-{hi:.0%} of their time, on both ranks at every width (at least "
              "{target:.0%} asked): the GPU ran the two side by side.",
              min(hidden) >= SIDE_BY_SIDE, where=where, lo=min(hidden), hi=max(hidden),
              target=SIDE_BY_SIDE, recorded=recorded),
        claim("Beside matmuls, NCCL's kernels ran {lo:.2f}-{hi:.2f}x as long as alone in the "
              "serial step {where} (one traced step per width): communication that shares the "
              "GPU gets fewer SMs and less memory bandwidth, and waits for its peer's chunk.",
              min(stretch) > 1.0, lo=min(stretch), hi=max(stretch), where=where,
              recorded=recorded)]


def width_claims(results: list[TPResult], where: str, recorded=None) -> list:
    """Across MLP widths at one token count: compute grows with ffn, the all-reduce does not;
    and cut into more chunks, the all-reduces cost more in total."""
    results = sorted(results, key=lambda r: r.experiment.ffn)
    ones = [r.table.sort_values("num_chunks").iloc[0] for r in results]
    ratios = [o.compute_us / o.comm_us for o in ones]
    comm = [o.comm_us for o in ones]
    k = min(max(r.experiment.chunk_counts) for r in results)
    cut = [r.table.set_index("num_chunks").loc[k].comm_us / o.comm_us
           for r, o in zip(results, ones)]
    return [
        claim("Compute grows with the MLP width, the all-reduce does not {where}: compute / "
              "comm is {lo:.2f} at ffn {a:,} and {hi:.1f} at ffn {b:,}, while the all-reduce of "
              "[tokens, hidden] takes {cmin:.0f}-{cmax:.0f} us at every width.",
              all(x < y for x, y in itertools.pairwise(ratios)) and max(comm) / min(comm) < 1.2,
              where=where, lo=ratios[0], a=results[0].experiment.ffn, hi=ratios[-1],
              b=results[-1].experiment.ffn, cmin=min(comm), cmax=max(comm), recorded=recorded),
        claim("Cut into {k} chunks, the all-reduces take {lo:.2f}-{hi:.2f}x one message's time "
              "{where}: a finer pipeline pays for each piece it hides.", min(cut) > 1.1, k=k,
              lo=min(cut), hi=max(cut), where=where, recorded=recorded)]


def rounds_claims(results: list[TPResult], where: str, recorded=None) -> list:
    """From interleaved rounds: no bounded metric is out of model; per result, the best chunk
    count's speed-up with its range, called a gain only when every round gained, and never above
    its ceiling serial / max(compute, comm)."""
    out, medians, noisy = [], [], 0
    for r in results:
        for k in r.experiment.chunk_counts:
            spreads = r.spreads(k)
            out += [f"ffn {r.experiment.ffn}, {r.experiment.tokens} tokens, {k} chunks: {name} "
                    f"{spreads[name]:.3f}" for name in out_of_model(spreads)]
            medians += [(name, spreads[name].median) for name in BOUNDS]
            noisy += sum(spreads[name].median > bound and name not in out_of_model(spreads)
                         for name, bound in BOUNDS.items())
    largest = {name: max(v for n, v in medians if n == name) for name in BOUNDS}
    made = [claim("{verdict} {where}: efficiency and of_pipeline, each at most 1 by the model, "
                  "passed 1 by more than {tol:.0%} (timing noise) in every round at no chunk "
                  "count, nor did hidden_fraction, whose bound is efficiency's (largest medians "
                  "{eff:.3f}, {pipe:.3f}, {hid:.3f}{noisy}).{out}", not out, tol=BOUND_TOLERANCE,
                  verdict="No bounded metric is out of model" if not out else
                  "Some bounded metrics are out of model", where=where,
                  eff=largest["efficiency"], pipe=largest["of_pipeline"],
                  hid=largest["hidden_fraction"],
                  noisy=f"; {noisy} median(s) past 1 with a round under it: noise" if noisy else "",
                  out=(" Out of model: " + "; ".join(out) + ".") if out else "",
                  recorded=recorded)]
    for r in results:
        e, k = r.experiment, r.best_chunks()
        best, one = r.spreads(k), r.spreads(1)
        made.append(claim(
            "ffn {ffn:,}, {tokens:,} tokens {where}: the best overlapped step ({k} chunks) runs "
            "{gain:.2fx} as fast as the serial step: {verdict}. No schedule can beat the ceiling "
            "serial / max(compute, comm), {ceiling:.2fx}; one chunk, the serial step's own work, "
            "ran {noise:.2fx}.", not best["efficiency"].above(BOUNDS["efficiency"]),
            ffn=e.ffn, tokens=e.tokens, where=where, k=k, gain=best["speedup"],
            verdict=gain_verdict(best["speedup"]), ceiling=best["ceiling"], noise=one["speedup"],
            recorded=recorded))
    return made


def _message_rate(r: TPResult) -> tuple[float, float, float]:
    """One unchunked all-reduce: bytes, median microseconds and GB/s."""
    e = r.experiment
    nbytes = e.tokens * e.hidden * DTYPES[e.dtype].itemsize
    us = r.spreads(1)["comm_us"].median
    return nbytes, us, nbytes / us / 1e3


def decode_claims(prefill: list[TPResult], decode: list[TPResult], where: str,
                  recorded=None) -> list:
    """Decode-sized steps against a prefill-sized one of the same width: the all-reduce pays
    latency, not bandwidth; chunks multiply messages and weight reads; no overlap gains."""
    decode = sorted(decode, key=lambda r: r.experiment.tokens)
    small = decode[0]
    big = next((r for r in prefill if r.experiment.ffn == small.experiment.ffn), prefill[-1])
    (db, dus, dgbs), (pb, pus, pgbs) = _message_rate(small), _message_rate(big)
    k = max(small.experiment.chunk_counts)
    pk = max(c for c in big.experiment.chunk_counts if c <= k)
    cut = small.spreads(k)["comm_us"].median / dus
    cut_prefill = big.spreads(pk)["comm_us"].median / pus
    reread = small.spreads(k)["compute_us"].median / small.spreads(1)["compute_us"].median
    gains = {r.experiment.tokens: r.spreads(r.best_chunks())["speedup"] for r in decode}
    busy = [s["summary"]["gpu_busy_us"] for s in
            (rank["traces"]["overlapped"] for rank in small.ranks)
            if "gpu_busy_us" in s["summary"]]
    span = [s["summary"]["window_us"] for s in
            (rank["traces"]["overlapped"] for rank in small.ranks)
            if "window_us" in s["summary"]]
    profiled = (f"; the profiler saw the GPU busy {max(busy):,.0f} of the traced "
                f"{small.experiment.trace_chunks}-chunk step's {max(span):,.0f} us"
                if busy and span else "")
    return [
        claim("An all-reduce of {t} tokens ({dkib:,.0f} KiB) takes {dus:.1f} us {where}, "
              "{dgbs:.1f} GB/s; of {T:,} tokens ({pmib:,.0f} MiB) {pus:,.0f} us, {pgbs:,.0f} GB/s, "
              "{ratio:.0f}x the rate (above the {factor:.0f}x asked): a decode-sized message "
              "costs its latency, not its bytes.", pgbs > LATENCY_FACTOR * dgbs,
              t=small.experiment.tokens, dkib=db / 2**10, dus=dus, where=where, dgbs=dgbs,
              T=big.experiment.tokens, pmib=pb / 2**20, pus=pus, pgbs=pgbs, ratio=pgbs / dgbs,
              factor=LATENCY_FACTOR, recorded=recorded),
        claim("Cut into {k} chunks at {t} tokens {where}, the all-reduces cost {cut:.1f}x one "
              "message (at {T:,} tokens, {pk} chunks cost {cut_prefill:.2f}x) and the matmuls "
              "{reread:.1f}x: every chunk reads all of the weights again.",
              cut > cut_prefill and reread > 1.5, k=k, t=small.experiment.tokens, where=where,
              cut=cut, T=big.experiment.tokens, pk=pk, cut_prefill=cut_prefill, reread=reread,
              recorded=recorded),
        claim("At decode sizes {where} overlap cannot help: the best chunk count runs {gains} "
              "as fast as the serial step, no range wholly above 1 (step times are CUDA-event times "
              "of the compute stream{profiled}).",
              not any(g.above(1.0) for g in gains.values()), where=where,
              gains=", ".join(f"{g:.2fx} at {t} tokens" for t, g in gains.items()),
              profiled=profiled, recorded=recorded)]
