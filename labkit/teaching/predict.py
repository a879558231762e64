"""Predict, then measure: write down the number you expect before the cell that measures it.

    predict("02.waste", question="What share of computed rows is padding?", unit="%")
    ... the measurement ...
    reveal("02.waste", measured)

``predict`` shows a text box and returns at once: nothing waits for input, so a notebook run
headless (papermill) goes straight through, and ``reveal`` then says no prediction was entered.
The boxes are kept by name in ``PREDICTIONS`` (this module's only state).
"""
from __future__ import annotations

import html
import re
from dataclasses import dataclass

import ipywidgets as widgets
from IPython.display import display


@dataclass
class Prediction:
    name: str
    question: str
    unit: str
    box: widgets.Text

    def value(self) -> float | None:
        """The number typed in the box (units and separators tolerated), or None."""
        text = self.box.value.replace(",", "").strip()
        match = re.search(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", text)
        return float(match.group(0)) if match else None


PREDICTIONS: dict[str, Prediction] = {}


def predict(name: str, *, question: str, unit: str = "", value: float | None = None) -> None:
    """Show the question and a box for the learner's number. ``value`` fills it in (tests)."""
    box = widgets.Text(value="" if value is None else str(value), placeholder="your guess",
                       layout=widgets.Layout(width="10em"))
    PREDICTIONS[name] = Prediction(name, question, unit, box)
    display(widgets.VBox([widgets.HTML(f"<b>Predict:</b> {html.escape(question)}"),
                          widgets.HBox([box, widgets.Label(unit)])]))


@dataclass
class Reveal:
    name: str
    question: str
    measured: float
    predicted: float | None
    unit: str
    entered: str = ""

    @property
    def ratio(self) -> float | None:
        if self.predicted is None or self.predicted == 0 or self.measured == 0:
            return None
        return self.measured / self.predicted

    def verdict(self) -> str:
        if self.predicted is None:
            if self.entered:
                return (f"Could not read {self.entered!r} as a number: type just the number, "
                        "then run this cell again.")
            return ("No prediction entered. Next time, type your guess in the box above the "
                    "measurement first: a number written down before you look is what makes the "
                    "result teach you something. (Type it now and rerun this cell.)")
        r = self.ratio
        if r is None:
            return "Predicted and measured differ; one of them is zero." if \
                self.predicted != self.measured else "Exactly right."
        if r < 0:
            return "The measurement has the opposite sign of your prediction."
        if 0.9 <= r <= 1.1:
            return "Within 10%: well judged."
        factor, way = (r, "higher") if r > 1 else (1 / r, "lower")
        return f"The measurement is {factor:.3g}x {way} than you predicted."

    def __repr__(self) -> str:
        guess = "-" if self.predicted is None else f"{self.predicted:g} {self.unit}"
        return (f"{self.question}\n  predicted: {guess}\n  measured:  {self.measured:.4g} "
                f"{self.unit}\n  {self.verdict()}")

    def _repr_html_(self) -> str:
        guess = "&ndash;" if self.predicted is None else f"{self.predicted:g} {html.escape(self.unit)}"
        return ('<div style="border-left:4px solid #4a7bd0;padding:.4em .8em;margin:.3em 0">'
                f"<b>{html.escape(self.question)}</b><br>predicted: {guess}<br>"
                f"measured: <b>{self.measured:.4g} {html.escape(self.unit)}</b><br>"
                f"<i>{html.escape(self.verdict())}</i></div>")


def reveal(name: str, measured: float, *, unit: str | None = None) -> Reveal:
    """The prediction named ``name`` (if any) against ``measured``."""
    if name not in PREDICTIONS:
        raise KeyError(f"no predict({name!r}, ...) was shown in this session; run the predict "
                       f"cell first (known: {sorted(PREDICTIONS)})")
    p = PREDICTIONS[name]
    return Reveal(name, p.question, float(measured), p.value(),
                  p.unit if unit is None else unit, p.box.value.strip())
