"""Notebook 01's exercise: feed a captured chain of tiny kernels new data.

A CUDA Graph replays the kernels it recorded on the addresses it recorded. To run it on new
data the learner must write the data *into* the captured input (``copy_``) and copy the result
*out* of the captured output before the next replay overwrites it. On a CPU the chain is
captured by labkit's stand-in (``labkit.lessons.cuda_graphs.pitfalls.capture``), which freezes the same
things a graph does, so the same mistakes give the same wrong numbers.
"""
from __future__ import annotations

import random

import torch

from labkit.lessons.cuda_graphs import pitfalls as graph_pitfalls
from labkit.lessons import launch_overhead
from labkit.teaching.exercises import Case, Exercise


class CapturedChain:
    """``n_kernels`` tiny kernels on ``static_input: [numel]``, captured once.

    ``replay()`` reruns them on whatever ``static_input`` holds and writes the result into
    ``static_output`` (the same tensor every time).
    """

    def __init__(self, numel: int, n_kernels: int, device):
        self.static_input = torch.zeros(numel, device=device)
        self._graph = graph_pitfalls.capture(
            lambda x: launch_overhead.tiny_kernels(x.clone(), n_kernels), self.static_input)
        self.static_output = self._graph.outputs

    def replay(self) -> None:
        self._graph.replay()


def _cases(seed: int, device) -> list[Case]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    sizes = [("one element", 1), ("an odd size (7)", 7), ("4,096 elements", 4096),
             (f"{(n := rng.randrange(100, 3000))} elements", n)]
    cases = []
    for label, numel in sizes:
        x1, x2 = (torch.randn(numel, generator=g).to(device) for _ in range(2))
        cases.append(Case(label, (numel, rng.randrange(3, 12), x1, x2)))
    return cases


def _run(fn, case: Case) -> dict:
    numel, n_kernels, x1, x2 = case.args
    chain = CapturedChain(numel, n_kernels, x1.device)
    first = fn(chain, x1)
    second = fn(chain, x2)  # a second replay: must not change what the first call returned
    return {"first result": first, "second result": second}


def _expected(case: Case) -> dict:
    _, n_kernels, x1, x2 = case.args
    return {"first result": x1 + n_kernels, "second result": x2 + n_kernels}


def _diagnose(case: Case, got: dict, expected: dict) -> str | None:
    _, n_kernels, _, x2 = case.args
    first = got.get("first result")
    if not isinstance(first, torch.Tensor) or first.shape != x2.shape:
        return None
    if torch.allclose(first, torch.full_like(first, float(n_kernels))):
        return ("The chain ran on the zeros it was captured with: it never saw x. Write x into "
                "chain.static_input with copy_ (assigning a new tensor to the name changes "
                "nothing the graph reads).")
    if torch.allclose(first, x2 + n_kernels):
        return ("Your first result changed when the chain was replayed for the second input: "
                "you handed back chain.static_output itself, which every replay overwrites. "
                "Return a clone.")
    return None


def _note(device) -> str:
    if device.type == "cuda":
        return "Checked with a real CUDA Graph captured on this GPU."
    return ("No GPU here: the chain is captured by labkit's stand-in, which freezes what a CUDA "
            "Graph freezes (the input tensor it was given, its output buffer), so the same "
            "mistakes fail the same way; it does not time anything.")


EXERCISES = [Exercise(
    id="01.1", title="feed a captured chain new data", entry="run_captured",
    task="make the captured chain run on x and return its result (still right after the next "
         "replay)",
    cases=_cases, run=_run, expected=_expected, diagnose=_diagnose, note=_note,
    hints=(
        "A graph replays the kernels it recorded, on the memory it recorded. Which tensor did it "
        "record as its input? (`chain.static_input`)",
        "`chain.static_input.copy_(x)` writes x into that memory; `chain.static_input = x` only "
        "points a Python name somewhere else.",
        "The output is a fixed buffer too, and the next `replay()` writes into it: return "
        "`chain.static_output.clone()`.",
    ),
    seen="Copying into the captured input and cloning the output gives the right answer on every "
         "input. Rebinding the name returns the capture-time answer (silently), and keeping the "
         "output buffer returns a value that changes under you at the next replay. An engine does "
         "exactly this every decode step: `copy_` the batch's token ids, positions and block tables "
         "into static buffers, replay, read the logits out.",
)]
