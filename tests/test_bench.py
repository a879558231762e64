import time

import pytest
import torch

from labkit.measure import bench


def test_median_sits_inside_its_spread_and_counts_repeats():
    t = bench.measure(lambda: sum(range(1000)), repeats=9, warmup=1, device="cpu")
    assert t.repeats == 9 and t.p20_us <= t.median_us <= t.p80_us and t.min_us <= t.p20_us


def test_cpu_timing_measures_the_work_not_zero():
    t = bench.measure(lambda: time.sleep(0.002), repeats=5, warmup=1, device="cpu")
    assert 1_900 < t.median_us < 6_000, f"a 2 ms sleep measured as {t}"


def test_calls_per_sample_reports_per_call_time():
    t = bench.measure(lambda: time.sleep(0.001), repeats=3, warmup=0, calls_per_sample=4,
                      device="cpu")
    assert 900 < t.median_us < 4_000


def test_inputs_that_fit_in_cache_are_rotated_so_each_call_reads_fresh_data():
    seen = []
    t = bench.measure(lambda x: seen.append(x.data_ptr()), lambda: (torch.ones(1024),),
                      repeats=10, warmup=0, device="cpu")
    assert t.input_sets > 1
    assert len(set(seen)) == min(10, t.input_sets), "consecutive calls must use different buffers"


def test_inputs_larger_than_the_cache_are_not_copied():
    big = 3 * bench.cache_bytes(torch.device("cpu")) // 4 + 1
    t = bench.measure(lambda x: None, lambda: (torch.empty(big),), repeats=2, device="cpu")
    assert t.input_sets == 1


def test_rotation_can_be_switched_off():
    t = bench.measure(lambda x: None, lambda: (torch.ones(8),), repeats=2, rotate=False,
                      device="cpu")
    assert t.input_sets == 1


def test_bad_arguments_name_the_limit():
    with pytest.raises(ValueError, match="repeats >= 1"):
        bench.measure(lambda: None, repeats=0, device="cpu")


def test_throughput_helpers():
    t = bench.Timing(median_us=1e6, p20_us=1e6, p80_us=1e6, min_us=1e6, repeats=1,
                     device="cpu", method="x")
    assert bench.gbps(2e9, t) == pytest.approx(2.0)
    assert bench.tflops(3e12, t) == pytest.approx(3.0)


@pytest.mark.gpu
def test_gpu_timing_uses_events_and_sees_the_kernel_not_the_launch():
    # torch.cuda._sleep spins the GPU for a number of cycles; the launch returns at once.
    cycles = 2_000_000
    t = bench.measure(lambda: torch.cuda._sleep(cycles), device="cuda", repeats=5)
    clock_hz = torch.cuda.clock_rate() * 1e6 if hasattr(torch.cuda, "clock_rate") else 2e9
    assert t.method == "cuda events"
    assert t.median_us > 0.5 * cycles / clock_hz * 1e6, f"{t} is shorter than the kernel"


def test_triton_compiles_counts_what_the_post_compile_hook_reports_and_chains():
    # On a CPU Triton interprets and never compiles, so drive the hook as Triton's JIT does
    # after each compile (the GPU check sees real ones).
    from types import SimpleNamespace

    from triton import knobs

    earlier = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: earlier.append(kw["fn"].name)
    try:
        with bench.TritonCompiles() as c:
            for name in ("_paged_attention_kernel", "_rope_kernel"):
                knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name=name), key=None)
        assert (c.count, c.kernels) == (2, ["_paged_attention_kernel", "_rope_kernel"])
        assert earlier == c.kernels, "a hook installed before keeps running"
        assert knobs.runtime.jit_post_compile_hook is not None
        knobs.runtime.jit_post_compile_hook(fn=SimpleNamespace(name="after"), key=None)
        assert c.count == 2, "nothing is counted once the block is left"
    finally:
        knobs.runtime.jit_post_compile_hook = None


@pytest.mark.gpu
def test_triton_compiles_sees_a_real_compile_once_per_variant():
    import triton
    import triton.language as tl

    @triton.jit
    def fill(X, N: tl.constexpr):
        tl.store(X + tl.arange(0, N), 1.0)

    x = torch.zeros(32, device="cuda")
    with bench.TritonCompiles() as c:
        fill[(1,)](x, N=16)
        fill[(1,)](x, N=16)   # cached: no second compile
        fill[(1,)](x, N=32)   # a new constexpr: a new variant
    assert c.count == 2, c.kernels


def test_save_results_writes_the_results_beside_the_fingerprint(tmp_path):
    import json

    from labkit.measure.bench import save_results
    assert save_results(None, "x.json", {"a": 1}) is None
    path = save_results(tmp_path / "new", "x.json", {"a": 1, "when": tmp_path})
    saved = json.loads(path.read_text())
    assert saved["results"]["a"] == 1 and "torch" in saved["fingerprint"]
    assert saved["results"]["when"] == str(tmp_path), "what JSON cannot hold is written as text"
