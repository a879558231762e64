import os
import shutil

import pytest
import torch

import labkit  # noqa: F401  (before anything imports triton: interpreter on where there is no GPU)
from labkit.teaching import reset_claims


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: run by `make gpu-check` on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_claims():
    """Claims are kept in one list per process (a notebook's kernel): each test starts and ends
    with it empty, so no test sees another's claims."""
    reset_claims()
    yield
    reset_claims()


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Debian's chromium, no browser download; background networking off (this machine's network
# refuses it, and a test must not depend on it).
CHROMIUM_FLAGS = ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update"]


@pytest.fixture(scope="session")
def chromium():
    """One headless Chromium for the browser and handout tests (fails in CI if missing)."""
    if CHROMIUM is None:
        message = "chromium is not installed: `make test` installs it (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message + "; CI always runs this test")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


NOTEBOOK_RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "test-results", "notebooks")
_executed: dict = {}


@pytest.fixture(scope="session")
def executed_notebook():
    """``executed_notebook(path)``: the notebook run once per session by papermill on CPU with
    QUICK sizes (as CI does), its copy in test-results/notebooks/. The notebook test checks the
    run; the browser test opens the same executed copy, so no notebook runs twice."""
    from pathlib import Path

    from labkit.tools.run_notebooks import execute

    def run(path):
        if path not in _executed:
            _executed[path] = execute(path, Path(NOTEBOOK_RESULTS), {"DEVICE": "auto",
                                                                     "QUICK": True})
        return _executed[path]
    return run
