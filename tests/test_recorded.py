import json

import pytest
import torch

from labkit import recorded
from labkit.record import RECORDERS, _resolve

GOOD_FP = {"gpu": "NVIDIA H200", "driver": "580.1", "cuda": "13.0", "torch": "2.11.0",
           "triton": "3.6.0", "python": "3.12.3", "interpreter": False}


def test_every_recorder_has_a_committed_recording():
    missing = set(RECORDERS) - set(recorded.available())
    assert not missing, f"run `make record` on a CUDA host and commit {sorted(missing)}"


@pytest.mark.parametrize("name", recorded.available())
def test_committed_recordings_parse_and_say_exactly_where_they_came_from(name):
    rec = recorded.load(name)
    assert rec.fingerprint["gpu"] in rec.label and rec.fingerprint["driver"] in rec.label
    assert rec.date[:10] in rec.label and "not measured on this machine" in rec.label
    assert rec.data, "a recording holds data"


@pytest.mark.parametrize("name", list(RECORDERS))
def test_every_recorder_names_a_function(name):
    assert callable(_resolve(RECORDERS[name]))


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
        recorded.save("fake", {"x": 1})
    assert not list(tmp_path.iterdir())


def test_label_reads_back_from_a_valid_file(tmp_path, monkeypatch):
    monkeypatch.setattr(recorded, "DATA_DIR", tmp_path)
    (tmp_path / "demo.json").write_text(json.dumps(
        {"data": {"x": 1}, "fingerprint": GOOD_FP, "date": "2026-11-29T10:00:00+00:00",
         "command": "make record", "commit": "abcdef1234567"}))
    label = recorded.load("demo").label
    assert label.startswith("Recorded on NVIDIA H200") and "2026-11-29" in label
    assert "abcdef1234" in label


def test_make_record_skips_what_needs_more_gpus_but_refuses_it_by_name(monkeypatch, capsys):
    from labkit import record
    from labkit.recorded import NeedsMoreGPUs

    def two_gpus_only():
        raise NeedsMoreGPUs("tp_overlap needs 2 GPUs; this machine has 1")

    saved = []
    monkeypatch.setattr(record, "RECORDERS", {"one": "x:one", "tp": "x:tp"})
    monkeypatch.setattr(record, "_resolve", lambda spec: two_gpus_only if spec == "x:tp"
                        else (lambda: {"ok": 1}))
    monkeypatch.setattr(record.recorded, "save", lambda name, data: saved.append(name) or name)
    assert record.main([]) == 0 and saved == ["one"]
    assert "skipped  tp" in capsys.readouterr().out
    with pytest.raises(NeedsMoreGPUs, match="needs 2 GPUs"):
        record.main(["tp"])
