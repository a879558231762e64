"""The rule of measured truth: a sentence that states a measured fact is computed and checked.

    claim("Replay takes {graph_us:.1f} us per step, {gain:.1f}x faster than eager.",
          gain > 1.5, graph_us=graph_us, gain=gain)

renders the sentence from this run's values, marks whether its condition held on this machine,
shows it in the notebook and records it. ``claims()`` is every claim of the session as a table;
a notebook's last cell calls ``assert_claims_held()``. A claim that is only true on a GPU and is
checked on a CPU against a recording says so: pass ``recorded=`` the recording it was checked
against, and its label is shown with the sentence.

The condition is a plain bool computed from the same values, so a test can perturb the values
(two timings swapped) and see the claim fail: a claim that cannot fail checks nothing.
"""
from __future__ import annotations

import html
import json
import os
import string
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

HELD, FAILED = "held", "did not hold"
# Where a headless run (labkit.tools.run_notebooks) collects every claim its kernel makes, one
# JSON line each, to list them beside the run's summary.
LOG_ENV = "LABKIT_CLAIMS_LOG"


def headless() -> bool:
    """Whether this kernel runs under a headless executor (papermill, from
    labkit.tools.run_notebooks) rather than in front of a learner."""
    return bool(os.environ.get(LOG_ENV))


@dataclass
class Claim:
    text: str                        # the sentence with its values filled in
    held: bool
    values: dict = field(default_factory=dict)
    source: str = "measured here"    # or the label of the recording it was checked against
    _shown: bool = field(default=False, repr=False)

    def markdown(self) -> str:
        mark = "✅" if self.held else "❌"
        verdict = HELD if self.held else FAILED
        where = "" if self.source == "measured here" else f" <sup>checked against: {html.escape(self.source)}</sup>"
        return f"{mark} {self.text} *({verdict} on this run)*{where}"

    def _repr_markdown_(self) -> str:
        return self.markdown()

    def _ipython_display_(self):
        if not self._shown:  # claim() already displayed it: a cell ending in claim(...) shows it once
            from IPython.display import Markdown, display
            self._shown = True
            display(Markdown(self.markdown()))

    def __str__(self) -> str:
        return f"[{HELD if self.held else FAILED}] {self.text}"


_CLAIMS: list[Claim] = []


def _as_bool(holds) -> bool:
    if isinstance(holds, (bool, np.bool_)):
        return bool(holds)
    raise TypeError(f"holds must be the claim's condition as a bool (e.g. gain > 1.5), got "
                    f"{type(holds).__name__} {holds!r}: a number is not a verdict")


def _plain(value):
    """numpy scalars print as np.float64(...) in a table: keep plain Python values."""
    return value.item() if isinstance(value, np.generic) else value


def claim(text: str, holds, *, recorded=None, **values) -> Claim:
    """Render ``text`` with ``values`` (``{name}`` or ``{name:.1f}`` fields), mark whether
    ``holds``, record it and show it (in a notebook). Every field must be given: a measured number
    is never typed into the sentence. ``recorded``: the recording the claim was checked against
    (anything with a ``label``), where the phenomenon needs a GPU this machine does not have."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("text must be the sentence the learner reads")
    held = _as_bool(holds)
    fields = {f.split(".")[0].split("[")[0] for _, f, _, _ in string.Formatter().parse(text) if f}
    missing = sorted(f for f in fields if f not in values)
    if missing:
        raise ValueError(f"the claim's text uses {missing} but no value was given for them: "
                         "pass each as a keyword, computed from this run")
    plain = {k: _plain(v) for k, v in values.items()}
    if recorded is not None and not getattr(recorded, "label", None):
        raise TypeError("recorded must be a recording with a label (labkit.tools.recorded.load)")
    c = Claim(text.format(**plain), held, plain,
              recorded.label if recorded is not None else "measured here")
    _CLAIMS.append(c)
    _log(c)
    try:
        from IPython import get_ipython
        if get_ipython() is not None:
            c._ipython_display_()
    except ImportError:
        pass
    return c


def _log(c: Claim) -> None:
    path = os.environ.get(LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"claim": c.text, "held": c.held, "checked": c.source,
                                "values": c.values}, default=str) + "\n")


def claims() -> pd.DataFrame:
    """Every claim made in this session: the sentence, whether it held, where it was checked."""
    return pd.DataFrame([{"claim": c.text, "held": c.held, "checked": c.source}
                         for c in _CLAIMS], columns=["claim", "held", "checked"])


def reset_claims() -> None:
    _CLAIMS.clear()


def assert_claims_held(minimum: int = 1) -> pd.DataFrame:
    """A notebook's last check: at least ``minimum`` claims were made and every one held."""
    table = claims()
    if len(table) < minimum:
        raise AssertionError(f"{len(table)} claims were made, at least {minimum} expected: a "
                             "notebook that claims nothing has checked nothing")
    failed = [c for c in _CLAIMS if not c.held]
    if failed:
        raise AssertionError("claims that did not hold on this run:\n" +
                             "\n".join(f"- {c.text} ({c.source})" for c in failed))
    return table
