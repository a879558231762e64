import labkit  # noqa: F401  (before anything imports triton: interpreter on where there is no GPU)
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run by `make gpu-check` on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
