import json

import pytest
import torch

from labkit.tools import recorded
from labkit.tools import NOTEBOOK_DIR
from labkit.tools.record import RECORDERS, resolve

GOOD_FP = {"gpu": "NVIDIA H200", "driver": "580.1", "cuda": "13.0", "torch": "2.11.0",
           "triton": "3.6.0", "python": "3.12.3", "interpreter": False}


NOTEBOOK_STEMS = sorted(p.stem.split("_", 1)[1] for p in NOTEBOOK_DIR.glob("[0-9][0-9]_*.ipynb"))
RECORDED_PARTS = [(stem, part) for stem in RECORDERS for part in RECORDERS[stem]]


def test_every_recorder_has_a_committed_recording():
    missing = [(stem, part) for stem, part in RECORDED_PARTS
               if stem not in recorded.available() or part not in recorded.parts(stem)]
    assert not missing, f"run `make record` on a CUDA host and commit {missing}"


def test_recordings_are_named_by_notebook_stem():
    assert set(RECORDERS) <= set(NOTEBOOK_STEMS)
    assert set(recorded.available()) <= set(RECORDERS), "a recording no recorder makes"


@pytest.mark.parametrize("stem,part", RECORDED_PARTS)
def test_committed_recordings_parse_and_say_exactly_where_they_came_from(stem, part):
    rec = recorded.load(stem, part)
    assert (rec.name, rec.part) == (stem, part)
    assert rec.fingerprint["gpu"] in rec.label and rec.fingerprint["driver"] in rec.label
    assert rec.date[:10] in rec.label and "not measured on this machine" in rec.label
    assert rec.data, "a recording holds data"


@pytest.mark.parametrize("stem,part", RECORDED_PARTS)
def test_every_recorder_names_a_function(stem, part):
    assert callable(resolve(RECORDERS[stem][part]))


def test_a_stem_of_several_parts_needs_the_part_named():
    with pytest.raises(ValueError, match="pitfalls"):
        recorded.load("cuda_graphs")
    with pytest.raises(recorded.RecordingMissing, match="no part 'nope'"):
        recorded.load("cuda_graphs", "nope")


def test_a_recording_without_a_gpu_fingerprint_is_rejected():
    raw = {"data": {"x": 1}, "fingerprint": dict(GOOD_FP, gpu=None), "date": "2026-11-29",
           "command": "make record"}
    with pytest.raises(ValueError, match="gpu"):
        recorded.validate(raw, "x")


def test_a_recording_made_under_the_interpreter_is_rejected():
    raw = {"data": {}, "fingerprint": dict(GOOD_FP, interpreter=True), "date": "2026-11-29",
           "command": "make record"}
    with pytest.raises(ValueError, match="interpreter"):
        recorded.validate(raw, "x")


def test_a_missing_recording_says_how_to_make_it():
    with pytest.raises(recorded.RecordingMissing, match="make record"):
        recorded.load("no_such_recording")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU host")
def test_recordings_cannot_be_written_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr(recorded, "DATA_DIR", tmp_path)
    with pytest.raises(RuntimeError, match="CUDA host"):
        recorded.save("fake", "part", {"x": 1})
    assert not list(tmp_path.iterdir())


def test_label_reads_back_from_a_valid_file(tmp_path, monkeypatch):
    monkeypatch.setattr(recorded, "DATA_DIR", tmp_path)
    (tmp_path / "demo.json").write_text(json.dumps({"parts": {"only":
        {"data": {"x": 1}, "fingerprint": GOOD_FP, "date": "2026-11-29T10:00:00+00:00",
         "command": "make record", "commit": "abcdef1234567"}}}))
    label = recorded.load("demo").label
    assert label.startswith("Recorded on NVIDIA H200") and "2026-11-29" in label
    assert "abcdef1234" in label


def test_make_record_skips_what_needs_more_gpus_but_refuses_it_by_name(monkeypatch, capsys):
    from labkit.tools import record
    from labkit.tools.recorded import NeedsMoreGPUs

    def two_gpus_only():
        raise NeedsMoreGPUs("tp_overlap needs 2 GPUs; this machine has 1")

    saved = []
    monkeypatch.setattr(record, "RECORDERS", {"one": {"a": "x:one", "b": "x:one"},
                                              "tp": {"mlp": "x:tp"}})
    monkeypatch.setattr(record, "resolve", lambda spec: two_gpus_only if spec == "x:tp"
                        else (lambda: {"ok": 1}))
    monkeypatch.setattr(record.recorded, "save",
                        lambda stem, part, data: saved.append(f"{stem}/{part}") or stem)
    assert record.main([]) == 0 and saved == ["one/a", "one/b"]
    assert "skipped  tp/mlp" in capsys.readouterr().out
    with pytest.raises(NeedsMoreGPUs, match="needs 2 GPUs"):
        record.main(["tp"])
    saved.clear()
    assert record.main(["one/b"]) == 0 and saved == ["one/b"]
    with pytest.raises(SystemExit):
        record.main(["one/c"])


def test_saving_one_part_keeps_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(recorded, "DATA_DIR", tmp_path)
    monkeypatch.setattr(recorded.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(recorded, "fingerprint", lambda: GOOD_FP)
    recorded.save("demo", "a", {"x": 1})
    recorded.save("demo", "b", {"x": 2})
    recorded.save("demo", "a", {"x": 3})
    assert recorded.parts("demo") == ["a", "b"]
    assert recorded.load("demo", "a").data == {"x": 3} and recorded.load("demo", "b").data == {"x": 2}
