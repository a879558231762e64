"""labkit.teaching.claim: a measured sentence is rendered from values, checked, recorded."""
import pytest

from labkit import teaching
from labkit.teaching import assert_claims_held, claim, claims


class FakeRecording:
    label = "Recorded on NVIDIA H200, 2026-11-29; not measured on this machine"


def graph_claim(eager_us, graph_us):
    gain = eager_us / graph_us
    return claim("Replay takes {graph_us:.1f} us, {gain:.2f}x faster than eager.", gain > 1.5,
                 graph_us=graph_us, gain=gain)


def test_a_claim_renders_its_values_and_says_whether_it_held():
    c = graph_claim(30.0, 10.0)
    assert c.held and c.text == "Replay takes 10.0 us, 3.00x faster than eager."
    assert "held on this run" in c.markdown()


def test_the_same_claim_fails_when_its_timings_are_swapped():
    assert not graph_claim(10.0, 30.0).held
    with pytest.raises(AssertionError, match="did not hold"):
        assert_claims_held()


def test_claims_are_recorded_in_order_as_a_table():
    graph_claim(30.0, 10.0)
    claim("The cache holds {n} blocks.", True, n=4, recorded=FakeRecording())
    table = claims()
    assert list(table.held) == [True, True]
    assert table.claim[1] == "The cache holds 4 blocks."
    assert table.checked[0] == "measured here" and "NVIDIA H200" in table.checked[1]
    assert len(assert_claims_held(minimum=2)) == 2


def test_a_value_the_text_needs_must_be_given():
    with pytest.raises(ValueError, match=r"\['gain'\]"):
        claim("{gain:.1f}x faster", True)
    assert claims().empty, "a refused claim is not recorded"


def test_a_number_is_not_a_verdict():
    with pytest.raises(TypeError, match="bool"):
        claim("{x} is large", 3.0, x=3.0)


def test_numpy_values_read_as_plain_numbers():
    import numpy as np
    c = claim("{n} kernels, {ok}", np.float64(150.0) > 1, n=np.int64(150), ok=np.bool_(True))
    assert c.text == "150 kernels, True" and c.held is True


def test_a_notebook_with_no_claims_has_checked_nothing():
    with pytest.raises(AssertionError, match="0 claims"):
        assert_claims_held()


def test_claim_is_reachable_as_the_issue_names_it():
    assert teaching.claim is claim and teaching.claims is claims


def test_a_headless_run_collects_every_claim_in_its_log(tmp_path, monkeypatch):
    import json

    from labkit.teaching.truth import LOG_ENV
    log = tmp_path / "claims.jsonl"
    monkeypatch.setenv(LOG_ENV, str(log))
    graph_claim(30.0, 10.0)
    graph_claim(10.0, 30.0)
    made = [json.loads(line) for line in log.read_text().splitlines()]
    assert [m["held"] for m in made] == [True, False]
    assert made[1]["values"] == {"graph_us": 30.0, "gain": 10.0 / 30.0}


def test_the_claims_summary_lists_every_notebooks_claims_and_what_failed(tmp_path):
    from labkit.tools.run_notebooks import NotebookRun, write_claims
    run = NotebookRun("01_x", "ok", 1.0, 1, 1, 10, "", 0, claims=[
        {"claim": "A is fast.", "held": True, "checked": "measured here"},
        {"claim": "B is slow.", "held": False, "checked": "Recorded on H200"}])
    text = write_claims([run], tmp_path / "claims.md").read_text()
    assert "01_x: 1 of 2 claims held" in text and "DID NOT HOLD: B is slow. (Recorded on H200)" in text
    assert run.claims_failed == 1
