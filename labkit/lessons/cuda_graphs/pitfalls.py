"""The ways a CUDA Graph silently (or loudly) goes wrong, each as a function notebook 02 runs.

A graph freezes, at capture: the tensors it reads and writes (their addresses), every Python
value and branch taken while capturing, and the storage of its outputs. ``capture()`` returns a
real ``torch.cuda.CUDAGraph`` on a GPU; on a CPU, a stand-in that freezes exactly the same three
things (the bound tensor objects, the Python arguments, the output storage), so the silent
pitfalls show the same wrong numbers live on either. The loud ones (a host sync during capture)
exist only on a GPU; on a CPU the notebook shows the message recorded on one.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import torch

from labkit.device import synchronize
from labkit.graphs import capture_graph


class Captured:
    """``.replay()`` recomputes into ``.outputs`` from what was bound at capture."""

    def __init__(self, fn: Callable, args: tuple, warmup: int):
        self.fn, self.args = fn, args
        self.graph = None
        if args and isinstance(args[0], torch.Tensor) and args[0].is_cuda:
            self.graph, self.outputs = capture_graph(lambda: fn(*args), warmup)
        else:
            for _ in range(warmup):
                fn(*args)
            self.outputs = fn(*args)

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:  # same objects, same Python values, results written into the same storage
            self.outputs.copy_(self.fn(*self.args))


def capture(fn: Callable, *args, warmup: int = 2) -> Captured:
    return Captured(fn, args, warmup)


def step(x: torch.Tensor) -> torch.Tensor:
    """A stand-in decode step: any elementwise work will do."""
    return x * 2 + 1


def rebinding_vs_copy(device) -> dict:
    """``static_in = next_batch`` rebinds a Python name; the graph keeps reading the old tensor."""
    static_in = torch.zeros(4, device=device)
    g = capture(step, static_in)
    next_batch = torch.arange(4.0, device=device)
    expected = step(next_batch)
    static_in = next_batch          # the bug: a new object, unknown to the graph
    g.replay()
    synchronize(device)
    stale = g.outputs.clone()
    g.args[0].copy_(next_batch)     # the fix: write into the captured buffer
    g.replay()
    synchronize(device)
    fixed = g.outputs.clone()
    return {"expected": expected.tolist(), "after_rebinding": stale.tolist(),
            "after_copy_": fixed.tolist(), "rebinding_is_stale": not torch.equal(stale, expected),
            "copy_is_right": torch.equal(fixed, expected)}


def output_overwritten(device) -> dict:
    """The output tensor *is* the graph's buffer: keep it and the next replay changes it."""
    static_in = torch.zeros(4, device=device)
    g = capture(step, static_in)
    static_in.copy_(torch.full((4,), 1.0, device=device))
    g.replay()
    first = g.outputs                # a reference, not a copy
    synchronize(device)
    first_value = first.clone()
    static_in.copy_(torch.full((4,), 10.0, device=device))
    g.replay()
    synchronize(device)
    return {"first_result_then": first_value.tolist(), "first_result_now": first.tolist(),
            "kept_reference_changed": not torch.equal(first, first_value),
            "clone_would_have_kept": first_value.tolist()}


def attend_prefix(q: torch.Tensor, keys: torch.Tensor, context_len: int) -> torch.Tensor:
    """Scores over the first ``context_len`` keys, with a kernel picked by length on the host."""
    scores = keys[:context_len] @ q
    if context_len > 64:            # "long context": a two-pass, split-style reduction
        m = torch.stack([c.max() for c in scores.chunk(2)]).max()
        p = (scores - m).exp()
        return (p.max() / p.sum()).reshape(1)
    return scores.softmax(0).max().reshape(1)


def frozen_choice(device) -> dict:
    """A host-side value used while capturing (a length, a branch) is frozen into the graph."""
    keys, q = torch.randn(256, 16, device=device), torch.randn(16, device=device)
    g = capture(attend_prefix, q, keys, 32)   # captured while the context was 32 tokens
    g.replay()
    synchronize(device)
    expected_long = attend_prefix(q, keys, 200)
    return {"captured_context": 32, "replayed_for_context": 200,
            "graph_result": g.outputs.item(), "correct_result": expected_long.item(),
            "graph_is_wrong": not torch.allclose(g.outputs, expected_long)}


class LazyTable(torch.nn.Module):
    """Builds a lookup table on first use, sized by the largest position seen (RoPE caches do)."""

    def __init__(self):
        super().__init__()
        self.table = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            n = int(positions.max()) + 1   # a host sync: fine eagerly, illegal inside a capture
            self.table = torch.linspace(0, 1, n, device=x.device)
        return x * self.table[positions]


def capture_error(fn: Callable, *args, warmup: int) -> str | None:
    """Try to capture; return the error message, or None when the capture worked."""
    try:
        capture(fn, *args, warmup=warmup)
    except RuntimeError as e:
        while e.__context__ is not None:  # the first failure, not "failed due to a previous error"
            e = e.__context__
        return str(e).strip().splitlines()[0]
    return None


def _sync_cases() -> dict:
    x, pos = torch.ones(8, device="cuda"), torch.arange(8, device="cuda")
    cases = {
        "lazy_init_without_warmup": lambda: capture_error(LazyTable(), x, pos, warmup=0),
        "lazy_init_with_warmup": lambda: capture_error(LazyTable(), x, pos, warmup=2),
        "item_inside_capture": lambda: capture_error(lambda t: t * t.sum().item(), x, warmup=1),
    }
    return cases


def host_sync_during_capture() -> dict:
    """Needs a GPU. Each case runs in a child process: a failed capture can leave the process's
    CUDA state (its RNG, the next capture) unusable, which is itself worth knowing."""
    results = {}
    for name in _sync_cases():
        out = subprocess.run([sys.executable, "-m", "labkit.lessons.cuda_graphs.pitfalls", name],
                             capture_output=True, text=True, timeout=300, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"the {name} probe crashed:\n{out.stderr[-2000:]}")
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def record() -> dict:
    return {"rebinding": rebinding_vs_copy("cuda"), "overwrite": output_overwritten("cuda"),
            "frozen_choice": frozen_choice("cuda"), "host_sync": host_sync_during_capture()}


if __name__ == "__main__":  # one host-sync case in a fresh process (see host_sync_during_capture)
    print(json.dumps(_sync_cases()[sys.argv[1]]()))
