"""Notebook 07's library, the parts a GPU host makes: ``make record``'s sections on tiny sizes,
the notebooks' defaults against the recording, and the forward's graph replay on a GPU."""
import json

import pandas as pd
import pytest
import torch

from labkit.engine import ModelConfig, random_model
from labkit.lessons.prefill_vs_decode import bounds, cost, forward
from labkit.lessons.prefill_vs_decode import chunked_prefill as cp


# ----------------------------------------------------------------------------- make record
def test_record_on_cpu_with_tiny_sizes_gives_every_section_as_json():
    data = forward.record("cpu", ModelConfig.tiny(), [cost.prefill(16), cost.decode(2, 16)], engine=dict(
        latency_batches=(1, 2), latency_prompt=8, latency_prompts=(4, 16), latency_batch=2,
        max_tokens=3, num_running=2, running_tokens=6, long_prompt=32, chunk_budget=8,
        arrive_after=2, kv_cache_memory=None), rounds=3, repeats=2)  # the fused ops: interpreted
    data = json.loads(json.dumps(data, allow_nan=False))  # plain JSON, no NaN
    assert {"config", "peaks", "points", "profiles", "engine", "fused",
            "context_growth"} <= set(data)
    assert "floor_ms" in data["points"], "each point's floor, timed in its rounds"
    growth = data["context_growth"]
    assert len(growth["ratio"]) == 3 and growth["bytes_ratio"] > 1, "one ratio a round"
    fused = pd.DataFrame(data["fused"]["points"])
    assert fused["shape"].tolist() == ["prefill S=16", "decode B=2 ctx 16"]
    assert set(data["fused"]["profiles"]) == {"decode B=2 ctx 16"}
    gain = bounds.fused_gain(pd.DataFrame(data["points"]), fused, copy_gbps=100.0)
    assert len(gain) == 2 and (gain.ms_fused == fused.ms).all()
    assert (gain.speedup == gain.ms / gain.ms_fused).all(), "speed-up: unfused time / fused"
    assert (gain.share_of_copy_fused == fused.gbps / 100.0).all()
    assert pd.DataFrame(data["points"])["shape"].tolist() == ["prefill S=16", "decode B=2 ctx 16"]
    assert set(data["profiles"]) == {"prefill S=16", "decode B=2 ctx 16"}
    engine = data["engine"]
    assert len(engine["by_batch"]["batch"]) == 2 and len(engine["by_prompt"]["prompt_len"]) == 2
    on, off = (cp.Interference.from_dict(d) for d in engine["interference"])
    assert on.chunked and not off.chunked and off.budget == 32 + 2
    assert not on.async_scheduling and not off.async_scheduling, "each step timed synchronised"
    assert "prefill_steps" in engine["by_prompt"] and "ttft_low_ms" in engine["by_prompt"]


def test_the_notebook_defaults_are_the_recorded_gpu_sizes():
    from labkit.tools import NOTEBOOK_DIR

    nb = json.loads((NOTEBOOK_DIR / "07_prefill_vs_decode.ipynb").read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    params: dict = {}
    exec("".join(cell["source"]), params)  # the parameters cell is plain assignments
    recorded = [s.name for s in forward.GPU_SHAPES]
    notebook = [cost.prefill(s).name for s in params["PREFILL_LENS"]] + [
        cost.decode(b, params["CONTEXT"]).name for b in params["DECODE_BATCHES"]]
    assert notebook == recorded, "the notebook on a GPU should measure what make record keeps"


def test_the_appendix_reads_notebook_07_at_its_sizes():
    from labkit.tools import NOTEBOOK_DIR

    def parameters(name):
        nb = json.loads((NOTEBOOK_DIR / name).read_text())
        cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
        params: dict = {}
        exec("".join(cell["source"]), params)  # the parameters cell is plain assignments
        return {k: v for k, v in params.items() if k.isupper()}

    main, appendix = (parameters(n) for n in ("07_prefill_vs_decode.ipynb",
                                              "07a_prefill_decode_deep_dives.ipynb"))
    own = {"CHUNK_BUDGETS"}  # section 4's budget sweep, which 07 does not run
    shared = set(appendix) - own
    assert shared <= set(main), "07a's sizes are a subset of 07's, by the same names"
    assert {k: main[k] for k in shared} == {k: appendix[k] for k in shared}, "and the same values"
    assert own <= set(appendix) and appendix["CHUNK_BUDGET"] in appendix["CHUNK_BUDGETS"], \
        "the sweep includes the budget 07 runs with"


# ----------------------------------------------------------------------------- on a GPU
@pytest.fixture(scope="module")
def gpu_model():
    cfg = ModelConfig.tiny(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                           num_attention_heads=16, num_key_value_heads=4, torch_dtype="bfloat16")
    return random_model(cfg, seed=0, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [cost.prefill(64), cost.decode(4, 128)], ids=lambda s: s.kind)
def test_graph_replay_computes_the_eager_logits(gpu_model, shape):
    from labkit.graphs import capture_graph

    step = forward.forward_step(gpu_model, shape)
    eager = step()
    graph, out = capture_graph(step)
    graph.replay()
    torch.testing.assert_close(out, eager, msg="a replay computes what the eager call computed")


@pytest.mark.gpu
def test_graph_replay_speeds_up_a_small_decode_step(gpu_model):
    gain = bounds.graph_gain(forward.time_forwards(gpu_model, [cost.decode(1, 128)], forward.MODES,
                                            floor=False))
    assert gain.speedup.iloc[0] > 1.3, (
        f"a small decode step should be launch-bound eagerly; replay gave "
        f"{gain.speedup.iloc[0]:.2f}x")


def test_shapes_accept_numpy_ints_from_a_table():
    import numpy as np

    from labkit.lessons.prefill_vs_decode.cost import decode
    shape = decode(np.int64(4), np.int64(128))
    assert (shape.batch, shape.context) == (4, 128) and type(shape.batch) is int
