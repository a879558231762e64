"""What every notebook does first: pick the device and say where we are; show a recording."""
from __future__ import annotations

import pandas as pd
import torch

from labkit.device import describe, select_device
from labkit.teaching.truth import reset_claims
from labkit.tools import recorded


def start(device: str = "auto") -> torch.device:
    """Pick the device, make plotly figures light (no plotly.js copy per output), say where we
    are, and start the notebook's list of claims afresh (a rerun does not count them twice)."""
    import numpy as np
    import plotly.io as pio

    pio.renderers.default = "plotly_mimetype"
    pd.set_option("display.max_colwidth", None)  # a table's text is read whole, not cut at 50
    # six significant digits, no padding zeros: a share reads 0.0265, a whole ratio 1, never 1.000000
    pd.set_option("display.float_format", "{:.6g}".format)
    warnings_as_text()
    np.set_printoptions(legacy="1.25")  # a printed scalar reads 256.0, not np.float64(256.0)
    show_counts_as_integers()
    reset_claims()
    dev = select_device(device)
    print(describe())
    return dev


def warnings_as_text() -> None:
    """Python warnings print under the cell as plain text, "warning (Category): message", once
    each as Python's filters decide, instead of going to stderr, which a notebook shows as a red
    box that reads as a crash. They are shown, not dropped."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"warning ({category.__name__}): {message}")

    warnings.showwarning = show


def whole_counts(table: pd.DataFrame | pd.Series) -> pd.DataFrame | pd.Series:
    """``table`` with each float column whose values are all whole numbers as integers (Int64,
    NaN shown as <NA>). A count becomes a float on its way through a table (a NaN beside it, a
    mean of equal counts, a row built from floats) and would print as ``150.0``."""
    def whole(col: pd.Series) -> bool:
        values = col.dropna()
        return (pd.api.types.is_float_dtype(col.dtype) and not values.empty
                and bool((values.abs() < 2**53).all() and (values % 1 == 0).all()))

    if isinstance(table, pd.Series):
        return table.astype("Int64") if whole(table) else table
    columns = [i for i in range(table.shape[1]) if whole(table.iloc[:, i])]
    if not columns:
        return table
    out = table.copy()
    for i in columns:
        out.isetitem(i, out.iloc[:, i].astype("Int64"))
    return out


def show_counts_as_integers() -> None:
    """Make the notebook show every DataFrame and Series through ``whole_counts``."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:  # a plain script: nothing displays tables
        return
    formatters = shell.display_formatter.formatters
    formatters["text/html"].for_type(pd.DataFrame, lambda df: whole_counts(df)._repr_html_())
    for kind in (pd.DataFrame, pd.Series):
        formatters["text/plain"].for_type(kind, lambda t, p, cycle: p.text(repr(whole_counts(t))))


def recorded_or_none(stem: str, part: str | None = None) -> recorded.Recorded | None:
    """The recording, or None with a printed note saying how to create it."""
    try:
        return recorded.load(stem, part)
    except recorded.RecordingMissing as e:
        print(f"(no recorded GPU figures: {e})")
        return None
