"""Hints that open on request, and "what you should have seen" once an exercise is done.

Both are collapsed ipywidgets Accordions: nothing is revealed until the learner clicks, and
nothing runs at creation (safe under papermill). The texts live with the exercise specs in
``labkit.teaching.exercises``, so a notebook cell is one call: ``hints("02.1")``, ``seen("02.1")``.
"""
from __future__ import annotations

import html
import re

import ipywidgets as widgets

from labkit.teaching import exercises


def to_html(text: str) -> str:
    """The little markdown the texts use: `code`, **bold**, blank-line paragraphs."""
    out = html.escape(text)
    out = re.sub(r"`([^`]+)`", r"<code>\1</code>", out)
    out = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", out)
    return "".join(f"<p>{p}</p>" for p in out.split("\n\n"))


def hint_box(texts, titles) -> widgets.Accordion:
    """One collapsed pane per text."""
    box = widgets.Accordion(children=[widgets.HTML(to_html(t)) for t in texts],
                            titles=tuple(titles))
    box.selected_index = None
    return box


def hints(exercise_id: str) -> widgets.Accordion:
    """The exercise's hints, each behind its own title: open them one at a time."""
    ex = exercises.get(exercise_id)
    if not ex.hints:
        raise ValueError(f"exercise {exercise_id} has no hints")
    n = len(ex.hints)
    return hint_box(ex.hints, [f"Hint {i + 1} of {n}" + (" (nearly the answer)" if i == n - 1 else "")
                               for i in range(n)])


def seen(exercise_id: str) -> widgets.Accordion:
    """What a correct solution shows, and why it matters: open it after your check passes."""
    ex = exercises.get(exercise_id)
    return hint_box([ex.seen], [f"What you should have seen ({exercise_id}): open after trying"])
