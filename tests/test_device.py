import os

import pytest
import torch

import labkit
from labkit.device import describe, fingerprint, interpreter_on, select_device


def test_auto_picks_the_gpu_exactly_when_there_is_one():
    assert select_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_cpu_can_always_be_forced():
    assert select_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for cuda where there is none")
def test_asking_for_cuda_without_one_says_what_to_do_instead():
    with pytest.raises(RuntimeError, match=r'no CUDA device.*DEVICE="auto"'):
        select_device("cuda")


def test_an_unknown_device_name_is_rejected_with_the_choices():
    with pytest.raises(ValueError, match="auto"):
        select_device("tpu")


def test_interpreter_is_on_exactly_without_a_gpu():
    assert interpreter_on() == (not torch.cuda.is_available())
    if not torch.cuda.is_available():
        assert os.environ["TRITON_INTERPRET"] == "1"


def test_fingerprint_names_every_version_a_figure_depends_on():
    fp = fingerprint()
    for key in ("gpu", "driver", "cuda", "torch", "triton", "python", "interpreter"):
        assert key in fp
    assert fp["torch"] == torch.__version__ and fp["triton"]
    assert fp["interpreter"] == interpreter_on()
    assert ("[interpreter]" in describe(fp)) == fp["interpreter"]
    assert labkit.fingerprint is fingerprint


@pytest.mark.gpu
def test_fingerprint_on_a_gpu_has_name_driver_and_capability():
    fp = fingerprint()
    assert fp["gpu"] and fp["driver"] and fp["compute_capability"] and not fp["interpreter"]
