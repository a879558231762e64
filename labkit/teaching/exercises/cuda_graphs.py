"""Notebook 02's exercises: the raw capture idiom, then a pool of per-bucket graphs.

02.1: the learner writes PyTorch's own idiom (``torch.cuda.CUDAGraph``, ``with
torch.cuda.graph(g)``, a warm-up on a side stream, ``copy_`` into the static input, ``replay``,
clone what is kept), through a ``cuda`` argument: ``torch.cuda`` on a GPU, labkit's CPU stand-in
(``labkit.graphs.emulated_cuda``) elsewhere, with the same calls and the same frozen tensors.

02.2: the heart of ``labkit.graphs.GraphPool.__call__``: pick the smallest bucket that holds the
batch, copy the batch into the captured input's first rows, replay that bucket's graph, hand
back the real rows (cloned), and run a batch larger than every bucket eagerly.
"""
from __future__ import annotations

import copy
import random

import torch

from labkit.graphs import emulated_cuda
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


class LazyStep(RowStep):
    """A step that sets its scale on its first call from its weights, read back to the host
    (``.item()``): that first call cannot be captured, so it must run before the capture."""

    def __init__(self, width: int, generator: torch.Generator):
        super().__init__(width, generator)
        self.scale: float | None = None

    def forward(self, x):
        if self.scale is None:
            self.scale = 1.0 / float(self.weight.abs().max().item())
        return torch.tanh(x @ self.weight * self.scale) * 2


# ------------------------------------------------------------ 02.1: capture once, replay many
class WatchedCuda:
    """``cuda`` (``torch.cuda`` or the CPU stand-in) whose ``CUDAGraph`` counts captures and
    replays; every other name is ``cuda``'s own."""

    def __init__(self, cuda):
        self._cuda, self.captures, self.replays = cuda, 0, 0
        watched = self

        class CUDAGraph(cuda.CUDAGraph):
            def capture_begin(self, *args, **kwargs):
                watched.captures += 1
                return super().capture_begin(*args, **kwargs)

            def replay(self):
                watched.replays += 1
                return super().replay()

        self.CUDAGraph = CUDAGraph

    def __getattr__(self, name):
        return getattr(self._cuda, name)


def _raw_cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    width, rows = rng.choice([16, 24, 32]), rng.choice([3, 5, 8])

    def batches(n, rows=rows):
        return [torch.randn(rows, width, generator=g).to(device) for _ in range(n)]

    return [Case("one row, two batches", (RowStep(width, g).to(device), *batches(1, 1),
                                          batches(2, 1)))] + [
            Case(label, (step.to(device), batches(1)[0], batches(n)))
            for label, step, n in (
                ("one batch", RowStep(width, g), 1),
                ("three batches in a row: each result must survive the next replays",
                 RowStep(width, g), 3),
                ("a step that sets itself up on its first call (a host read-back): warm it up "
                 "before capturing", LazyStep(width, g), 2))]


def _capture_error(error: BaseException) -> str | None:
    while error is not None:
        if "stream is capturing" in str(error):
            return str(error).strip().splitlines()[0]
        error = error.__context__
    return None


def _raw_run(fn, case: Case) -> dict:
    step, example, batches = case.args
    cuda = WatchedCuda(emulated_cuda.cuda_for(example.device))
    before = example.clone()
    try:
        outs = fn(cuda, step, example, batches)
    except Exception as error:  # a capture that failed: said by _raw_diagnose, not as a crash
        if (why := _capture_error(error)) is None:
            raise
        return {"outputs": None, "capture error": why}
    return {"outputs": outs, "graphs captured": cuda.captures, "replays": cuda.replays,
            "example unchanged": bool(torch.equal(example, before))}


def _raw_expected(case: Case) -> dict:
    step, _, batches = case.args
    reference = copy.deepcopy(step)  # a fresh copy: a lazy step stays unset for the learner
    with torch.no_grad():
        outs = [reference(x) for x in batches]
    return {"outputs": outs, "graphs captured": 1, "replays": len(batches),
            "example unchanged": True}


