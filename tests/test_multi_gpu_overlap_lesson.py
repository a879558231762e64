"""Notebook 09's lesson: its claims hold on the committed 2xH200 recording (or on synthetic rounds
shaped like a real 2-GPU run) and fail when the numbers behind them are perturbed (serial and
overlapped traces swapped, widths reversed, an overlapped step faster than its bound, decode
messages as cheap per byte as prefill ones). A bounded metric stays within its bound or is
reported as out of model."""
import random

import pandas as pd
import pytest

from labkit.lessons import multi_gpu_overlap as mgo
from labkit.measure.rounds import Spread
from labkit.tools import recorded

WHERE = "on 2 x NVIDIA H200 (recorded)"


@pytest.fixture(scope="module")
def rec():
    return recorded.load("multi_gpu_overlap", "tp_mlp")


@pytest.fixture(scope="module")
def runs(rec):
    return [mgo.TPResult.from_dict(d) for d in rec.data["runs"]]


def _with_traces_swapped(result: mgo.TPResult) -> mgo.TPResult:
    ranks = [dict(r, traces={"serial": r["traces"]["overlapped"],
                             "overlapped": r["traces"]["serial"]}) for r in result.ranks]
    return mgo.TPResult(result.experiment, result.backend, ranks)


def _synthetic(tokens, ffn, compute, comm, *, overlapped=None, rounds=5, hidden=8192,
               dtype="bfloat16", seed=0, jitter=0.01):
    """Both ranks' rounds for chunk counts ``compute.keys()``: ``compute[k]``/``comm[k]`` are
    the in-step halves; the overlapped step defaults to its pipeline bound plus interference."""
    chunks = tuple(sorted(compute))
    exp = mgo.TPExperiment(tokens=tokens, hidden=hidden, ffn=ffn, dtype=dtype,
                           chunk_counts=chunks, trace_chunks=min(4, tokens), rounds=rounds)
    rng = random.Random(seed)
    ranks = []
    for rank in range(2):
        rows: dict[str, list[float]] = {}
        for _ in range(rounds):
            drift = 1 + rng.uniform(-jitter, jitter)  # the whole machine, this round
            values = {"serial": compute[1] + comm[1]}
            for k in chunks:
                c, m = compute[k], comm[k]
                bound = max(c, m) + min(c, m) / k
                values.update({f"compute {k}": c, f"comm {k}": m, f"sequential {k}": c + m,
                               f"overlapped {k}": overlapped[k] if overlapped else bound * 1.03})
            for case, v in values.items():
                rows.setdefault(case, []).append(v * drift)
        ranks.append({"rank": rank, "rounds": rows, "errors": {"serial": 1e-3},
                      "traces": {"serial": {"summary": {}},
                                 "overlapped": {"summary": {"gpu_busy_us": 150.0,
                                                            "window_us": 400.0}}}})
    return mgo.TPResult(exp, "nccl", ranks)


# A prefill at a width where compute and comm are close: overlap has something to hide.
PREFILL_COMPUTE = {1: 1400.0, 2: 1420.0, 4: 1460.0, 8: 1550.0, 16: 1700.0}
PREFILL_COMM = {1: 500.0, 2: 530.0, 4: 590.0, 8: 650.0, 16: 850.0}
# Decode: a 128 KiB all-reduce is latency (each message costs ~the same); every chunk re-reads
# the weights (compute grows with the chunk count).
DECODE_COMPUTE = {1: 120.0, 2: 230.0, 4: 450.0, 8: 900.0}
DECODE_COMM = {1: 15.0, 2: 28.0, 4: 55.0, 8: 110.0}


@pytest.fixture
def prefill():
    return _synthetic(8192, 8192, PREFILL_COMPUTE, PREFILL_COMM)


@pytest.fixture
def decode():
    return [_synthetic(t, 28672, DECODE_COMPUTE, DECODE_COMM, seed=t) for t in (8, 64)]


# --- the bounds -----------------------------------------------------------------------------

