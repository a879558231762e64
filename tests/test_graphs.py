"""GraphPool: replay must compute exactly what eager computes, for every batch size."""
import warnings

import pytest
import torch

from labkit.graphs import GraphPool, bucket_for

gpu = pytest.mark.gpu


def rowwise(x, w):
    # x: [batch, 8], w: [batch, 8] -> two outputs, each row depends only on its own inputs
    return torch.tanh(x * 2 + w), (x * w).sum(-1, keepdim=True)


def test_without_a_gpu_the_pool_runs_eagerly_says_so_once_and_counts_it():
    if torch.cuda.is_available():
        pytest.skip("checks the no-GPU path")
    with pytest.warns(UserWarning, match="no CUDA device"):
        pool = GraphPool(rowwise, buckets=(1, 2, 4))
    x, w = torch.randn(3, 8), torch.randn(3, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning per call
        out = pool(x, w)
        pool(x, w)
    torch.testing.assert_close(out[0], rowwise(x, w)[0])
    assert pool.stats.eager_calls == 2 and pool.stats.eager_reasons["no CUDA device"] == 2
    assert pool.stats.replays == 0


def test_buckets_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        GraphPool(rowwise, buckets=(0, 4), enabled=False)


@pytest.mark.parametrize("name", ["buckets", "context_buckets"])
@pytest.mark.parametrize("entry, error, match", [
    (2.7, TypeError, "must be a positive int, got float 2.7"),   # int() would make it 2
    ("a", TypeError, "must be a positive int, got str 'a'"),
    ("4", TypeError, "must be a positive int, got str '4'"),
    (True, TypeError, "must be a positive int, got bool True"),
    (0, ValueError, "must be a positive int, got 0"),
    (-8, ValueError, "must be a positive int, got -8")], ids=["float", "str", "digit str", "bool", "zero", "negative"])
def test_bucket_entries_must_be_positive_ints_and_the_error_names_the_entry(name, entry, error,
                                                                            match):
    kwargs = {"buckets": [1, 2], "context_buckets": [16, 64]}
    kwargs[name] = [1, entry] if name == "buckets" else [16, entry]
    with pytest.raises(error, match=rf"{name}\[1\] {match}"):
        GraphPool(rowwise, enabled=False, **kwargs)


@pytest.mark.parametrize("buckets, error, match", [
    (8, TypeError, "buckets must be a list of batch sizes.*got int 8"),
    ("124", TypeError, "buckets must be a list"),
    ([], ValueError, "buckets is empty")])
def test_buckets_must_be_a_non_empty_list(buckets, error, match):
    with pytest.raises(error, match=match):
        GraphPool(rowwise, buckets=buckets, enabled=False)


def test_repeated_buckets_are_one_bucket():
    assert GraphPool(rowwise, buckets=[4, 1, 4], enabled=False).buckets == [1, 4]


@pytest.mark.parametrize("kwargs, error, match", [
    ({"warmup": -1}, ValueError, "warmup must be an int >= 0, got -1"),
    ({"warmup": 1.5}, TypeError, "warmup must be an int >= 0, got float"),
    ({"pad_value": "x"}, TypeError, "pad_value must be a number"),
    ({"fn": None}, TypeError, "fn must be the function to capture")])
def test_pool_options_are_checked_when_the_pool_is_made(kwargs, error, match):
    kwargs = {"fn": rowwise, **kwargs}
    with pytest.raises(error, match=match):
        GraphPool(kwargs.pop("fn"), buckets=(1, 2), enabled=False, **kwargs)


@pytest.mark.parametrize("batch, context, error, match", [
    (-3, 16, ValueError, "batch must be an int >= 0, got -3"),    # was bucket 1
    (1.5, 16, TypeError, "batch must be an int >= 0, got float"),  # was bucket 2
    (1, None, ValueError, "context="),
    (1, -5, ValueError, "context must be an int >= 0")])
def test_key_for_refuses_sizes_that_are_no_batch_or_context(batch, context, error, match):
    pool = GraphPool(rowwise, buckets=(1, 2, 4), context_buckets=(16, 64), enabled=False)
    with pytest.raises(error, match=match):
        pool.key_for(batch, context)


def test_bucket_for_with_no_buckets_says_so():
    with pytest.raises(ValueError, match="no buckets to put batch 3 in"):
        bucket_for(3, [])
    assert bucket_for(3, [], default=None) is None


def test_context_must_be_passed_exactly_when_the_pool_has_context_buckets():
    pool = GraphPool(lambda x, context_bucket: x, buckets=(2,), context_buckets=(16,), enabled=False)
    with pytest.raises(ValueError, match="context="):
        pool(torch.zeros(1, 2))


def test_a_pool_that_cannot_capture_still_refuses_inputs_a_graph_would_refuse():
    """Without CUDA, capture() keeps the inputs' spec and every call is checked against it:
    an engine that hands the pool a block table of the wrong width fails on CPU as on a GPU."""
    pool = GraphPool(rowwise, buckets=(1, 2, 4), enabled=False)
    pool.capture(torch.zeros(1, 8), torch.zeros(1, 8))
    x, w = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(pool(x, w)[0], rowwise(x, w)[0])
    with pytest.raises(ValueError, match=r"input 1 is \(3, 5\).*captured for \(batch, \*\(8,\)\)"):
        pool(x, torch.randn(3, 5))
    assert pool.stats.eager_calls == 1 and pool.stats.replays == 0


def test_key_for_picks_the_smallest_bucket_that_holds_the_batch():
    pool = GraphPool(rowwise, buckets=(8, 1, 4), context_buckets=(512, 4096), enabled=False)
    assert pool.key_for(3, 100) == (4, 512)
    assert pool.key_for(4, 513) == (4, 4096)
    assert pool.key_for(9, 100) is None and pool.key_for(1, 5000) is None


def test_bucket_for_is_the_smallest_bucket_at_least_n_whatever_the_order():
    assert [bucket_for(n, (8, 1, 4)) for n in (1, 2, 4, 5, 8)] == [1, 4, 4, 8, 8]
    assert bucket_for(9, (8, 1, 4), default=None) is None, "too big: the caller runs it eagerly"
    with pytest.raises(ValueError, match="batch 9 is larger than the largest bucket 8"):
        bucket_for(9, (8, 1, 4))


@gpu
def test_replay_matches_eager_for_every_bucket_and_every_batch_in_between():
    torch.manual_seed(0)
    pool = GraphPool(rowwise, buckets=(1, 2, 4, 8, 16))
    for batch in range(1, 17):
        x, w = torch.randn(batch, 8, device="cuda"), torch.randn(batch, 8, device="cuda")
        got, want = pool(x, w), rowwise(x, w)
        for g, e in zip(got, want):
            assert g.shape == e.shape, f"batch {batch}: padding rows leaked into the result"
            torch.testing.assert_close(g, e, msg=f"batch {batch} differs from eager")
    assert pool.stats.replays == 16 and pool.stats.eager_calls == 0
    assert pool.stats.padded_rows == sum(pool.key_for(b)[0] - b for b in range(1, 17))


@gpu
def test_padding_rows_never_leak_even_when_earlier_rows_were_nan():
    pool = GraphPool(rowwise, buckets=(4,))
    nan = torch.full((4, 8), float("nan"), device="cuda")
    pool(nan, nan)
    x, w = torch.randn(3, 8, device="cuda"), torch.randn(3, 8, device="cuda")
    out, s = pool(x, w)
    assert not out.isnan().any() and not s.isnan().any()


@gpu
def test_outputs_are_the_callers_own_unless_views_are_asked_for():
    x1, x2 = torch.ones(2, 8, device="cuda"), torch.full((2, 8), 3.0, device="cuda")
    owned = GraphPool(rowwise, buckets=(2,))
    first = owned(x1, x1)[0]
    owned(x2, x2)
    torch.testing.assert_close(first, rowwise(x1, x1)[0], msg="the next replay changed a result")
    views = GraphPool(rowwise, buckets=(2,), copy_outputs=False)
    first = views(x1, x1)[0]
    views(x2, x2)
    torch.testing.assert_close(first, rowwise(x2, x2)[0],
                               msg="copy_outputs=False hands out the graph's own buffer")


@gpu
def test_a_batch_beyond_the_largest_bucket_runs_eager_with_its_reason():
    pool = GraphPool(rowwise, buckets=(1, 2))
    x = torch.randn(5, 8, device="cuda")
    torch.testing.assert_close(pool(x, x)[0], rowwise(x, x)[0])
    assert pool.stats.eager_reasons == {"batch 5 > largest bucket 2": 1}


@gpu
@pytest.mark.parametrize("bad", ["dtype", "trailing", "device", "count"])
def test_a_mismatch_with_what_was_captured_is_an_error_not_a_wrong_answer(bad):
    pool = GraphPool(rowwise, buckets=(4,))
    x = torch.randn(2, 8, device="cuda")
    pool(x, x)
    wrong = {"dtype": (x.half(), x), "trailing": (torch.randn(2, 9, device="cuda"),) * 2,
             "device": (x.cpu(), x), "count": (x,)}[bad]
    with pytest.raises(ValueError, match="captured"):
        pool(*wrong)


@gpu
def test_context_keys_freeze_each_kernel_choice_into_its_own_graph():
    def attend(x, context_bucket):
        # stands for "pick the split-KV kernel for long contexts"
        return x * 2 if context_bucket > 1024 else x + 1
    pool = GraphPool(attend, buckets=(2, 4), context_buckets=(1024, 8192))
    x = torch.ones(3, 4, device="cuda")
    torch.testing.assert_close(pool(x, context=100), x + 1)
    torch.testing.assert_close(pool(x, context=5000), x * 2)
    assert set(pool.stats.buckets) == {(2, 1024), (2, 8192), (4, 1024), (4, 8192)}
    assert pool.stats.eager_calls == 0


@gpu
def test_buckets_are_captured_largest_first_into_one_pool_and_memory_is_predicted():
    w = torch.randn(256, 256, device="cuda")
    fn = lambda x: torch.relu(x @ w) @ w
    pool = GraphPool(fn, buckets=(1, 8, 64, 256))
    x = torch.randn(4, 256, device="cuda")
    predicted = pool.predict_memory(x)
    pool.capture(x)
    assert [k[0] for k in pool.stats.buckets] == [256, 64, 8, 1], "largest first"
    actual = pool.stats.captured_bytes
    assert 0 < predicted and 0.5 < actual / predicted < 3, (
        f"predicted {predicted / 2**20:.1f} MiB, captured {actual / 2**20:.1f} MiB")
    table = pool.stats.table()
    assert list(table.columns) == ["key", "capture_ms", "pool_MiB", "replays", "rows", "padded_rows"]


@gpu
def test_the_prediction_counts_the_outputs_every_graph_keeps():
    # a logits-like output, wide against its input: each bucket's graph keeps its own
    w = torch.randn(64, 32768, device="cuda")
    pool = GraphPool(lambda x: x @ w, buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
    x = torch.randn(4, 64, device="cuda")
    predicted = pool.predict_memory(x)
    pool.capture(x)
    actual = pool.stats.captured_bytes
    assert abs(predicted - actual) <= 0.25 * actual, (
        f"predicted {predicted / 2**20:.1f} MiB, captured {actual / 2**20:.1f} MiB")


@gpu
def test_a_collection_during_capture_cannot_free_an_old_graph_into_it():
    """An old graph kept alive only by a reference cycle: with the collector at its most eager,
    capturing a new graph that allocates Python objects would free the old one mid-capture."""
    import gc

    from labkit.graphs.pool import capture_graph

    x = torch.ones(64, device="cuda")
    thresholds = gc.get_threshold()
    try:
        for _ in range(3):
            holder = {}
            holder["graph"], _ = capture_graph(lambda: x * 2)
            holder["self"] = holder           # unreachable after this loop: only gc frees it
            del holder
        gc.set_threshold(1)
        graph, out = capture_graph(lambda: [object() for _ in range(1000)] and x + 1)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, x + 1)
    finally:
        gc.set_threshold(*thresholds)
