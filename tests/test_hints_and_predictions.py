"""Every exercise's hints and its "what you should have seen" box, and predictions revealed
against a measurement."""
import pytest

from labkit.teaching import exercises
from labkit.teaching.hints import hints, seen
from labkit.teaching.predict import PREDICTIONS, predict, reveal

EXERCISES = exercises.all_exercises()
IDS = sorted(EXERCISES)


@pytest.mark.parametrize("exercise_id", IDS)
def test_every_exercise_has_hints_and_what_you_should_have_seen(exercise_id):
    box = hints(exercise_id)
    assert len(box.children) == len(EXERCISES[exercise_id].hints) >= 2
    assert box.selected_index is None, "hints stay closed until the learner opens one"
    assert seen(exercise_id).selected_index is None and len(EXERCISES[exercise_id].seen) > 80


def test_reveal_without_a_prediction_says_so():
    predict("t.none", question="How many?", unit="x")
    shown = reveal("t.none", 4.0)
    assert shown.predicted is None and "No prediction entered" in repr(shown)


def test_reveal_sets_the_prediction_against_the_measurement():
    predict("t.two", question="How many?", unit="x", value=2)
    shown = reveal("t.two", 4.0)
    assert shown.predicted == 2 and "2x higher than you predicted" in repr(shown)
    PREDICTIONS["t.two"].box.value = "about 5 x"
    assert reveal("t.two", 5.0).predicted == 5 and "Within 10%" in reveal("t.two", 5.0).verdict()


def test_reveal_before_predict_is_an_error_that_says_what_to_run():
    with pytest.raises(KeyError, match="run the predict cell first"):
        reveal("t.never", 1.0)
