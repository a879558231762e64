"""benchmarks/mixed_step.py on CPU: it times what it says.

The mixed-step benchmark's timed steps must each be one prompt chunk beside every running
decode (it refuses a run where one was not), in each engine. (benchmarks/decode_floor.py's byte
count is ``labkit.lessons.prefill_vs_decode.ladder.step_bytes``: tests/test_decode_ladder.py.)
"""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from labkit.engine import random_model

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}",
                                                  ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


mixed = load("mixed_step")


def test_every_engine_times_mixed_steps_in_both_loops():
    cfg = mixed.MixedConfig.small()
    results = mixed.run(cfg)
    rows = results["rows"]
    assert {(r["cudagraph_mode"], r["async_scheduling"]) for r in rows} == {
        ("none", False), ("none", True)}
    for r in rows:
        assert len(r["wall_ms"]["values"]) == cfg.rounds
        assert 0 < r["wall_ms"]["low"] <= r["wall_ms"]["median"] <= r["wall_ms"]["high"]
        assert r["graph"] == ["eager"]
        assert "ratio" not in r, "no GPU time on CPU: nothing to divide by"


def test_a_round_refuses_steps_that_are_not_mixed():
    cfg = mixed.MixedConfig.small()
    model = random_model(cfg.model_config, seed=0, dtype=torch.float32)
    llm = mixed.make_engine(model, cfg, "none", False)
    # A budget of the whole running batch plus a wider chunk: a round sees other steps.
    wrong = mixed.MixedConfig(**{**cfg.__dict__, "chunk": cfg.chunk // 2})
    with pytest.raises(RuntimeError, match="were not a 16-token chunk beside 7 decodes"):
        mixed.one_round(llm, wrong, seed=0, profile=False)


def test_config_refuses_a_prompt_too_short_to_time():
    with pytest.raises(ValueError, match="fewer than measured_steps"):
        mixed.MixedConfig(long_prompt=512 * 4)
