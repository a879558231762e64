"""The L2 in a timing: flushed between samples and never inside one, refused where it cannot
work, and every timed case's statement of what it read its data from."""
import statistics
import time

import pytest
import torch

from labkit.measure import bench

MiB = 2**20


def test_a_flush_outside_the_timed_region_costs_the_sample_nothing(monkeypatch):
    # A flush that takes 20 ms: were it inside the sample, a no-op call would time as 20 ms.
    monkeypatch.setattr(bench, "l2_flush", lambda dev: lambda: time.sleep(0.02))
    t = bench.measure(lambda: None, device="cpu", warmup=0, repeats=3, flush_l2=True)
    assert t.median_us < 5_000, f"the flush landed inside the timed region: {t}"
    assert t.l2_flushed


def test_on_the_host_clock_each_sample_is_flush_then_start_call_end(monkeypatch):
    log = []
    monkeypatch.setattr(bench, "l2_flush", lambda dev: lambda: log.append("flush"))
    clock = iter(range(1000))
    monkeypatch.setattr(bench.time, "perf_counter", lambda: log.append("mark") or next(clock))
    bench.measure(lambda: log.append("call"), device="cpu", warmup=1, repeats=3, flush_l2=True)
    assert log == ["call"] + ["flush", "mark", "call", "mark"] * 3


class FakeEvent:
    """A CUDA event that logs when it is recorded: on one stream, record order is GPU order."""
    log: list = []
    made: list = []

    def __init__(self, enable_timing=False):
        FakeEvent.made.append(self)

    def record(self):
        FakeEvent.log.append("start" if FakeEvent.made.index(self) % 2 == 0 else "end")

    def elapsed_time(self, end):
        return 0.001


def test_on_a_gpu_the_flush_is_queued_before_the_start_event(monkeypatch):
    log = []
    FakeEvent.log, FakeEvent.made = log, []
    monkeypatch.setattr(bench, "select_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(bench.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda dev=None: log.append("sync"))
    monkeypatch.setattr(bench, "l2_flush", lambda dev: lambda: log.append("flush"))
    t = bench.measure(lambda: log.append("call"), warmup=1, repeats=2, flush_l2=True)
    assert log == ["call", "sync"] + ["flush", "start", "call", "end"] * 2 + ["sync"]
    assert t.method == "cuda events" and t.l2_flushed


def test_without_flush_l2_nothing_is_flushed(monkeypatch):
    monkeypatch.setattr(bench, "l2_flush", lambda dev: pytest.fail("flushed unasked"))
    t = bench.measure(lambda: None, device="cpu", warmup=0, repeats=2)
    assert not t.l2_flushed


def test_the_real_flush_reads_all_of_a_buffer_twice_the_cache(monkeypatch):
    monkeypatch.setattr(bench, "cache_bytes", lambda dev: 3 * MiB)
    flush = bench.l2_flush(torch.device("cpu"))
    buffer = flush.__self__
    assert buffer.numel() * buffer.element_size() == 6 * MiB
    assert flush() == buffer.numel(), "a sum of ones: every element was read"


def test_flushing_with_several_calls_per_sample_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"flush_l2=True needs calls_per_sample=1.*got "
                                         r"calls_per_sample=4"):
        bench.measure(lambda: None, device="cpu", calls_per_sample=4, flush_l2=True)
    bench.measure(lambda: None, device="cpu", calls_per_sample=4, repeats=1)  # fine unflushed


@pytest.fixture
def l2_of_60_mib(monkeypatch):
    """A GPU with the H200's L2, on a CPU-only machine."""
    monkeypatch.setattr(bench, "select_device", lambda device: torch.device("cuda"))
    monkeypatch.setattr(bench, "cache_bytes", lambda dev: 60 * MiB)


def test_a_working_set_just_over_twice_the_l2_is_read_from_hbm(l2_of_60_mib):
    assert not bench.flush_needed(120 * MiB + 1)
    assert bench.l2_statement(120 * MiB + 1) == ("working set 120 MiB > 2x L2 (120 MiB): "
                                                "read from HBM every call")