def test_the_committed_recording_shows_its_past_bound_metrics_as_out_of_model(runs):
    # Recorded with compute and comm timed alone: efficiency, of_pipeline, hidden_fraction past 1.
    widest = next(r for r in runs if r.experiment.ffn == 28672).table.set_index("num_chunks")
    assert widest.loc[8].hidden_fraction > 1 and set(widest.loc[8].out_of_model.split(", ")) == {
        "efficiency", "of_pipeline", "hidden_fraction"}
    for r in runs:
        t = r.table
        for name in ("efficiency", "of_pipeline"):
            past = t[t[name] > mgo.BOUNDS[name] * (1 + mgo.BOUND_TOLERANCE)]
            assert all(name in marks for marks in past.out_of_model), (name, past)
            within = t[t[name] <= mgo.BOUNDS[name]]
            assert all(name not in marks for marks in within.out_of_model), (name, within)


@pytest.mark.parametrize("seed", range(20))
def test_metrics_from_in_step_halves_stay_within_their_bounds(seed):
    # Any pipeline: overlapped >= its bound (interference only lengthens it), halves as they
    # cost in a step; every round's metrics stay within their bounds, nothing is out of model.
    rng = random.Random(seed)
    compute = {k: rng.uniform(50, 5000) * (1 + 0.05 * k) for k in (1, 2, 4, 8)}
    comm = {k: rng.uniform(50, 5000) * (1 + 0.1 * k) for k in (1, 2, 4, 8)}
    over = {k: (max(compute[k], comm[k]) + min(compute[k], comm[k]) / k) * rng.uniform(1, 1.5)
            for k in compute}
    r = _synthetic(4096, 4096, compute, comm, overlapped=over, seed=seed, jitter=0.0)
    rounds = r.round_table
    for name, bound in mgo.BOUNDS.items():
        assert (rounds[name] <= bound + 1e-12).all(), (name, rounds[name])
    assert (r.table.out_of_model == "-").all()


def test_a_compute_timed_alone_slower_than_in_a_step_is_reported_out_of_model():
    # The overlapped step is shorter than the compute its bound assumes: impossible, so the
    # metric is marked, not reported as an achievement.
    over = {k: 0.9 * PREFILL_COMPUTE[k] for k in PREFILL_COMPUTE}
    r = _synthetic(8192, 8192, PREFILL_COMPUTE, PREFILL_COMM, overlapped=over)
    assert set(mgo.out_of_model(r.spreads(4))) == {"efficiency", "of_pipeline", "hidden_fraction"}
    assert (r.table.out_of_model != "-").all()


def test_a_range_that_straddles_a_bound_or_passes_it_by_noise_is_not_out_of_model():
    noise = 1 + mgo.BOUND_TOLERANCE / 2
    spreads = {"efficiency": Spread.of([0.98, 1.02, 1.01]), "of_pipeline": Spread.of([noise] * 3),
               "hidden_fraction": Spread.of([1.2, 1.3, 1.4])}
    assert mgo.out_of_model(spreads) == []
    past = 1 + 2 * mgo.BOUND_TOLERANCE
    spreads["efficiency"] = Spread.of([past, past * 1.01, past * 1.02])
    assert mgo.out_of_model(spreads) == ["efficiency", "hidden_fraction"]


def test_a_gain_is_called_a_gain_only_when_its_whole_range_clears_one():
    assert mgo.gain_verdict(Spread.of([1.02, 1.05, 1.08])).startswith("a gain")
    assert mgo.gain_verdict(Spread.of([0.97, 1.05, 1.10])).startswith("within noise")
    assert mgo.gain_verdict(Spread.of([0.90, 0.95, 0.97])).startswith("slower")


# --- the claims on the committed recording --------------------------------------------------

def test_the_recorded_claims_hold_on_the_committed_recording(rec, runs):
    made = (mgo.schedule_claims(runs, WHERE, recorded=rec)
            + mgo.gpu_trace_claims(runs, WHERE, recorded=rec)
            + mgo.width_claims(runs, WHERE, recorded=rec))
    assert len(made) == 6 and all(c.held for c in made), [c.text for c in made if not c.held]
    assert all(c.source == rec.label for c in made)


def test_the_committed_recording_lacks_the_rounds_and_decode_fields(rec):
    assert mgo.missing_fields(rec.data) == ["rounds", "decode_runs"]


def test_the_schedule_and_gpu_trace_claims_fail_with_serial_and_overlapped_swapped(runs):
    swapped = [_with_traces_swapped(r) for r in runs]
    serial, overlapped = mgo.schedule_claims(swapped, WHERE)
    assert not serial.held and not overlapped.held
    side_by_side, stretch = mgo.gpu_trace_claims(swapped, WHERE)
    assert not side_by_side.held and not stretch.held


