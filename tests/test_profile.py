import json

import pandas as pd
import pytest
import torch

from labkit.measure.events import launch_links, parse_chrome_trace, summarize, thin
from labkit.measure.profile import Trace, trace
from labkit.measure.timeline import timeline_figure


def _x(cat, name, ts, dur, pid=1, tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid,
            "args": args}


def synthetic_gpu_trace():
    """Three launches 10 us apart; kernels of 2 us start 5 us after each launch."""
    ev = []
    for i in range(3):
        t = 100.0 + 10 * i
        ev.append(_x("cpu_op", "aten::add_", t, 8.0))
        ev.append(_x("cuda_runtime", "cudaLaunchKernel", t + 1, 4.0, correlation=i))
        ev.append(_x("kernel", "add_kernel", t + 6, 2.0, pid=0, tid=7, correlation=i,
                     device=0, stream=7))
    return {"traceEvents": ev + [{"ph": "M", "name": "thread_name"}]}


def test_parse_places_cpu_and_gpu_events_on_their_lanes_from_time_zero():
    df = parse_chrome_trace(synthetic_gpu_trace())
    assert set(df.lane) == {"CPU thread 1", "GPU 0 stream 7"}
    assert df.start_us.min() == 0
    assert (df[df.kind == "runtime"].depth == 1).all(), "a launch inside an op is nested"


def test_summary_of_a_launch_bound_gpu_trace():
    s = summarize(parse_chrome_trace(synthetic_gpu_trace()))
    assert s["kernel_count"] == 3 and s["launches"] == 3
    assert s["gpu_span_us"] == pytest.approx(22.0)
    assert s["gpu_busy_fraction"] == pytest.approx(6 / 22)
    assert s["idle_gaps"] == 2 and s["largest_gap_us"] == pytest.approx(8.0)
    assert s["mean_launch_to_start_us"] == pytest.approx(5.0)
    assert s["cpu_us_per_launch"] == pytest.approx(10.0)
    assert s["launch_api_us"] == pytest.approx(4.0)


def test_every_kernel_links_back_to_its_launch():
    links = launch_links(parse_chrome_trace(synthetic_gpu_trace()))
    assert list(links.start_us_gpu - links.start_us_cpu) == [5.0, 5.0, 5.0]


def test_thinning_keeps_gpu_work_and_launches_and_drops_short_cpu_events():
    df = parse_chrome_trace(synthetic_gpu_trace())
    kept, dropped = thin(df, max_events=7)
    assert dropped == 2 and len(kept) == 7
    assert (kept.kind == "kernel").sum() == 3 and (kept.kind == "runtime").sum() == 3


def test_timeline_draws_lanes_cpu_first_and_launch_arrows():
    fig = timeline_figure(parse_chrome_trace(synthetic_gpu_trace()), title="t")
    names = [t.name for t in fig.data]
    assert "GPU kernel" in names and "launch -> kernel" in names
    assert list(fig.layout.yaxis.categoryarray)[::-1] == ["CPU thread 1", "GPU 0 stream 7"]


def test_cpu_trace_of_a_chain_shows_one_top_level_op_per_call():
    x = torch.zeros(64)
    t = trace(lambda: [x.add_(1) for _ in range(12)], device="cpu")
    assert t.summary["top_level_ops"] == 12
    assert all(lane.startswith("CPU") for lane in t.events.lane)
    assert t.figure("cpu").data, "the figure has bars"


def test_trace_survives_a_round_trip_through_json(tmp_path):
    x = torch.zeros(8)
    t = trace(lambda: x.mul_(2), device="cpu")
    back = Trace.from_dict(json.loads(json.dumps(t.to_dict())))
    assert back.summary == t.summary
    pd.testing.assert_frame_equal(back.events.reset_index(drop=True),
                                  t.events.round(3).reset_index(drop=True), check_dtype=False)
    path = t.export_chrome(tmp_path / "t.json")
    with open(path) as f:
        assert json.load(f)["traceEvents"]


@pytest.mark.gpu
def test_gpu_trace_links_every_eager_kernel_and_graph_replay_is_one_launch():
    from labkit.lessons.launch_overhead import chain_runner

    dev = torch.device("cuda")
    eager = trace(chain_runner("eager", 1024, 20, dev), device=dev)
    assert eager.summary["kernel_count"] == 20 and eager.summary["launches"] == 20
    graph = trace(chain_runner("graph", 1024, 20, dev), device=dev)
    assert graph.summary["kernel_count"] == 20
    assert graph.summary["launches"] == 1, "a graph replay is one launch for all its kernels"
    assert graph.summary["gpu_busy_fraction"] > eager.summary["gpu_busy_fraction"]


def test_a_trace_keeps_stderr_free_of_the_profilers_notices_and_passes_real_messages():
    """Kineto writes `USDT:... profiler_start` / `profiler_stop` to fd 2, which a notebook shows
    as a red box under every timeline cell; a message the traced code writes to fd 2 is kept."""
    import subprocess
    import sys

    script = ("import os, torch\n"
              "from labkit.measure.profile import trace\n"
              "x = torch.zeros(8)\n"
              "trace(lambda: (x.mul_(2), os.write(2, b'real message\\n')), device='cpu', warmup=0)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, check=True)
    assert "USDT" not in out.stderr, out.stderr
    assert out.stderr.count("real message") == 3, f"each of the 3 traced calls writes one:\n{out.stderr}"
