"""``LLM(device_step_times=True)``: each step's time on the device beside its wall time, where
the wall time holds the host's scheduling and read-back too."""
import pytest
import torch

from labkit.engine import LLM, ModelConfig, SamplingParams, SpeculativeConfig, random_model


def test_on_a_cpu_there_is_no_device_clock_and_nothing_is_recorded():
    llm = LLM(random_model(ModelConfig.tiny(), seed=0), device="cpu", device_step_times=True)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3))
    assert not llm.device_step_times
    assert [r.device_s for r in llm.step_history] == [None] * len(llm.step_history)
    assert llm.history_table().device_ms.isna().all()


@pytest.mark.gpu
@pytest.mark.parametrize("speculate", [False, True])
def test_gpu_every_step_has_a_device_time_within_its_wall_time(speculate):
    model = random_model(ModelConfig.tiny(), seed=0, device="cuda")
    spec = SpeculativeConfig("controlled", num_speculative_tokens=3, acceptance=1.0) \
        if speculate else None
    llm = LLM(model, speculative=spec, device_step_times=True, async_scheduling=False)
    llm.generate([[1, 2, 3, 4]] * 3, SamplingParams(max_tokens=12))
    steps = llm.step_history
    assert steps and all(r.device_s is not None and r.device_s > 0 for r in steps)
    # without async scheduling a step's wall clock starts before its first launch and stops
    # after its samples were read, so its device time falls inside it
    assert all(r.device_s <= r.duration_s * 1.01 for r in steps), \
        [(r.device_s, r.duration_s) for r in steps]
    if speculate:
        assert any(r.graph == "full verify" for r in steps)
    plain = LLM(model)  # off by default: no events, no time
    plain.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4))
    assert all(r.device_s is None for r in plain.step_history)
    torch.cuda.synchronize()
