"""What every notebook does first: pick the device and say where we are; show a recording."""
from __future__ import annotations

import torch

from labkit.device import describe, select_device
from labkit.teaching.truth import reset_claims
from labkit.tools import recorded


def start(device: str = "auto") -> torch.device:
    """Pick the device, make plotly figures light (no plotly.js copy per output), say where we
    are, and start the notebook's list of claims afresh (a rerun does not count them twice)."""
    import pandas as pd
    import plotly.io as pio

    pio.renderers.default = "plotly_mimetype"
    pd.set_option("display.max_colwidth", None)  # a table's text is read whole, not cut at 50
    reset_claims()
    dev = select_device(device)
    print(describe())
    return dev


def recorded_or_none(stem: str, part: str | None = None) -> recorded.Recorded | None:
    """The recording, or None with a printed note saying how to create it."""
    try:
        return recorded.load(stem, part)
    except recorded.RecordingMissing as e:
        print(f"(no recorded GPU figures: {e})")
        return None
