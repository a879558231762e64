"""Batch-1 decode replayed from the engine's own graph, one change at a time, against its floor
(notebook 07a, section 5; recorded by ``make record prefill_vs_decode``; the floor and the
replays are ``benchmarks/decode_floor.py``'s too).

A decode step must read every weight once and each row's KV cache once; at the copy bandwidth
that takes ``floor_ms`` (``step_bytes``), and no step can be faster. The rungs add one change
each to the step before, every rung captured by the engine's runner as a full decode graph:

1. ``eager ops``: each small op of a layer (norms, RoPE, SiLU, residual adds) a torch kernel;
2. ``fused layer kernels``: labkit's three Triton layer kernels (``kernels/layer_ops.py``);
3. ``one-row GEMV``: the matmuls of a one-token step as ``kernels/skinny_linear.py``, the norm
   before a projection and SiLU-times-up after gate_up folded into the weight stream;
4. ``dependent launches``: every Triton kernel of the step launched as a programmatic dependent
   (``kernels/pdl.py``, Hopper): each starts while the kernel ahead finishes, a GEMV loading its
   weights before it waits. Rungs 3 and 4 together are the engine's default for one-token steps
   (on a GPU without PDL, rung 4 is rung 3).

The three replays are timed in the same interleaved rounds, so each rung's gain over the one
before is a ratio per round, with its range.
"""
from __future__ import annotations

import math

import pandas as pd
import torch

from labkit.teaching import claim

RUNGS = {"eager ops": {"fused_ops": False, "skinny": False, "pdl": False},
         "fused layer kernels": {"fused_ops": True, "skinny": False, "pdl": False},
         "one-row GEMV": {"fused_ops": True, "skinny": None, "pdl": False},
         "dependent launches": {"fused_ops": True, "skinny": None, "pdl": None}}  # None: default


def step_bytes(config, batch: int, context: int, elem: int) -> dict:
    """Bytes one decode step must read: every layer's weights, the final norm, the output
    projection, ``batch`` embedding rows, and each row's K and V over ``context`` tokens."""
    c = config
    layer = (c.q_size + 2 * c.kv_size) * c.hidden_size + c.hidden_size * c.q_size + \
        3 * c.intermediate_size * c.hidden_size + 2 * c.hidden_size
    weights = (c.num_hidden_layers * layer + c.hidden_size + c.vocab_size * c.hidden_size +
               batch * c.hidden_size) * elem
    kv = batch * context * c.num_hidden_layers * 2 * c.kv_size * elem
    return {"weight_bytes": weights, "kv_bytes": kv, "bytes": weights + kv}


