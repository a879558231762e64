"""Notebook 02's exercise: replay a batch through a pool of per-bucket graphs.

The learner writes the heart of ``labkit.graphs.GraphPool.__call__``: pick the smallest bucket
that holds the batch, copy the batch into the captured input's first rows, replay that bucket's
graph, hand back the real rows (cloned), and run a batch larger than every bucket eagerly.
"""
from __future__ import annotations

import random

import torch

from labkit.lessons.cuda_graphs import pitfalls as graph_pitfalls
from labkit.teaching.exercises import Case, Exercise


class BucketPool:
    """One graph per batch-size bucket; every graph reads the first rows of ``static_input``.

    ``fn(x: [batch, width]) -> [batch, width]`` works row by row. ``graphs[b].replay()`` reruns
    ``fn`` on ``static_input[:b]`` into ``graphs[b].outputs`` ([b, width], overwritten each time).
    """

    def __init__(self, fn, buckets, width: int, device):
        self.fn = fn
        self.buckets = sorted(buckets)
        self.static_input = torch.zeros(self.buckets[-1], width, device=device)
        self.replayed: list = []  # which bucket each call replayed ("eager" for none)
        self.graphs = {b: _Counted(graph_pitfalls.capture(fn, self.static_input[:b]), b,
                                   self.replayed) for b in self.buckets}


class _Counted:
    """A captured graph whose ``replay()`` also notes its bucket in the pool's list.

    A wrapper, not a patched ``replay`` attribute: that would make each graph reference itself,
    and a graph in a reference cycle is freed by the cyclic collector at an arbitrary moment.
    """

    def __init__(self, graph, bucket: int, replayed: list):
        self._graph, self._bucket, self._replayed = graph, bucket, replayed

    @property
    def outputs(self):
        return self._graph.outputs

    def replay(self) -> None:
        self._replayed.append(self._bucket)
        self._graph.replay()


class RowStep(torch.nn.Module):
    """A stand-in decode step: rows never mix, so padding rows cannot change real ones."""

    def __init__(self, width: int, generator: torch.Generator):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(width, width, generator=generator) / width**0.5,
                                         requires_grad=False)

    def forward(self, x):
        return torch.tanh(x @ self.weight) * 2


BUCKETS = (1, 2, 4, 8)


def _cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    width = rng.choice([16, 24, 32])
    batches = [("one row", [1]), ("3 rows: padded up to bucket 4", [3]),
               ("exactly a bucket (4 rows)", [4]), ("the largest bucket (8 rows)", [8]),
               (f"{(n := rng.randrange(9, 20))} rows: larger than every bucket", [n]),
               ("two calls: 6 rows, then 2", [6, 2]),
               # one graph replayed twice: the second replay rewrites the first call's buffer
               ("two calls in one bucket: 3 rows, then 4", [3, 4])]
    step = RowStep(width, g).to(device)
    return [Case(label, (step, [torch.randn(b, width, generator=g).to(device) for b in calls]))
            for label, calls in batches]


def _bucket(batch: int):
    return next((b for b in BUCKETS if b >= batch), "eager")


def _run(fn, case: Case) -> dict:
    step, batches = case.args
    pool = BucketPool(step, BUCKETS, batches[0].shape[1], batches[0].device)
    outs, used = [], []
    for x in batches:
        before = len(pool.replayed)
        outs.append(fn(pool, x))
        used.append(pool.replayed[before] if len(pool.replayed) > before else "eager")
    return {"output": outs, "bucket replayed": used}


def _expected(case: Case) -> dict:
    step, batches = case.args
    with torch.no_grad():
        return {"output": [step(x) for x in batches],
                "bucket replayed": [_bucket(len(x)) for x in batches]}


def _overwritten(outs, batches, expected) -> str | None:
    """A call's result that, read after the later calls, holds a later call's rows: it is a view
    of the graph's output buffer, which the later replay of the same bucket rewrote."""
    for i, (out, x, want) in enumerate(zip(outs, batches, expected)):
        if not isinstance(out, torch.Tensor) or out.shape != want.shape:
            continue
        for j in range(i + 1, len(outs)):
            later = expected[j]
            if (_bucket(len(batches[j])) == _bucket(len(x)) != "eager" and len(later) >= len(x)
                    and not torch.allclose(out, want, atol=1e-4)
                    and torch.allclose(out, later[:len(x)], atol=1e-4)):
                b = _bucket(len(x))
                return (f"Call {i + 1} ({len(x)} rows) was right when it returned, but by the "
                        f"time it was read it held call {j + 1}'s rows: both replayed the "
                        f"bucket-{b} graph, and the next replay overwrote pool.graphs[{b}].outputs, "
                        "which your result is a view of. Return outputs[:batch].clone().")
    return None


def _diagnose(case: Case, got: dict, expected: dict) -> str | None:
    step, batches = case.args
    outs = got.get("output") or []
    if (overwritten := _overwritten(outs, batches, expected["output"])) is not None:
        return overwritten
    for out, x, want in zip(outs, batches, expected["output"]):
        if not isinstance(out, torch.Tensor):
            return "Return the output rows as a tensor."
        if out.dim() == 2 and len(out) > len(x):
            return (f"You returned {len(out)} rows for a batch of {len(x)}: the extra rows are "
                    "padding the graph computed for nobody. Slice them off.")
        if out.shape == want.shape and len(x) and torch.allclose(
                out, step(torch.zeros_like(x)), atol=1e-4):
            return ("The graph computed on its static input, not on your batch: copy_ the batch "
                    "into pool.static_input[:batch] before replaying.")
    if got.get("bucket replayed") != expected["bucket replayed"]:
        return (f"Buckets replayed: {got.get('bucket replayed')}; the smallest bucket that holds "
                f"each batch: {expected['bucket replayed']}. A bigger graph gives the same rows "
                "but computes more padding; a batch no graph holds runs eagerly (pool.fn).")
    return None


def _note(device) -> str:
    if device.type == "cuda":
        return "Checked with real CUDA Graphs, one per bucket, captured on this GPU."
    return ("No GPU here: each bucket is captured by labkit's stand-in, which freezes the same "
            "tensors and output buffers a CUDA Graph does.")


EXERCISES = [Exercise(
    id="02.1", title="replay a batch through per-bucket graphs", entry="run_bucketed",
    task="return pool.fn(x), replayed from the smallest graph that holds the batch (eagerly when "
         "none does)",
    cases=_cases, run=_run, expected=_expected, diagnose=_diagnose, note=_note,
    atol=1e-4, rtol=1e-4,
    hints=(
        "`pool.buckets` is sorted: the first bucket `>= len(x)` is the one to use; if there is "
        "none, return `pool.fn(x)` (eager).",
        "Every graph reads the first rows of `pool.static_input`: `pool.static_input[:len(x)]"
        ".copy_(x)`. The rows after it up to the bucket are padding (zero them if you like).",
        "After `pool.graphs[bucket].replay()`, the result is in `pool.graphs[bucket].outputs`, "
        "all `bucket` rows of it: return `outputs[:len(x)].clone()`.",
    ),
    seen="Batches of 1, 4 and 8 rows replay their own graph; 3 rows replay the bucket-4 graph "
         "with one padding row thrown away; a batch larger than every bucket runs eagerly. Two "
         "calls that land in the same bucket replay one graph into one output buffer, so the "
         "first result survives the second call only as a clone. This "
         "is `GraphPool.__call__` in `labkit/graphs/pool.py`, and what vLLM and SGLang do for every "
         "decode step: pad to a captured size, replay, slice.",
)]