def test_a_working_set_of_exactly_twice_the_l2_needs_a_flush_and_is_refused_without(l2_of_60_mib):
    assert bench.flush_needed(120 * MiB)
    with pytest.raises(ValueError, match="fits in 2x the L2 .* flush_l2=True"):
        bench.l2_statement(120 * MiB)
    assert bench.l2_statement(120 * MiB, flushed=True) == ("L2 flushed between samples "
                                                          "(working set 120 MiB)")


def test_rotated_inputs_count_only_when_all_sets_together_exceed_twice_the_l2(l2_of_60_mib):
    assert bench.l2_statement(1 * MiB, input_sets=121) == ("inputs rotated over 121 sets of "
                                                          "1 MiB (121 MiB > 2x L2)")
    with pytest.raises(ValueError, match="neither flushed nor rotated"):
        bench.l2_statement(1 * MiB, input_sets=120)  # the 120 sets cycle through the L2


def test_a_timing_carries_what_its_statement_needs(monkeypatch):
    monkeypatch.setattr(bench, "cache_bytes", lambda dev: 64 * 1024)
    t = bench.measure(lambda x: None, lambda: (torch.ones(1024),), device="cpu", repeats=2)
    assert bench.l2_statement(4096, "cpu", flushed=t.l2_flushed, input_sets=t.input_sets) == \
        "inputs rotated over 48 sets of 0.0039 MiB (0.19 MiB > 2x CPU cache)"
    monkeypatch.setattr(bench, "cache_bytes", lambda dev: 64 * MiB)
    t = bench.measure(lambda x: None, lambda: (torch.ones(1024),), device="cpu", repeats=2)
    with pytest.raises(ValueError):  # at most 64 sets of 4 KiB: they cycle in the cache
        bench.l2_statement(4096, "cpu", input_sets=t.input_sets)
    t = bench.measure(lambda: None, device="cpu", repeats=2, flush_l2=True)
    assert bench.l2_statement(4096, "cpu", flushed=t.l2_flushed) == (
        "CPU cache flushed between samples (working set 0.0039 MiB)")


@pytest.mark.gpu
def test_on_a_gpu_the_flush_is_not_timed_but_does_evict():
    # A kernel that only spins: a flush inside its samples would add the flush's tens of us.
    spin = bench.measure(lambda: torch.cuda._sleep(100_000), device="cuda", repeats=20)
    flushed = bench.measure(lambda: torch.cuda._sleep(100_000), device="cuda", repeats=20,
                            flush_l2=True)
    assert flushed.median_us < 1.15 * spin.median_us, f"the flush was timed: {flushed} vs {spin}"
    # A read that fits in the L2 is slower once the flush has run. Timed with the GPU kept busy
    # (a spin first) so the host queues the read ahead: unqueued, a read this short would time
    # the host's launch, not the memory it reads.
    dev = torch.device("cuda")
    x = torch.ones(bench.cache_bytes(dev) // 3 // 4, device=dev)
    flush = bench.l2_flush(dev)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(20):
        for cold in (False, True):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)  # ~0.5 ms: longer than the host takes to queue the rest
            x.sum()
            if cold:
                flush()
            start.record()
            x.sum()
            end.record()
            torch.cuda.synchronize()
            times[cold].append(start.elapsed_time(end) * 1e3)
    warm, cold = statistics.median(times[False]), statistics.median(times[True])
    # On the H200 this read took 11.3 us from the L2 and 13.5 us after the flush (1.19x): an L2
    # hit saves the HBM latency, but one kernel's reduction does not read the L2 much faster than
    # HBM streams, so the margin is modest; 1.2x failed there, 1.1x is what eviction shows.
    assert cold > 1.1 * warm, f"flushed {cold:.2f} us vs warm {warm:.2f} us"
