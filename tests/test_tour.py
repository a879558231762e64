"""Notebook 00's lesson: the sequence and concept maps, the ceilings beside the datasheet, and
claims that fail when their numbers are perturbed."""
import pytest
import torch

from labkit.lessons import tour
from labkit.tools import recorded


@pytest.fixture
def h200():
    return recorded.load("tour")


def test_the_sequence_lists_the_notebooks_that_exist_without_a_leftover_column():
    table = tour.sequence_table(torch.device("cpu"))
    assert list(table.notebook[:2]) == ["00_tour", "01_launch_overhead"] and len(table) >= 10
    assert "here" not in table.columns


def test_every_concept_names_sections_and_exercises_that_exist():
    concepts = tour.concept_map(torch.device("cpu"))
    assert len(concepts) == 26
    missing = [p for _, places, _ in tour.CONCEPTS for p in places if not tour.place_exists(p)]
    assert not missing, f"the concept map points at sections or exercises no notebook has: {missing}"
    assert not tour.place_exists("02 §9") and not tour.place_exists("02.9")
    assert not tour.place_exists("02 §No such heading")


def test_the_concept_map_says_what_is_live_on_this_machine():
    cpu = tour.concept_map(torch.device("cpu")).set_index("concept")["on this machine"]
    assert cpu["Pinned vs pageable memory"].startswith("recorded")
    assert cpu["dynamic=True vs shape buckets"] == "live"
    assert cpu["Speculative verification: several new tokens checked in one forward"] == "live"
    gpu = tour.concept_map(torch.device("cuda")).set_index("concept")["on this machine"]
    assert gpu["Pinned vs pageable memory"] == "live"


def test_a_concept_with_no_place_says_it_is_not_written_yet(monkeypatch):
    monkeypatch.setattr(tour, "CONCEPTS", [("something new", (), False)])
    assert tour.concept_map(torch.device("cpu"))["on this machine"].tolist() == ["not yet written"]


def test_the_recorded_ceilings_hold_their_claims_against_the_datasheet(h200):
    made = tour.ceiling_claims(h200.data, h200.fingerprint["gpu"], recorded=h200)
    assert len(made) == 3 and all(c.held for c in made)
    assert "checked" not in made[0].text and h200.label == made[0].source


@pytest.mark.parametrize("key,factor,which", [("copy_GBps", 1.3, 0), ("copy_GBps", 0.4, 0),
                                              ("matmul_TFLOPs", 0.3, 1), ("matmul_TFLOPs", 1.3, 1)])
def test_a_ceiling_claim_fails_when_its_number_leaves_the_plausible_range(h200, key, factor, which):
    perturbed = dict(h200.data, **{key: h200.data[key] * factor})
    assert not tour.ceiling_claims(perturbed, "NVIDIA H200", recorded=h200)[which].held


def test_the_ridge_is_the_matmul_rate_over_the_copy_rate():
    assert tour.ridge({"matmul_TFLOPs": 100.0, "copy_GBps": 1000.0}) == pytest.approx(100.0)
    assert not tour.ceiling_claims({"matmul_TFLOPs": 0.5, "copy_GBps": 1000.0, "matmul_dtype": "x"},
                                   None)[0].held, "a ridge below 1 FLOP/B: decode is not memory-bound"


def test_the_machine_comparison_fails_with_the_machines_swapped(h200):
    cpu = {"copy_GBps": 10.0, "matmul_TFLOPs": 0.1}
    assert tour.machines_claim(cpu, h200).held
    swapped = type(h200)(h200.name, {"copy_GBps": 1.0, "matmul_TFLOPs": 0.01}, h200.fingerprint,
                         h200.date, h200.command)
    assert not tour.machines_claim(cpu, swapped).held


def test_todays_ceilings_must_agree_with_the_recording(h200):
    assert tour.recording_agrees_claim(dict(h200.data), h200).held
    slow = dict(h200.data, copy_GBps=h200.data["copy_GBps"] * 0.5)
    assert not tour.recording_agrees_claim(slow, h200).held


def test_a_launch_floor_below_half_a_microsecond_is_not_believed():
    ceil = {"copy_GBps": 4000.0}
    assert tour.launch_floor_claim(7.0, ceil).held and not tour.launch_floor_claim(0.1, ceil).held


def test_the_graph_floor_claim_holds_when_replay_is_cheaper_in_every_round():
    floor = {"eager_us": [7.6, 7.4, 7.9], "graph_us": [1.2, 1.1, 1.3]}
    made = tour.graph_floor_claim(floor)
    assert made.held and "in every round" in made.text
    swapped = {"eager_us": floor["graph_us"], "graph_us": floor["eager_us"]}
    assert not tour.graph_floor_claim(swapped).held
    one_round_equal = {"eager_us": [7.6, 7.4, 1.0], "graph_us": [1.2, 1.1, 1.3]}
    assert not tour.graph_floor_claim(one_round_equal).held


def test_the_graph_floor_is_read_from_notebook_01s_recording_without_a_gpu():
    rec = recorded.load("launch_overhead", "sweep")
    floor = tour.recorded_graph_floor(rec.data["sweep"])
    made = tour.graph_floor_claim(floor, recorded=rec)
    assert made.held and "(recorded)" in made.text and "round" not in made.text