def test_the_width_claims_fail_with_the_widths_reversed_or_one_chunk_made_dearest(runs):
    ffns = [r.experiment.ffn for r in runs][::-1]
    relabelled = [mgo.TPResult(mgo.TPExperiment(**{**r.experiment.__dict__, "ffn": f}),
                               r.backend, r.ranks) for r, f in zip(runs, ffns)]
    assert not mgo.width_claims(relabelled, WHERE)[0].held
    cheap_chunks = []
    for r in runs:
        ranks = []
        for rank in r.ranks:
            rows = pd.DataFrame(rank["rows"])
            rows["comm_us"] = rows.comm_us.iloc[0] / rows.num_chunks  # more chunks, cheaper
            ranks.append(dict(rank, rows=rows.to_dict(orient="records")))
        cheap_chunks.append(mgo.TPResult(r.experiment, r.backend, ranks))
    assert not mgo.width_claims(cheap_chunks, WHERE)[1].held


# --- claims that need rounds (synthetic, shaped like a 2-GPU run) -------------------------------

def test_the_rounds_claims_hold_on_consistent_rounds_and_say_gain_only_with_the_range(prefill):
    bounds, gain = mgo.rounds_claims([prefill], WHERE)
    assert bounds.held and gain.held, (bounds.text, gain.text)
    assert "a gain, every round faster" in gain.text and "rounds)" in gain.text


def test_the_rounds_claims_say_within_noise_when_the_gain_range_includes_one():
    noisy = _synthetic(8192, 28672, {1: 5800.0, 2: 5800.0}, {1: 520.0, 2: 550.0},
                       overlapped={1: 6320.0, 2: 6320.0}, jitter=0.04)
    _, gain = mgo.rounds_claims([noisy], WHERE)
    assert gain.held and "within noise" in gain.text, gain.text


def test_the_rounds_claims_fail_when_overlapped_beats_its_bound_in_every_round():
    over = {k: 0.9 * PREFILL_COMPUTE[k] for k in PREFILL_COMPUTE}
    bad = _synthetic(8192, 8192, PREFILL_COMPUTE, PREFILL_COMM, overlapped=over)
    bounds, gain = mgo.rounds_claims([bad], WHERE)
    assert not bounds.held and "Out of model" in bounds.text
    assert not gain.held


def test_the_decode_claims_hold_where_small_messages_are_latency_bound(prefill, decode):
    made = mgo.decode_claims([prefill], decode, WHERE)
    assert len(made) == 3 and all(c.held for c in made), [c.text for c in made if not c.held]
    assert "no range wholly above 1" in made[2].text


def test_the_decode_claims_fail_when_decode_messages_cost_their_bytes(prefill):
    # comm proportional to bytes (as fast per byte as the prefill message) and chunks free.
    per_byte = PREFILL_COMM[1] / 8192
    comm = {k: 8 * per_byte for k in DECODE_COMPUTE}
    compute = {k: DECODE_COMPUTE[1] for k in DECODE_COMPUTE}
    cheap = [_synthetic(8, 28672, compute, comm)]
    latency, chunks, _ = mgo.decode_claims([prefill], cheap, WHERE)
    assert not latency.held and not chunks.held


def test_the_decode_claim_fails_when_a_decode_step_gains_in_every_round(prefill):
    over = {k: 0.5 * (DECODE_COMPUTE[1] + DECODE_COMM[1]) for k in DECODE_COMPUTE}
    gaining = [_synthetic(8, 28672, DECODE_COMPUTE, DECODE_COMM, overlapped=over)]
    assert not mgo.decode_claims([prefill], gaining, WHERE)[2].held


# --- the live claims ------------------------------------------------------------------------

def test_the_split_claim_fails_when_one_partial_is_already_the_output():
    assert mgo.split_claim(0.8, 1e-7).held
    assert not mgo.split_claim(1e-7, 1e-7).held
    assert not mgo.split_claim(0.8, 0.3).held


def test_the_correctness_claim_fails_when_a_schedule_disagrees():
    errors = pd.DataFrame({"rank 0": {"serial": 1e-7, "overlapped, 2 chunks": 1e-7},
                           "rank 1": {"serial": 1e-7, "overlapped, 2 chunks": 1e-7}})
    assert mgo.correctness_claim(errors, 1e-5, "float32", "here").held
    errors.loc["overlapped, 2 chunks", "rank 1"] = 0.5
    assert not mgo.correctness_claim(errors, 1e-5, "float32", "here").held
