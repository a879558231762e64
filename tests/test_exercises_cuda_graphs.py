"""Exercise 02.2's check: two calls that replay the same bucket's graph catch a result that is
a view of the graph's output buffer instead of a clone."""
from labkit.teaching.check import check
from labkit.teaching.exercises.cuda_graphs import BUCKETS, EXERCISES


def run_bucketed(pool, x, clone=True):
    bucket = next((b for b in pool.buckets if b >= len(x)), None)
    if bucket is None:
        return pool.fn(x)
    pool.static_input[:len(x)].copy_(x)
    pool.static_input[len(x):bucket].zero_()
    pool.graphs[bucket].replay()
    out = pool.graphs[bucket].outputs[:len(x)]
    return out.clone() if clone else out


def test_some_case_replays_one_bucket_twice_back_to_back():
    def bucket(n):
        return next((b for b in BUCKETS if b >= n), None)

    calls = [[len(x) for x in case.args[1]] for case in EXERCISES[0].cases(0, "cpu")]
    assert any(len(c) > 1 and len({bucket(n) for n in c}) == 1 for c in calls), calls


def test_the_solution_with_clone_passes():   # the notebook's solution: test_exercises.py
    assert check("02.2", run_bucketed, device="cpu").passed


def test_a_solution_without_clone_fails_and_says_the_next_replay_overwrote_it():
    result = check("02.2", lambda pool, x: run_bucketed(pool, x, clone=False), device="cpu")
    assert not result.passed
    assert "two calls in one bucket" in result.message, result.message
    assert "next replay overwrote" in result.message and "clone()" in result.message, result.message


def test_the_pool_frees_its_graphs_without_the_cyclic_collector():
    """A graph in a reference cycle is freed whenever the collector runs: on a GPU that may be in
    the middle of the next capture, which CUDA refuses (the 8-row case failed so on the H200)."""
    import gc
    import weakref

    import torch

    from labkit.teaching.exercises.cuda_graphs import BucketPool, RowStep

    step = RowStep(8, torch.Generator().manual_seed(0))
    enabled = gc.isenabled()
    gc.disable()
    try:
        pool = BucketPool(step, BUCKETS, 8, torch.device("cpu"))
        graph = weakref.ref(pool.graphs[BUCKETS[-1]])
        pool.graphs[1].replay()
        assert pool.replayed == [1]
        del pool
        assert graph() is None, "the pool's graphs survive it until the cyclic collector runs"
    finally:
        if enabled:
            gc.enable()