@torch.inference_mode()
def decode_replay(model, batch: int, context: int, *, fused_ops: bool = True,
                  skinny: bool | None = None, pdl: bool | None = None):
    """(replay, runner): the runner's captured decode graph for ``batch`` rows, each at
    ``context`` tokens of random cache, with its inputs in place. ``skinny``: the skinny
    matmuls for up to 16 rows (True), none (False), or the engine's default (None); ``pdl``:
    programmatic dependent launches off (False) or the default (None)."""
    from contextlib import nullcontext
    from labkit.engine.model import skinny_matmuls
    from labkit.engine.runner import ModelRunner
    from labkit.kernels.pdl import pdl_launches
    block = 16
    per_row = math.ceil((context + 1) / block)
    with nullcontext() if skinny is None else skinny_matmuls(skinny), \
            nullcontext() if pdl is None else pdl_launches(pdl):
        runner = ModelRunner(model, cudagraph_mode="full_decode_only", fused_ops=fused_ops,
                             max_num_seqs=batch, decode_buckets=(batch,),
                             max_model_len=per_row * block, num_blocks=batch * per_row + 1,
                             block_size=block)
    dev = model.embed_tokens.device
    for layer in range(model.config.num_hidden_layers):  # a cache of finite values
        runner.cache.key_cache(layer).normal_()
        runner.cache.value_cache(layer).normal_()
    rows = torch.arange(batch, device=dev, dtype=torch.int32)
    tables = (rows[:, None] * per_row + torch.arange(per_row, device=dev, dtype=torch.int32))
    pos = torch.full((batch,), context - 1, dtype=torch.int32, device=dev)
    slots = tables[:, (context - 1) // block] * block + (context - 1) % block
    ids = torch.randint(0, model.config.vocab_size, (batch,), device=dev, dtype=torch.int32)
    runner.graphs(ids, pos, slots, tables, pos + 1)  # fills the graph's static inputs
    return runner.graphs.graph((batch,)).replay, runner


def kernel_count(fn) -> int:
    """GPU kernels one call of ``fn`` runs (torch.profiler)."""
    from labkit.measure.profile import trace
    events = trace(fn, warmup=1).events
    return int((events.kind == "kernel").sum())


def ladder(model, batch: int = 1, context: int = 1024, rounds: int = 5, repeats: int = 20,
           copy_gbps: float | None = None) -> dict:
    """Each rung's replayed step in the same interleaved rounds: its time (median and range),
    kernels, share of the floor, and its gain over the rung before (per round)."""
    from labkit.device import free_memory
    from labkit.measure.peaks import copy_bandwidth
    from labkit.measure.rounds import interleaved
    dev = model.embed_tokens.device
    copy_gbps = copy_gbps or copy_bandwidth(dev)
    cases, kernels, keep = {}, {}, []
    for name, opts in RUNGS.items():
        cases[name], runner = decode_replay(model, batch, context, **opts)
        keep.append(runner)
        kernels[name] = kernel_count(cases[name])
    timed = interleaved(cases, rounds=rounds, device=dev, repeats=repeats)
    floor_ms = step_bytes(model.config, batch, context, model.embed_tokens.element_size()
                          )["bytes"] / copy_gbps / 1e6
    rows, names = [], list(RUNGS)
    for i, name in enumerate(names):
        t = timed.us(name)
        row = {"rung": name, "ms": t.median / 1e3, "ms_low": t.low / 1e3,
               "ms_high": t.high / 1e3, "kernels": kernels[name],
               "floor_share": floor_ms * 1e3 / t.median, "floor_share_low": floor_ms * 1e3 / t.high,
               "floor_share_high": floor_ms * 1e3 / t.low}
        if i:
            gain = timed.ratio(names[i - 1], name)
            row |= {"gain": gain.median, "gain_low": gain.low, "gain_high": gain.high}
        rows.append(row)
    del cases, keep, timed
    free_memory(dev)
    return {"batch": batch, "context": context, "rounds": rounds, "copy_gbps": copy_gbps,
            "floor_ms": floor_ms, "rows": rows}


def ladder_table(data: dict) -> pd.DataFrame:
    """One row per rung, as a reader takes it in: time with its range, kernels, the share of
    the floor, the gain over the rung above."""
    out = []
    for r in data["rows"]:
        out.append({"rung": r["rung"], "step ms": r["ms"],
                    "range": f"{r['ms_low']:.3f}-{r['ms_high']:.3f}", "kernels": r["kernels"],
                    "of the floor": f"{r['floor_share']:.1%}",
                    "gain over the rung above": (f"{r['gain']:.2f}x ({r['gain_low']:.2f}-"
                                                 f"{r['gain_high']:.2f})" if "gain" in r else "")})
    return pd.DataFrame(out).set_index("rung")


def ladder_claims(data: dict, recorded=None) -> list:
    """Each change faster than the step before it in every round, and where the last stands
    against the floor."""
    rows = data["rows"]
    steps = "; ".join(f"{r['rung']} {r['gain']:.2f}x ({r['gain_low']:.2f}-{r['gain_high']:.2f})"
                      for r in rows[1:])
    last = rows[-1]
    return [claim(
        "Replayed at batch {b} over {ctx} tokens of context, each change made the decode step "
        "faster than the one before in every round ({steps}): from {first:.3f} ms and {k0} "
        "kernels to {end:.3f} ms and {k1}, which is {share:.0%} ({lo:.0%}-{hi:.0%}) of the "
        "{floor:.3f} ms its bytes take at the copy bandwidth.",
        len(rows) > 1 and all(r["gain_low"] > 1.0 for r in rows[1:]), b=data["batch"],
        ctx=data["context"], steps=steps, first=rows[0]["ms"], k0=rows[0]["kernels"],
        end=last["ms"], k1=last["kernels"], share=last["floor_share"],
        lo=last["floor_share_low"], hi=last["floor_share_high"], floor=data["floor_ms"],
        recorded=recorded)]

