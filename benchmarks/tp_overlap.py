"""Tensor-parallel MLP on 2 GPUs: the all-reduce after the layer against overlapped with compute.

    python benchmarks/tp_overlap.py --out results/                    # spawns its 2 ranks
    torchrun --nproc-per-node 2 benchmarks/tp_overlap.py --out results/

For each ffn size (prefill-sized) and each decode-sized token count, every chunk count is timed
on both ranks in interleaved, shuffled rounds (the slowest rank counts): the serial step, the
overlapped step and the sequential step (the chunks' matmuls, then their all-reduces: its two
halves are the compute and the comm the bounds use). Per round: overlap efficiency =
max(compute, comm) / overlapped (at most 1), speed-up = serial / overlapped, printed as the
median with its range over the rounds; a speed-up is a gain only when its whole range is above 1,
and a bounded metric past 1 in every round is printed as out of model. Writes tp_overlap.csv and
tp_overlap.json (with both ranks' traces). With fewer than 2 GPUs it runs gloo on the CPU at
small sizes and says so: CPU numbers show the mechanics, not what a GPU gains. NVLink multicast
is off (NCCL_NVLS_ENABLE=0). Each run states what its steps read from (``l2``): at every default
size one rank's input and weight shards are over twice the L2, so nothing is flushed.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import labkit
from labkit.distributed import tensor_parallel as tp
from labkit.distributed.rank_runner import launched_by_torchrun, pick_backend
from labkit.lessons import multi_gpu_overlap as mgo
from labkit.measure.bench import l2_statement

CPU_SHAPES = {"tokens": 512, "hidden": 1024, "dtype": "float32", "chunk_counts": (1, 2, 4, 8),
              "trace_chunks": 4, "warmup": 2, "repeats": 20, "rounds": 3}
CPU_FFN_SIZES = (1024,)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(","))


def l2_of(exp: mgo.TPExperiment, backend: str) -> str:
    """What one rank's timed step reads: its x [tokens, hidden] and its shards of w1 and w2
    (hidden x ffn/2 each). A size that fits in twice the L2 is refused before anything runs."""
    if backend != "nccl":
        return "not controlled: gloo on the CPU shows the mechanics, not what the caches do"
    elem = tp.DTYPES[exp.dtype].itemsize
    return l2_statement((exp.tokens * exp.hidden + exp.hidden * exp.ffn) * elem, "cuda")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--backend", default="auto", choices=["auto", "nccl", "gloo"])
    parser.add_argument("--ffn", type=_ints, help="comma-separated ffn sizes (full layer)")
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--dtype", choices=list(tp.DTYPES))
    parser.add_argument("--chunks", type=_ints, help="comma-separated chunk counts")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--rounds", type=int, help="interleaved rounds (at least 3)")
    parser.add_argument("--decode", type=_ints, help="comma-separated decode-sized token counts "
                        f"(default on GPUs: {','.join(map(str, mgo.DECODE_TOKENS))}; none on CPU)")
    args = parser.parse_args(argv)

    backend = pick_backend(args.backend, world_size=2)
    shapes, ffn_sizes = ((mgo.GPU_SHAPES, mgo.GPU_FFN_SIZES) if backend == "nccl"
                         else (CPU_SHAPES, CPU_FFN_SIZES))
    overrides = {k: v for k, v in {"tokens": args.tokens, "hidden": args.hidden,
                                   "dtype": args.dtype, "chunk_counts": args.chunks,
                                   "repeats": args.repeats, "rounds": args.rounds}.items()
                 if v is not None}
    shapes = {**shapes, **overrides}
    exps = [mgo.TPExperiment(ffn=ffn, **shapes) for ffn in (args.ffn or ffn_sizes)]
    base = mgo.DECODE_SHAPES if backend == "nccl" else {**shapes, "ffn": ffn_sizes[0],
                                                         "chunk_counts": (1, 2, 4, 8)}
    decode_shapes = {k: v for k, v in {**base, **overrides}.items() if k != "tokens"}
    decode_shapes["chunk_counts"] = base["chunk_counts"]  # a decode step has few tokens to cut
    exps += [mgo.TPExperiment(tokens=tokens, **decode_shapes)
             for tokens in args.decode or (mgo.DECODE_TOKENS if backend == "nccl" else ())]
    l2 = [l2_of(e, backend) for e in exps]
    runs = [mgo.run_experiment(e, world_size=2, backend=backend) for e in exps]
    if launched_by_torchrun() and os.environ["RANK"] != "0":
        return 0

    print(labkit.device.describe())
    print(f"backend {backend}, 2 ranks" + ("" if backend == "nccl" else
          " on the CPU (fewer than 2 GPUs): mechanics only, not GPU numbers"))
    rows = []
    for run, run_l2 in zip(runs, l2):
        e = run.experiment
        table = run.table.assign(tokens=e.tokens, hidden=e.hidden, ffn=e.ffn, dtype=e.dtype,
                                 backend=backend, l2=run_l2)
        table["compute_over_comm"] = table.compute_us / table.comm_us
        rows.append(table)
        print(f"\ntokens {e.tokens}, hidden {e.hidden}, ffn {e.ffn} ({e.ffn // 2} per rank), "
              f"{e.dtype}; worst relative error against one "
              f"device: {run.errors.max().max():.1e}; L2: {run_l2}")
        print(table[["num_chunks", "serial_us", "overlapped_us", "compute_us", "comm_us",
                     "compute_over_comm", "pipeline_us", "efficiency", "of_pipeline",
                     "speedup", "speedup_low", "speedup_high", "out_of_model"]].to_string(
            index=False, float_format=lambda v: f"{v:,.3f}"))
        best = run.best_chunks()
        gain = run.spreads(best)["speedup"]
        print(f"best: {best} chunks, speed-up {gain:.3fx}: {mgo.gain_verdict(gain)}")
    args.out.mkdir(parents=True, exist_ok=True)
    import pandas as pd

    pd.concat(rows).to_csv(args.out / "tp_overlap.csv", index=False)
    (args.out / "tp_overlap.json").write_text(json.dumps(
        {"fingerprint": labkit.fingerprint(), "backend": backend,
         "runs": [r.to_dict() | {"l2": s} for r, s in zip(runs, l2)]}) + "\n")
    print(f"\nwrote {args.out / 'tp_overlap.csv'} and {args.out / 'tp_overlap.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
