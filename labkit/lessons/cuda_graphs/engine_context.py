"""Should the engine key its decode graphs by context too? The experiment behind the answer.

A full decode graph freezes the attention kernel's launch plan, and labkit's split-KV plan
depends on the context it is planned for: keyed by batch alone, each graph is planned for
``max_model_len``. Keyed by (batch, context bucket), each key plans for its bucket. Two runners
over one model differ only in that: each replays its decode graph for a batch at a short and a
long context, taking turns in interleaved rounds (GPU time by CUDA events over a run of
replays), and each reports what its graphs cost to capture and hold.
"""
from __future__ import annotations

import random
import time

import torch

from labkit import check_positive_int
from labkit.device import free_memory
from labkit.engine import LlamaModel, ModelRunner
from labkit.engine.cudagraphs import PAD
from labkit.measure.rounds import Spread


def _inputs(runner: ModelRunner, batch: int, context: int):
    """A decode batch at ``context`` tokens each: row i reads its own blocks; no slot is
    written (slot -1), so the cache stays as it was."""
    dev, nb = runner.device, runner.max_blocks_per_seq
    need = -(-context // runner.block_size)
    tables = torch.full((batch, nb), PAD, dtype=torch.int32, device=dev)
    for i in range(batch):
        tables[i, :need] = torch.arange(i * need, (i + 1) * need, dtype=torch.int32)
    ids = torch.zeros(batch, dtype=torch.int32, device=dev)
    positions = torch.full((batch,), context - 1, dtype=torch.int32, device=dev)
    slots = torch.full((batch,), PAD, dtype=torch.int32, device=dev)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    return ids, positions, slots, tables, lens


@torch.inference_mode()
def context_key_rounds(model: LlamaModel, *, batch: int = 8, contexts=(512, 32768),
                       context_buckets=(512, 2048, 8192), rounds: int = 5,
                       replays: int = 20, seed: int = 0) -> dict:
    """Decode-step GPU time (us) at each of ``contexts`` for a runner keyed by batch only and
    one keyed by (batch, context bucket), per round; capture ms, graph count and graph memory
    of each. Needs CUDA (full graphs)."""
    check_positive_int("batch", batch)
    check_positive_int("rounds", rounds, hint="interleaved rounds")
    if rounds < 3:
        raise ValueError(f"rounds must be at least 3 for a range, got {rounds}")
    dev = model.embed_tokens.device
    if dev.type != "cuda":
        raise ValueError("context-keyed decode graphs are full CUDA Graphs: run on a GPU")
    longest, block_size = max(contexts), 16
    blocks = batch * -(-longest // block_size) + 1  # every row its own blocks at the longest
    runners, out = {}, {"batch": batch, "contexts": list(contexts),
                        "context_buckets": list(context_buckets), "rounds": rounds}
    for name, keys in (("by_batch", None), ("by_batch_and_context", context_buckets)):
        t0 = time.perf_counter()
        r = ModelRunner(model, num_blocks=blocks, block_size=block_size, max_model_len=longest,
                        max_num_seqs=batch, decode_buckets=(batch,),
                        cudagraph_mode="full_decode_only", decode_context_buckets=keys)
        [mem] = r.graph_memory()
        out[name] = {"keys": len(r.graphs.keys()), "build_s": time.perf_counter() - t0,
                     "capture_ms": mem["capture_ms"], "graph_MiB": mem["measured_bytes"] / 2**20,
                     "us": {str(c): [] for c in contexts}}
        runners[name] = r
    inputs = {c: _inputs(runners["by_batch"], batch, c) for c in contexts}
    cells = [(n, c) for n in runners for c in contexts]
    for n, c in cells:  # warm: the first replay of each key
        runners[n].graphs(*inputs[c], context=c if runners[n].decode_context_buckets else None)
    rng = random.Random(seed)
    for _ in range(rounds):
        for n, c in rng.sample(cells, len(cells)):
            runner = runners[n]
            ctx = c if runner.decode_context_buckets else None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(replays):
                runner.graphs(*inputs[c], context=ctx)
            end.record()
            torch.cuda.synchronize()
            out[n]["us"][str(c)].append(start.elapsed_time(end) * 1e3 / replays)
    runners.clear()
    free_memory(dev)
    return out


def keyed_gain(result: dict, context: int) -> Spread:
    """Batch-keyed step time over context-keyed, round by round, at ``context``."""
    a = result["by_batch"]["us"][str(context)]
    b = result["by_batch_and_context"]["us"][str(context)]
    return Spread.of([x / y for x, y in zip(a, b)])


def record() -> dict:
    """`make record`: bench_1b (bf16, 32k positions) at batch 1 and 8 over 512 and 32,768
    tokens of context, and at batch 64 over 512 and 4,096."""
    from labkit.engine import ModelConfig, random_model

    model = random_model(ModelConfig.bench_1b(max_position_embeddings=32768), seed=0,
                         device=torch.device("cuda"), dtype=torch.bfloat16, fused_ops=True)
    return {"runs": [context_key_rounds(model, batch=1, contexts=(512, 32768)),
                     context_key_rounds(model, batch=8, contexts=(512, 32768)),
                     context_key_rounds(model, batch=64, contexts=(512, 4096))]}


NOT_SLOWER = 0.97  # keyed / batch-keyed step time within this at the long context: no loss


def engine_context_claims(runs: list[dict], *, recorded=None, device=None) -> list:
    """Per measured batch: the keyed graphs' gain at the short and the long context, round by
    round, and what each extra key costs. Holds where the keyed graphs lose nothing at the long
    context (every round within ``NOT_SLOWER``); the sentence says whether they win at the
    short one (the whole range above 1)."""
    from labkit.lessons.cuda_graphs.claims import where
    from labkit.teaching import claim

    on, made = where(recorded, device), []
    for r in runs:
        short, long = min(r["contexts"]), max(r["contexts"])
        g_short, g_long = keyed_gain(r, short), keyed_gain(r, long)
        plain, keyed = r["by_batch"], r["by_batch_and_context"]
        extra = keyed["keys"] - plain["keys"]
        ms = (keyed["capture_ms"] - plain["capture_ms"]) / max(extra, 1)
        mib = (keyed["graph_MiB"] - plain["graph_MiB"]) / max(extra, 1)
        verdict = ("the keyed graphs win at short context without losing at long" if
                   g_short.above(1.0) else "the keyed graphs win nothing measurable")
        made.append(claim(
            "Batch {b}{on}: keyed by context, the decode step's GPU time at {short:,} tokens is "
            "{gs:.3fx} the batch-keyed graph's speed and at {long:,} tokens {gl:.3fx}: {v}; each "
            "of the {extra} extra keys costs {ms:.0f} ms of capture and {mib:.1f} MiB.",
            g_long.low >= NOT_SLOWER, b=r["batch"], on=on, short=short, long=long, gs=g_short,
            gl=g_long, v=verdict, extra=extra, ms=ms, mib=mib, recorded=recorded))
    return made


WORTH_A_KEY = 1.05  # a gain a graph per context bucket must clear in every round to be kept


def default_claim(runs: list[dict], *, recorded=None, device=None):
    """The engine's default, one decode graph per batch bucket (``decode_context_buckets``
    None), against the measured batches: it holds where at no batch the context-keyed graphs
    gain ``WORTH_A_KEY`` or more at the short context in every round while losing nothing at
    the long one. Each key costs a capture and, at a new split plan, a kernel compile."""
    from labkit.lessons.cuda_graphs.claims import where
    from labkit.teaching import claim

    gains = {r["batch"]: (keyed_gain(r, min(r["contexts"])), keyed_gain(r, max(r["contexts"])))
             for r in runs}
    worth = [b for b, (short, long) in gains.items()
             if short.above(WORTH_A_KEY) and long.low >= NOT_SLOWER]
    best = max(gains, key=lambda b: gains[b][0].median)
    return claim(
        "Each sequence's keys are dealt over the splits from its own length on the device, so "
        "a graph planned for the longest context serves a short one too: keyed by context, the "
        "step is at best {g:.3fx} the batch-keyed graph's speed at short context (batch {b}"
        "{on}), under the {worth:.2f}x a key per context bucket must win in every round. The "
        "engine keeps one decode graph per batch bucket (decode_context_buckets=None).",
        not worth, g=gains[best][0], b=best, on=where(recorded, device), worth=WORTH_A_KEY,
        recorded=recorded)


def table(runs: list[dict]):
    """One row per (batch, context): each runner's median step us and the keyed gain with its
    range over the rounds."""
    import pandas as pd

    rows = []
    for r in runs:
        for c in r["contexts"]:
            gain = keyed_gain(r, c)
            rows.append({"batch": r["batch"], "context": c,
                         "batch-keyed us": Spread.of(r["by_batch"]["us"][str(c)]).median,
                         "context-keyed us": Spread.of(
                             r["by_batch_and_context"]["us"][str(c)]).median,
                         "gain (range)": f"{gain:.3fx}"})
    return pd.DataFrame(rows).round(1)
