"""Exercise 02.1: PyTorch's raw capture idiom, checked through ``cuda`` (torch.cuda on a GPU,
labkit's CPU stand-in here). Each way of getting it wrong fails with its own reason."""
import pytest
import torch

from labkit.graphs import emulated_cuda
from labkit.teaching.check import check


def capture_and_replay(cuda, fn, example, batches, *, warmup=True, clone=True, rebind=False,
                       recapture=False, in_place=False):
    static_in = example if in_place else example.clone()
    if warmup:
        side = cuda.Stream()
        side.wait_stream(cuda.current_stream())
        with cuda.stream(side):
            for _ in range(2):
                fn(static_in)
        cuda.current_stream().wait_stream(side)
    g = cuda.CUDAGraph()
    with cuda.graph(g):
        static_out = fn(static_in)
    outs = []
    for x in batches:
        if recapture:
            g = cuda.CUDAGraph()
            with cuda.graph(g):
                static_out = fn(static_in)
        if rebind:
            static_in = x
        else:
            static_in.copy_(x)
        g.replay()
        outs.append(static_out.clone() if clone else static_out)
    return outs


def test_the_idiom_passes():
    assert check("02.1", capture_and_replay, device="cpu").passed


@pytest.mark.parametrize("mistake,reason", [
    ({"warmup": False}, "before capturing"),
    ({"clone": False}, "static_out.clone()"),
    ({"rebind": True}, "static_in.copy_(x)"),
    ({"recapture": True}, "capture once"),
    ({"in_place": True}, "caller's tensor"),
])
def test_each_mistake_fails_with_its_reason(mistake, reason):
    result = check("02.1", lambda *a: capture_and_replay(*a, **mistake), device="cpu")
    assert not result.passed
    assert reason in result.message, result.message


def test_running_the_step_eagerly_is_not_a_graph():
    result = check("02.1", lambda cuda, fn, example, batches: [fn(x) for x in batches],
                   device="cpu")
    assert not result.passed and "run eagerly" in result.message, result.message


# --- the CPU stand-in freezes what a CUDA Graph freezes ----------------------------------------
def captured(step, static_in):
    g = emulated_cuda.CUDAGraph()
    with emulated_cuda.graph(g):
        out = step(static_in)
    return g, out


def test_replay_reads_the_captured_input_and_overwrites_the_captured_output():
    w = torch.randn(8, 8)
    step = lambda x: torch.tanh(x @ w) + x[:, :1]  # noqa: E731
    static_in = torch.randn(4, 8)
    g, out = captured(step, static_in)
    first = torch.randn(4, 8)
    static_in.copy_(first)
    g.replay()
    assert torch.allclose(out, step(first))
    kept = out
    static_in = torch.randn(4, 8)  # a new object: the graph never sees it
    g.replay()
    assert torch.allclose(kept, step(first)), "a rebound name must not reach the graph"


def test_a_python_value_is_frozen_at_capture():
    static_in, length = torch.arange(8.0), 3
    g, out = captured(lambda x: x[:length].sum().reshape(1), static_in)
    length = 8  # noqa: F841 (the point: the graph keeps 3)
    g.replay()
    assert out.item() == 3.0


@pytest.mark.parametrize("read_back", [lambda t: t.sum().item(), lambda t: bool(t.sum() > 0),
                                       lambda t: t.nonzero()])
def test_reading_a_value_back_during_capture_raises_and_leaves_no_capture(read_back):
    g = emulated_cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="stream is capturing"):
        with emulated_cuda.graph(g):
            read_back(torch.ones(4))
    assert not emulated_cuda.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="no finished capture"):
        g.replay()


def test_a_module_under_inference_mode_replays_too():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(3, 8)
    with torch.inference_mode():
        g, out = captured(lin, x)
        x.copy_(torch.ones(3, 8))
        g.replay()
        assert torch.allclose(out, lin(torch.ones(3, 8)))