def _raw_diagnose(case: Case, got: dict, expected: dict) -> str | None:
    step, example, batches = case.args
    if got.get("capture error"):
        return (f"The capture failed ({got['capture error']}): the step reads a value back to "
                "the host on its first call, which no capture allows. Run it on the static input "
                "once or twice before capturing (on a side stream: `side = cuda.Stream()`, "
                "`side.wait_stream(cuda.current_stream())`, `with cuda.stream(side): ...`), so "
                "that first call happens outside the graph.")
    if not got.get("graphs captured") or not got.get("replays"):
        return ("No graph was captured and replayed: that is the step run eagerly. Capture it once "
                "(`g = cuda.CUDAGraph()`, `with cuda.graph(g): static_out = fn(static_in)`), then "
                "`g.replay()` for every batch.")
    if got["graphs captured"] > 1:
        return (f"You captured {got['graphs captured']} graphs for one shape: capture once and "
                "replay it for every batch (a capture costs far more than a replay).")
    if not got.get("example unchanged"):
        return ("`example` changed: you wrote the batches into the caller's tensor. Capture on a "
                "copy of it (`static_in = example.clone()`) and copy_ each batch into that.")
    outs, want = got.get("outputs") or [], expected["outputs"]
    if len(outs) == len(want) > 1 and all(isinstance(o, torch.Tensor) and o.shape == want[-1].shape
                                          and torch.allclose(o, want[-1], atol=1e-4)
                                          for o in outs):
        return ("Every result reads the last batch's output: each is the graph's output buffer, "
                "which every replay overwrites. Return `static_out.clone()` after each replay.")
    with torch.no_grad():
        captured = copy.deepcopy(step)(example)
    if outs and all(isinstance(o, torch.Tensor) and o.shape == captured.shape
                    and torch.allclose(o, captured, atol=1e-4) for o in outs):
        return ("The graph computed on the tensor it was captured with, not on your batches: "
                "`static_in.copy_(x)` before each replay. Rebinding the name (`static_in = x`) "
                "hands the graph nothing; it reads the captured address.")
    return None


def _raw_note(device) -> str:
    if device.type == "cuda":
        return "Checked with torch.cuda: real CUDA Graphs, captured on this GPU."
    return ("No GPU here: `cuda` is labkit.graphs.emulated_cuda, which records the step's ops at "
            "capture and replays them into the same tensors, so it freezes what a CUDA Graph "
            "freezes; on a GPU the same function gets torch.cuda.")


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


RAW = Exercise(
    id="02.1", title="capture once, replay many", entry="capture_and_replay",
    task="capture fn on a copy of example (after a warm-up), then for each batch copy it in, "
         "replay, and keep a clone of the output",
    cases=_raw_cases, run=_raw_run, expected=_raw_expected, diagnose=_raw_diagnose,
    note=_raw_note, atol=1e-4, rtol=1e-4,
    hints=(
        "The static input is yours, not the caller's: `static_in = example.clone()`.",
        "Warm up first, on a side stream: `side = cuda.Stream()`; "
        "`side.wait_stream(cuda.current_stream())`; `with cuda.stream(side): fn(static_in)`; "
        "then `cuda.current_stream().wait_stream(side)`.",
        "`g = cuda.CUDAGraph()`; `with cuda.graph(g): static_out = fn(static_in)`. Then per "
        "batch: `static_in.copy_(x)`, `g.replay()`, keep `static_out.clone()`.",
    ),
    seen="One capture, one replay per batch: the graph reads static_in's address and writes "
         "static_out's, so a batch reaches it only through copy_ and a result survives the next "
         "replay only as a clone. The warm-up runs the step's first-call set-up (here a host "
         "read-back, elsewhere cuBLAS handles or autotuning) outside the capture. This is what "
         "`labkit.graphs.capture_graph` does, and what 02.2's pool does once per bucket.",
)

EXERCISES = [RAW, Exercise(
    id="02.2", title="replay a batch through per-bucket graphs", entry="run_bucketed",
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
