"""Decode at batch 1, 8 and 64, replayed from the engine's full decode graph, against its floor.

    python benchmarks/decode_floor.py --out results/     # bench_1b bf16 on a GPU

A decode step must read every weight once and each row's KV cache once; at the measured copy
bandwidth that takes ``floor_ms``, and nothing can run faster. Per batch (context 1,024 tokens
each row), the engine's runner captures its decode graph with the fused layer ops, once with
cuBLAS for every matmul and once with ``kernels/skinny_linear.py`` for steps of at most 16 rows
(the norm and SiLU folded in), and both replays are timed in interleaved rounds:
``floor_fraction`` = floor / step time. The kernel census of each replay (torch.profiler) says
where the time goes; ``--linears`` adds each projection alone over the 16 layers' weights,
cuBLAS against skinny_linear's tile choices.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from unittest.mock import patch

import pandas as pd
import torch

import labkit  # noqa: F401  (device set-up before anything imports triton)
from labkit.device import describe, fingerprint, free_memory
from labkit.engine import ModelConfig, random_model
from labkit.engine.model import FusedOps
from labkit.graphs import capture_graph
from labkit.lessons.prefill_vs_decode import ladder
from labkit.kernels.skinny_linear import TUNED, skinny_linear
from labkit.measure.bench import flush_needed, l2_statement, measure
from labkit.measure.peaks import copy_bandwidth
from labkit.measure.profile import trace
from labkit.measure.rounds import interleaved

TARGET = 0.70  # issue "torch.compile inside the engine": batch-1 decode at 70% of the floor


def kernel_census(fn) -> pd.DataFrame:
    """One call of ``fn`` under the profiler: per kernel name, its count and total time."""
    events = trace(fn, warmup=1).events
    k = events[events.kind == "kernel"]
    table = k.groupby("name").dur_us.agg(["count", "sum"]).sort_values("sum", ascending=False)
    return table.rename(columns={"sum": "us"}).reset_index()


def decode_floor(model, batches=(1, 8, 64), context: int = 1024, rounds: int = 5,
                 repeats: int = 20, copy_gbps: float | None = None,
                 rope_kernel: bool = False) -> dict:
    """``rope_kernel``: at batch 1 a third replay, the skinny one with RoPE in its own kernel
    (``FusedOps.rope_in_gemv`` off, as before it was folded into the q/k/v GEMV), in the same
    rounds: ``rope_gain`` is its time over the default skinny replay's."""
    dev, elem = model.embed_tokens.device, model.embed_tokens.element_size()
    copy_gbps = copy_gbps or copy_bandwidth(dev)
    rows, census = [], {}
    for batch in batches:
        cases, keep = {}, []
        rope_default = FusedOps.rope_in_gemv
        variants = [("cublas", False, rope_default), ("skinny", True, rope_default)]
        if rope_kernel and batch == 1:
            variants.append(("skinny, rope kernel", True, False))
        for name, skinny, rope in variants:
            with patch.object(FusedOps, "rope_in_gemv", rope):
                replay, runner = ladder.decode_replay(model, batch, context, skinny=skinny)
            cases[name] = replay
            keep.append(runner)
            table = kernel_census(replay)
            census[f"B{batch} {name}"] = table.head(25).to_dict(orient="list") | {
                "kernels": int(table["count"].sum()), "busy_us": float(table.us.sum())}
        timed = interleaved(cases, rounds=rounds, device=dev, repeats=repeats)
        cost = ladder.step_bytes(model.config, batch, context, elem)
        floor_ms = cost["bytes"] / copy_gbps / 1e6
        for name in cases:
            t = timed.us(name)
            rows.append({"batch": batch, "context": context, "matmuls": name,
                         "ms": t.median / 1e3, "ms_low": t.low / 1e3, "ms_high": t.high / 1e3,
                         "floor_ms": floor_ms, "floor_fraction": floor_ms / (t.median / 1e3),
                         "floor_fraction_low": floor_ms / (t.high / 1e3),
                         "floor_fraction_high": floor_ms / (t.low / 1e3),
                         "kernels": census[f"B{batch} {name}"]["kernels"], **cost,
                         "l2": l2_statement(cost["bytes"], dev)})  # the weights alone: 2+ GB
        gain = timed.ratio("cublas", "skinny")
        skinny_row = next(r for r in rows if r["batch"] == batch and r["matmuls"] == "skinny")
        skinny_row["skinny_gain"] = gain.median
        skinny_row["skinny_gain_low"], skinny_row["skinny_gain_high"] = gain.low, gain.high
        if "skinny, rope kernel" in cases:
            rope_gain = timed.ratio("skinny, rope kernel", "skinny")
            rope_row = next(r for r in rows
                            if r["batch"] == batch and r["matmuls"] == "skinny, rope kernel")
            rope_row |= {"rope_gain": rope_gain.median, "rope_gain_low": rope_gain.low,
                         "rope_gain_high": rope_gain.high}
        del cases, keep, timed
        free_memory(dev)
    return {"rows": rows, "census": census, "copy_gbps": copy_gbps,
            "copy_l2": l2_statement(2**30, dev)}  # copy_bandwidth's 1 GiB source


ONE_ROW = [dict(gemv=True, block_n=bn, num_warps=w, num_stages=3, block_k=bk)
           for bn, w, bk in ((1, 2, 2048), (2, 2, 1024), (2, 4, 2048), (4, 2, 512), (4, 4, 1024),
                             (8, 4, 512), (16, 4, 512), (32, 8, 512))]
MANY_ROWS = [dict(gemv=False, block_n=bn, num_warps=w, num_stages=st)
             for bn, w, st in ((16, 4, 3), (16, 4, 4), (32, 4, 4), (64, 8, 4))]


