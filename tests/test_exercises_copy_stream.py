"""Exercise 04.1: the copy-stream handshake in PyTorch's raw calls, checked through ``cuda``
(torch.cuda on a GPU, labkit's stand-in here), and the stand-in's stream rules themselves."""
import pytest
import torch

from labkit.graphs import emulated_cuda
from labkit.teaching import exercises
from labkit.teaching.check import check


def prefetch(cuda, hosts, compute, device, *, wait=True, record=True, event=True):
    copy_stream = cuda.Stream()
    outs = []
    for host in hosts:
        with cuda.stream(copy_stream):
            dev = torch.empty_like(host, device=device)
            dev.copy_(host, non_blocking=True)
            ready = cuda.Event()
            ready.record()
        if wait:
            if event:
                cuda.current_stream().wait_event(ready)
            else:
                cuda.current_stream().wait_stream(copy_stream)
        if record:
            dev.record_stream(cuda.current_stream())
        outs.append(compute(dev))
    return outs


def test_the_handshake_passes():
    assert check("04.1", prefetch, device="cpu").passed


def test_waiting_for_the_whole_copy_stream_is_right_too():
    assert check("04.1", lambda *a: prefetch(*a, event=False), device="cpu").passed


@pytest.mark.parametrize("mistake,reason", [({"wait": False}, "wait_event(ready)"),
                                            ({"record": False}, "record_stream")])
def test_each_mistake_fails_with_its_reason(mistake, reason):
    result = check("04.1", lambda *a: prefetch(*a, **mistake), device="cpu")
    assert not result.passed and reason in result.message, result.message


def test_on_a_gpu_one_case_runs_on_the_stand_in_and_a_missing_wait_fails_it():
    ex = exercises.get("04.1")
    stand_in = [c for c in ex.cases(0, torch.device("cuda")) if c.args[1] is None]
    assert len(stand_in) == 1
    got = ex.run(lambda *a: prefetch(*a, wait=False), stand_in[0])
    assert got["outputs"][0].isnan().all()
    right = ex.run(prefetch, stand_in[0])["outputs"]
    assert all(map(torch.equal, right, ex.expected(stand_in[0])["outputs"]))


@pytest.mark.gpu
def test_on_the_gpu_the_handshake_passes():
    assert check("04.1", prefetch, device="cuda").passed


@pytest.mark.gpu
@pytest.mark.parametrize("mistake,reason", [({"wait": False}, "wait_event(ready)"),
                                            ({"record": False}, "record_stream")])
def test_on_the_gpu_each_mistake_fails_with_its_reason(mistake, reason):
    result = check("04.1", lambda *a: prefetch(*a, **mistake), device="cuda")
    assert not result.passed and reason in result.message, repr(result)


@pytest.mark.gpu
def test_on_the_gpu_a_late_copy_alone_catches_a_missing_wait():
    result = check("04.1", lambda *a: prefetch(*a, wait=False), device="cuda")
    late = [c for c in result.cases if c.label.endswith("late copy")]
    assert late and not any(c.passed for c in late), repr(result)


# --- the stand-in's streams ---------------------------------------------------------------------
def test_outside_running_every_op_runs_at_once():
    side, x = emulated_cuda.Stream(), torch.zeros(3)
    with emulated_cuda.stream(side):
        x.add_(1)
    assert x.tolist() == [1.0, 1.0, 1.0]


def test_a_queued_copy_lands_only_when_an_event_behind_it_is_waited_on():
    src, dst = torch.arange(4.0), torch.zeros(4)
    with emulated_cuda.running():
        side = emulated_cuda.Stream()
        with emulated_cuda.stream(side):
            dst.copy_(src)
            ready = emulated_cuda.Event()
            ready.record()
        src.fill_(7.0)  # the host rewrites the source before the copy ran: the copy reads 7s
        assert dst.tolist() == [0.0] * 4 and not ready.query()
        emulated_cuda.current_stream().wait_event(ready)
        assert dst.tolist() == [7.0] * 4 and ready.query()


def test_what_a_side_stream_allocates_is_poison_until_it_runs():
    with emulated_cuda.running():
        side = emulated_cuda.Stream()
        with emulated_cuda.stream(side):
            y = torch.ones(3) * 5
            n = torch.ones(2, dtype=torch.int64) + 1
        assert y.isnan().all() and n.tolist() == [-1, -1]
        side.synchronize()
        assert y.tolist() == [5.0] * 3 and n.tolist() == [2, 2]


def test_running_drains_every_stream_at_its_end():
    dst = torch.zeros(2)
    with emulated_cuda.running():
        side = emulated_cuda.Stream()
        with emulated_cuda.stream(side):
            dst.add_(3)
    assert dst.tolist() == [3.0, 3.0]


def test_record_stream_must_name_the_reading_stream():
    with emulated_cuda.running() as streams:
        side, other = emulated_cuda.Stream(), emulated_cuda.Stream()
        with emulated_cuda.stream(side):
            y = torch.ones(3) * 2
        side.synchronize()
        y.record_stream(other)  # the wrong stream: the default stream reads it
        _ = y + 1
    assert streams.missing_record_stream() == ["add.Tensor"]
