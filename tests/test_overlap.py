"""labkit.overlap: the staging pool, the prefetcher and the device-to-host helper.

CPU tests pin down the API and the synchronous path (device="cpu" works on any machine); GPU
tests check the promises that only exist with streams: data intact across buffer reuse, an
unsafe reuse caught by its checksums, no stale readback, prefetched output equal to serial.
"""
import time
import warnings

import pandas as pd
import pytest
import torch

from labkit.overlap import staging
from labkit.lessons import pinned_memory_streams as transfer
from labkit.overlap import (InFlightCopy, PinnedStagingPool, PrefetchStats, Prefetcher,
                            SynchronousFallbackWarning, copy_to_host, start_copy_to_host)

CPU = "cpu"


@pytest.fixture
def quiet():
    """The fallback notice is said once per process; keep it out of the other tests' way."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SynchronousFallbackWarning)
        yield


# --- the synchronous path, on any machine -------------------------------------------------

def test_without_a_gpu_everything_runs_synchronously_and_says_so_exactly_once(monkeypatch):
    monkeypatch.setattr(staging, "_announced", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pool = PinnedStagingPool(device=CPU)
        PinnedStagingPool(device=CPU).to_device(torch.ones(3))
        list(Prefetcher([torch.ones(2)], CPU))
        copy_to_host(torch.ones(2))
    notices = [w for w in caught if issubclass(w.category, SynchronousFallbackWarning)]
    assert len(notices) == 1, f"the fallback should be announced once, got {len(notices)}"
    assert "synchronously" in str(notices[0].message)
    assert pool.stats.pinned is False and pool.copy_stream is None


def test_a_pool_copy_does_not_alias_its_source(quiet):
    src = torch.arange(6.0)
    out = PinnedStagingPool(device=CPU).to_device(src)
    src.fill_(-1)
    assert torch.equal(out, torch.arange(6.0)), "refilling the source must not change the copy"


@pytest.mark.parametrize("src", [
    torch.empty(0), torch.tensor([7]), torch.arange(12.0).reshape(3, 4).t(),
    torch.tensor([True, False, True]), torch.randn(5, 3, dtype=torch.float16),
    torch.arange(2**16 + 3, dtype=torch.int64)[::3],
], ids=["empty", "one", "transposed", "bool", "float16", "strided-int64"])
def test_the_pool_copies_awkward_shapes_and_dtypes_exactly(quiet, src):
    out = PinnedStagingPool(device=CPU).to_device(src)
    assert out.shape == src.shape and out.dtype == src.dtype and torch.equal(out, src)


def test_pool_stats_add_up(quiet):
    pool = PinnedStagingPool(num_buffers=3, device=CPU)
    sizes = [1, 10, 100, 0, 7]
    for n in sizes:
        pool.to_device(torch.zeros(n, dtype=torch.int16))
    s = pool.stats
    assert (s.copies, s.bytes_copied, s.num_buffers) == (5, 2 * sum(sizes), 3)
    assert (s.bytes_pinned, s.waits, s.wait_ms, s.grows) == (0, 0, 0.0, 0), \
        "nothing is pinned or waited for on the synchronous path"


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "2"])
def test_the_pool_rejects_a_bad_buffer_count_and_says_why(bad):
    with pytest.raises(ValueError, match="num_buffers must be an int >= 1.*got"):
        PinnedStagingPool(num_buffers=bad, device=CPU)


def test_the_pool_rejects_what_is_not_a_tensor_and_counts_nothing(quiet):
    pool = PinnedStagingPool(device=CPU)
    with pytest.raises(TypeError, match="list"):
        pool.to_device([1, 2, 3])
    assert pool.stats.copies == 0
    pool.to_device(torch.ones(1))   # still usable
    assert pool.stats.copies == 1


def test_staging_twice_without_submitting_is_an_error_that_keeps_the_staged_buffer(quiet):
    pool = PinnedStagingPool(device=CPU)
    host = pool.stage((4,), torch.int32)
    host.copy_(torch.arange(4, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="submit"):
        pool.stage((4,), torch.int32)
    assert torch.equal(pool.submit().wait(), torch.arange(4, dtype=torch.int32))


def test_submitting_with_nothing_staged_says_what_to_do_first(quiet):
    with pytest.raises(RuntimeError, match=r"stage\(shape, dtype\)"):
        PinnedStagingPool(device=CPU).submit()


def test_reserve_rejects_a_negative_size(quiet):
    with pytest.raises(ValueError, match="nbytes"):
        PinnedStagingPool(device=CPU).reserve(-1)


@pytest.mark.parametrize("bad, error", [(1.5, TypeError), ("x", TypeError), (None, TypeError),
                                        (True, TypeError), (-1, ValueError)])
def test_byte_sizes_must_be_ints_and_the_error_names_them(quiet, bad, error):
    with pytest.raises(error, match="min_buffer_bytes must be"):
        PinnedStagingPool(device=CPU, min_buffer_bytes=bad)
    with pytest.raises(error, match="nbytes must be"):
        PinnedStagingPool(device=CPU).reserve(bad)


@pytest.mark.parametrize("shape, dtype, error, match", [
    ((2,), None, TypeError, "dtype must be a torch.dtype.*got None"),   # was float32 silently
    ((2,), "float32", TypeError, "dtype must be a torch.dtype"),
    (3, torch.float32, TypeError, r"shape must be a tuple of ints such as \(256,\), got 3"),
    ((2.5,), torch.float32, TypeError, "shape must be a tuple of ints"),
    ((4, -1), torch.float32, ValueError, r"shape \(4, -1\) has a negative size")],
    ids=["no dtype", "str dtype", "int shape", "float shape", "negative shape"])
def test_stage_refuses_a_bad_shape_or_dtype_and_stages_nothing(quiet, shape, dtype, error, match):
    pool = PinnedStagingPool(device=CPU)
    with pytest.raises(error, match=match):
        pool.stage(shape, dtype)
    host = pool.stage((2,), torch.int64)   # nothing was left staged by the refused call
    host.copy_(torch.tensor([5, 6]))
    assert torch.equal(pool.submit().wait(), torch.tensor([5, 6]))
    assert pool.stats.copies == 1


def test_copy_to_host_refuses_an_out_that_is_not_a_tensor(quiet):
    with pytest.raises(TypeError, match="out must be a host tensor to copy into.*got list"):
        copy_to_host(torch.ones(2), out=[0.0, 0.0])


@pytest.mark.parametrize("batches, match", [
    (None, "batches must be an iterable of host batches.*got NoneType"),
    (5, "got int"),
    (torch.ones(3, 2), r"batches is one tensor \(3, 2\); pass an iterable of batches")],
    ids=["None", "int", "one tensor"])
def test_the_prefetcher_refuses_what_is_not_batches_when_it_is_made(quiet, batches, match):
    with pytest.raises(TypeError, match=match):
        Prefetcher(batches, CPU)   # not at the first next(), far from the mistake


@pytest.mark.parametrize("kwargs, match", [
    (dict(pool=5), "pool must be a PinnedStagingPool.*got int"),
    (dict(overlap="no"), "overlap must be True or False, got 'no'")])   # 'no' is truthy
def test_the_prefetcher_refuses_options_of_the_wrong_type(quiet, kwargs, match):
    with pytest.raises(TypeError, match=match):
        Prefetcher([torch.ones(1)], CPU, **kwargs)


def test_the_prefetcher_yields_every_batch_in_order_as_copies(quiet):
    batches = [torch.full((3,), float(i)) for i in range(5)]
    got = list(Prefetcher(batches, CPU))
    assert [b[0].item() for b in got] == [0, 1, 2, 3, 4]
    assert all(g.data_ptr() != b.data_ptr() for g, b in zip(got, batches)), \
        "a yielded batch must be a copy, as it is on a GPU"


def test_the_prefetcher_keeps_tuples_lists_and_dicts(quiet):
    batch = (torch.ones(2), [torch.zeros(1)], {"ids": torch.arange(3)})
    (got,) = list(Prefetcher([batch], CPU))
    assert isinstance(got, tuple) and isinstance(got[1], list) and isinstance(got[2], dict)
    assert torch.equal(got[2]["ids"], torch.arange(3))


def test_the_prefetcher_names_the_part_of_a_batch_that_is_not_a_tensor(quiet):
    with pytest.raises(TypeError, match=r"batch\[1\] is a str"):
        list(Prefetcher([(torch.ones(1), "tokens")], CPU))


def test_the_prefetcher_fetches_the_next_batch_only_once_this_one_is_handed_out(quiet):
    produced = []

    def batches():
        for i in range(4):
            produced.append(i)
            yield torch.tensor([i])

    for b in Prefetcher(batches(), CPU):
        assert produced == list(range(int(b) + 1)), \
            "the next batch is produced after the body has enqueued its work on this one"


def test_prefetch_stats_add_up_on_the_synchronous_path(quiet):
    pf = Prefetcher([torch.ones(1000) for _ in range(4)], CPU)
    for _ in pf:
        time.sleep(0.002)
    s = pf.stats
    assert s.batches == 4 and s.compute_ms >= 4 * 2.0 and s.copy_ms > 0
    assert s.copy_ms + s.compute_ms <= s.wall_ms, "copy and compute are parts of the wall time"


def test_an_empty_iterable_gives_empty_stats(quiet):
    pf = Prefetcher([], CPU)
    assert list(pf) == [] and pf.stats.batches == 0 and pf.stats.overlap_efficiency == 0.0


@pytest.mark.parametrize("wall, expected", [(10.0, 1.0), (16.0, 0.0), (13.0, 0.5), (18.0, -1/3)])
def test_overlap_efficiency_is_the_hidden_share_of_the_shorter_part(wall, expected):
    s = PrefetchStats(batches=1, copy_ms=6.0, compute_ms=10.0, wall_ms=wall, overlap=True)
    assert s.overlap_efficiency == pytest.approx(expected)
    assert s.as_dict()["overlap_efficiency"] == pytest.approx(expected)


def test_copy_to_host_returns_a_copy_and_fills_a_given_out(quiet):
    t = torch.arange(4.0)
    out = torch.empty(4)
    assert copy_to_host(t, out=out) is out and torch.equal(out, t)
    got = copy_to_host(t)
    t.zero_()
    assert torch.equal(got, torch.arange(4.0))


def test_copy_to_host_rejects_an_out_of_the_wrong_shape_or_a_non_tensor(quiet):
    with pytest.raises(ValueError, match=r"\(3,\).*\(4,\)"):
        copy_to_host(torch.ones(4), out=torch.empty(3))
    with pytest.raises(TypeError, match="int"):
        copy_to_host(3)


def test_a_started_readback_is_complete_on_the_synchronous_path(quiet):
    copy = start_copy_to_host(torch.ones(2))
    assert isinstance(copy, InFlightCopy) and copy.ready() and torch.equal(copy.synchronize(),
                                                                           torch.ones(2))


# --- the experiments' plain logic -----------------------------------------------------------

@pytest.mark.parametrize("i, numel", [(0, 1), (3, 5), (15, 2**18)])
def test_a_batch_checksum_names_the_batch(i, numel):
    checksum = int(transfer.make_batch(i, numel).sum(dtype=torch.int64))
    assert transfer.arrived_batch(checksum, numel) == i


def test_pinning_pays_off_after_the_copies_that_repay_its_cost():
    df = pd.DataFrame({"bytes": [1, 2], "pageable_us": [10.0, 10.0], "pinned_us": [6.0, 12.0],
                       "pin_first_us": [40.0, 40.0], "pin_then_copy_us": [9.0, 15.0]})
    payoff = transfer.pin_payoff(df)
    assert payoff.copies_to_break_even.iloc[0] == 10.0, "40 us to pin, 4 us saved per copy"
    assert pd.isna(payoff.copies_to_break_even.iloc[1]), "no saving per copy: never pays off"


def test_overlap_on_a_timeline_counts_only_time_in_copy_and_kernel_at_once():
    events = pd.DataFrame({"kind": ["memcpy", "memcpy", "kernel", "kernel", "cpu_op"],
                           "start_us": [0.0, 20.0, 5.0, 30.0, 0.0],
                           "dur_us": [10.0, 10.0, 10.0, 10.0, 100.0]})
    got = transfer.copy_compute_overlap(events)
    assert got == {"copy_us": 20.0, "compute_us": 20.0, "overlapped_us": 5.0, "span_us": 40.0}


def test_gpu_only_experiments_point_a_cpu_user_at_the_recorded_figures():
    with pytest.raises(ValueError, match="recorded"):
        transfer.early_reuse(False, device=CPU)


def test_serial_and_overlapped_steps_pick_the_same_tokens(quiet):
    df = transfer.step_times(steps=3, tokens=8, d_model=16, vocab=32, prep_ms=0.5,
                             compute_ms=0.2, device=CPU)
    assert list(df["mode"]) == ["serial", "overlapped"] and df.same_tokens.all()
    assert (df.step_ms > 0).all()


# --- with a GPU -----------------------------------------------------------------------------

@pytest.mark.gpu
def test_pool_data_arrives_intact_across_many_reuses_under_load():
    dev = torch.device("cuda")
    pool = PinnedStagingPool(num_buffers=2, device=dev)
    load = torch.randn(4096, 4096, device=dev)
    g = torch.Generator().manual_seed(0)
    sizes = [1, 7, 1000, 2**16 + 3, 2**20, 3]
    sources = [torch.randint(-2**31, 2**31 - 1, (sizes[i % len(sizes)],), dtype=torch.int32,
                             generator=g) for i in range(30)]
    sums, expected = [], []
    for i in range(300):
        src = sources[i % len(sources)]
        if i % 10 == 0:
            with torch.cuda.stream(pool.copy_stream):
                transfer.gpu_sleep(0.5, dev)   # the copy engine lags: the CPU must wait to refill
        if i % 25 == 0:
            load = torch.tanh(load @ load)     # the consumer stream lags too: freed batches
        x = pool.to_device(src)                #   must outlive the kernels that read them
        sums.append(x.sum(dtype=torch.int64))
        expected.append(int(src.sum(dtype=torch.int64)))
        del x
    got = torch.stack(sums).tolist()
    bad = [i for i, (a, b) in enumerate(zip(got, expected)) if a != b]
    assert not bad, f"batches {bad[:10]} arrived corrupt through the pool"
    s = pool.stats
    assert s.copies == 300 and s.waits > 0, f"the test should have made the pool wait: {s}"


@pytest.mark.gpu
def test_an_unsafe_reuse_is_caught_by_its_checksums_and_the_pool_path_is_not():
    unsafe = transfer.early_reuse(False, n_batches=16)
    safe = transfer.early_reuse(True, n_batches=16)
    assert unsafe["corrupt"] >= 8, ("refilling one pinned buffer while its copies wait behind a "
                                    f"sleeping copy stream should corrupt most batches: {unsafe}")
    assert safe["corrupt"] == 0 and safe["pool_waits"] > 0, f"the pool must wait, not corrupt: {safe}"


@pytest.mark.gpu
def test_copy_to_host_never_returns_stale_data_where_a_bare_copy_does():
    x = torch.zeros(1 << 16, device="cuda")
    out = torch.empty(1 << 16, pin_memory=True)
    stale = 0
    for i in range(1, 41):
        transfer.gpu_sleep(0.2)
        x.fill_(float(i))
        got = copy_to_host(x, out=out)
        assert got is out and bool((got == i).all()), f"copy_to_host returned stale data at {i}"
        transfer.gpu_sleep(0.2)
        x.fill_(float(-i))
        out.copy_(x, non_blocking=True)      # the bare copy, read before its event completes
        stale += int(out[0].item() != -i)
        torch.cuda.synchronize()
    assert stale > 0, "control: reading a bare non-blocking copy at once should see old values"


@pytest.mark.gpu
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned-batches", "pageable-batches"])
def test_the_prefetcher_computes_what_the_serial_loop_computes(pinned):
    dev = torch.device("cuda")
    batches = transfer.host_batches(6, 512, 256, pinned=pinned, seed=3)
    w = torch.randn(256, 256, device=dev) / 16
    serial = [transfer.compute(b.to(dev), w, 3) for b in batches]
    for overlap in (True, False):
        pf = Prefetcher(batches, dev, overlap=overlap)
        got = [transfer.compute(x, w, 3) for x in pf]
        assert len(got) == len(serial) and pf.stats.batches == 6
        for a, b in zip(got, serial):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
def test_the_prefetcher_hides_copies_behind_compute():
    times = {}
    for overlap in (False, True):
        run = transfer.copy_compute_runner(overlap, n_batches=8, rows=2048, cols=2048, matmuls=3,
                                           device="cuda")
        run()
        run()
        times[overlap] = run.last["prefetcher"].stats
    assert times[True].wall_ms < 0.95 * times[False].wall_ms, times
    assert times[True].overlap_efficiency > 0.5, times[True]


@pytest.mark.gpu
def test_the_pool_refuses_to_grow_inside_a_graph_capture_and_stays_unchanged():
    pool = PinnedStagingPool(device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        with pytest.raises(RuntimeError, match=r"reserve\(400\)"):
            pool.stage((100,), torch.float32)
    assert pool.stats.bytes_pinned == 0 and pool.stats.copies == 0
    pool.reserve(400)
    assert pool.stats.bytes_pinned >= 2 * 400