def linears(model, rows: int = 1, configs: list[dict] | None = None) -> pd.DataFrame:
    """Each projection alone, over the 16 layers' weights in one graph (no weight read twice
    from L2): cuBLAS (with the separate norm and SiLU kernels where the layer runs them)
    against skinny_linear at each tile of ``configs``."""
    c, dev, dtype = model.config, model.embed_tokens.device, model.embed_tokens.dtype
    configs = configs or (ONE_ROW if rows == 1 else MANY_ROWS)
    x = torch.randn(rows, c.hidden_size, device=dev, dtype=dtype)
    r = torch.randn_like(x)
    xi = torch.randn(rows, c.intermediate_size, device=dev, dtype=dtype)
    layers = model.layers
    kinds = {
        "qkv (norm)": (x, [(lay.qkv_proj, lay.input_norm) for lay in layers], False),
        "o": (x, [(lay.o_proj, None) for lay in layers], False),
        "gate_up (norm, silu)": (x, [(lay.gate_up_proj, lay.post_attention_norm)
                                     for lay in layers], True),
        "down": (xi, [(lay.down_proj, None) for lay in layers], False),
        "lm_head": (x, [(model.output_weight, None)], False),
    }
    out = []
    for kind, (inp, ws, gated) in kinds.items():
        nbytes = sum(w.numel() * w.element_size() for w, _ in ws)
        n = ws[0][0].shape[0] // (2 if gated else 1)
        flush = flush_needed(nbytes, dev)  # lm_head's 125 MiB is near twice an H200's L2

        def cublas(inp=inp, ws=ws, gated=gated):
            for w, nw in ws:
                h = FusedOps.add_rms_norm(inp, r, nw, 1e-5)[0] if nw is not None else inp
                y = torch.nn.functional.linear(h, w)
                if gated:
                    FusedOps.silu_mul(y)

        impls = {"cublas": (cublas, None)}
        for cfg in configs:
            def sk(inp=inp, ws=ws, gated=gated, cfg=cfg):
                for w, nw in ws:
                    skinny_linear(inp, w, residual=r if nw is not None else None,
                                  norm_weight=nw, eps=1e-5, gated=gated, **cfg)
            impls["skinny " + " ".join(f"{k}={v}" for k, v in cfg.items())] = (sk, cfg)
        for name, (fn, cfg) in impls.items():
            graph, _ = capture_graph(fn, warmup=2)
            t = measure(graph.replay, device=dev, warmup=3, repeats=20, flush_l2=flush)
            out.append({"kind": kind, "rows": rows, "impl": name, "us_per_call":
                        t.median_us / len(ws), "gbps": nbytes / (t.median_us * 1e3),
                        "weight_mb": nbytes / len(ws) / 1e6, "n": n, "k": ws[0][0].shape[1],
                        "gated": gated, "config": cfg,
                        "l2": l2_statement(nbytes, dev, flushed=flush)})
            del graph
    return pd.DataFrame(out)


def tune(table: pd.DataFrame) -> pd.DataFrame:
    """Per projection and row count, the fastest skinny tile goes into ``TUNED`` (so this
    run's skinny decode uses it), beside cuBLAS's time for the same work."""
    chosen = []
    for (kind, rows), g in table.groupby(["kind", "rows"], sort=False):
        skinny = g[g.impl != "cublas"].sort_values("us_per_call")
        best = skinny.iloc[0]
        TUNED[(rows == 1, int(best.n), int(best.k), bool(best.gated))] = dict(best.config)
        chosen.append({"kind": kind, "rows": rows, "cublas_us": float(
            g[g.impl == "cublas"].us_per_call.iloc[0]), "skinny_us": float(best.us_per_call),
            "tile": best.impl})
    return pd.DataFrame(chosen)


def main(out: Path | None, with_linears: bool, batches, rope_kernel: bool = False) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("decode_floor needs a CUDA device: it replays CUDA Graphs")
    print(describe())
    model = random_model(ModelConfig.bench_1b(), seed=0, device="cuda", dtype=torch.bfloat16,
                         fused_ops=True)
    results = {"fingerprint": fingerprint(), "target": TARGET}
    if with_linears:
        table = pd.concat([linears(model, rows) for rows in (1, 8)])
        chosen = tune(table)
        print(chosen.to_string(index=False))
        print("\n".join(f"L2: {line}" for line in dict.fromkeys(table.l2)))
        results["linears"] = table.drop(columns="config").to_dict(orient="list")
        results["tuned"] = chosen.to_dict(orient="list")
    floor = decode_floor(model, batches, rope_kernel=rope_kernel)
    results.update(floor)
    df = pd.DataFrame(floor["rows"])
    print(f"copy bandwidth {floor['copy_gbps']:.0f} GB/s; L2: {floor['copy_l2']}")
    print(df[["batch", "matmuls", "ms", "ms_low", "ms_high", "floor_ms", "floor_fraction",
              "kernels"]].to_string(index=False))
    print("\n".join(f"L2: {line}" for line in dict.fromkeys(df.l2)))
    for b in batches:
        for name in ("cublas", "skinny"):
            c = floor["census"][f"B{b} {name}"]
            print(f"-- B{b} {name}: {c['kernels']} kernels, busy {c['busy_us']:.0f} us")
            print(pd.DataFrame({k: c[k] for k in ("name", "count", "us")}).head(12).to_string(
                index=False, max_colwidth=70))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "decode_floor.json").write_text(json.dumps(results, indent=1, default=str))
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--linears", action="store_true", help="each projection alone too")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--rope-kernel", action="store_true",
                        help="at batch 1, race RoPE in its own kernel against the default "
                             "(folded into the q/k/v GEMV)")
    args = parser.parse_args()
    main(args.out, args.linears, tuple(args.batches), args.rope_kernel)
