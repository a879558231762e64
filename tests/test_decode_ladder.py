"""Notebook 07a's batch-1 decode ladder (labkit.lessons.prefill_vs_decode.ladder): the floor's
bytes, the table and the claim, and the measurement's glue with the CUDA pieces stood in by CPU
work (the replays themselves need CUDA Graphs: ``make gpu-check`` runs 07a on a GPU)."""
import pytest
import torch

from labkit.engine import ModelConfig, random_model
from labkit.lessons.prefill_vs_decode import ladder


def test_floor_bytes_are_the_parameters_a_decode_step_reads():
    cfg = ModelConfig.tiny()
    model = random_model(cfg, seed=0, dtype=torch.float32)
    params = sum(p.numel() for p in model.parameters())
    embed = model.embed_tokens.numel()
    for batch, context in ((1, 16), (3, 40)):
        got = ladder.step_bytes(cfg, batch, context, 4)
        # every weight but the embedding table, of which each row reads one line
        assert got["weight_bytes"] == 4 * (params - embed + batch * cfg.hidden_size)
        assert got["kv_bytes"] == 4 * batch * context * cfg.num_hidden_layers * 2 * cfg.kv_size
        assert got["bytes"] == got["weight_bytes"] + got["kv_bytes"]


def data(gains=((1.9, 2.0, 2.1), (1.07, 1.08, 1.09), (1.10, 1.12, 1.13)),
         ms=(1.9, 1.0, 0.95, 0.85)):
    """A made-up ladder in the shape ``ladder`` returns."""
    rows = []
    for i, (name, t) in enumerate(zip(ladder.RUNGS, ms)):
        row = {"rung": name, "ms": t, "ms_low": t * 0.99, "ms_high": t * 1.01,
               "kernels": 690 - 200 * i, "floor_share": 0.5 / t,
               "floor_share_low": 0.5 / (t * 1.01), "floor_share_high": 0.5 / (t * 0.99)}
        if i:
            lo, mid, hi = gains[i - 1]
            row |= {"gain": mid, "gain_low": lo, "gain_high": hi}
        rows.append(row)
    return {"batch": 1, "context": 1024, "rounds": 5, "copy_gbps": 4250.0, "floor_ms": 0.5,
            "rows": rows}


def test_the_claim_holds_only_when_every_change_wins_every_round():
    (made,) = ladder.ladder_claims(data())
    assert made.held
    assert "fused layer kernels 2.00x (1.90-2.10)" in made.text
    assert "dependent launches 1.12x (1.10-1.13)" in made.text
    assert "to 0.850 ms and 90" in made.text and "59% (58%-59%)" in made.text
    ok = (1.9, 2.0, 2.1), (1.07, 1.08, 1.09), (1.10, 1.12, 1.13)
    for rung in range(3):
        lost = list(ok)
        lost[rung] = (0.99, *ok[rung][1:])
        (one,) = ladder.ladder_claims(data(gains=tuple(lost)))
        assert not one.held, f"a round where {list(ladder.RUNGS)[rung + 1]} lost"


def test_the_table_shows_each_rung_with_its_range_and_gain():
    table = ladder.ladder_table(data())
    assert list(table.index) == list(ladder.RUNGS)
    assert table.loc["one-row GEMV", "gain over the rung above"] == "1.08x (1.07-1.09)"
    assert table.loc["eager ops", "gain over the rung above"] == ""
    assert table.loc["one-row GEMV", "of the floor"] == "52.6%"


def test_the_measurement_times_every_rung_in_the_same_rounds(monkeypatch):
    """``ladder``'s glue: one replay per rung built with that rung's options, kernels counted,
    the rungs timed in interleaved rounds, gains taken per round."""
    built = []

    def replay(model, batch, context, *, fused_ops, skinny, pdl):
        built.append((fused_ops, skinny, pdl))
        a = torch.randn(64 * (5 - len(built)), 64 * (5 - len(built)))
        return (lambda: a @ a), object()
    monkeypatch.setattr(ladder, "decode_replay", replay)
    monkeypatch.setattr(ladder, "kernel_count", lambda fn: 7)
    monkeypatch.setattr("labkit.device.free_memory", lambda device: None)
    model = random_model(ModelConfig.tiny(), seed=0, dtype=torch.float32)
    got = ladder.ladder(model, batch=1, context=16, rounds=3, repeats=3, copy_gbps=100.0)
    assert built == [(o["fused_ops"], o["skinny"], o["pdl"]) for o in ladder.RUNGS.values()]
    assert built[-1][2] is None and not any(b[2] for b in built[:-1]), "only the last rung: PDL"
    assert [r["rung"] for r in got["rows"]] == list(ladder.RUNGS)
    assert "gain" not in got["rows"][0] and all("gain_low" in r for r in got["rows"][1:])
    floor = ladder.step_bytes(model.config, 1, 16, 4)["bytes"] / 100.0 / 1e6
    assert got["floor_ms"] == pytest.approx(floor)
    for r in got["rows"]:
        assert r["ms_low"] <= r["ms"] <= r["ms_high"] and r["kernels"] == 7
        assert r["floor_share"] == pytest.approx(floor / r["ms"])
    assert len(ladder.ladder_claims(got)) == 1


@pytest.mark.gpu
def test_gpu_each_rung_replays_the_engines_graph_with_fewer_kernels():
    """On a GPU, the four rungs on a small bf16 model: each captured and replayed, the fused
    kernels and the GEMV each cutting the kernels a step launches, dependent launches none."""
    cfg = ModelConfig.tiny(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                           num_key_value_heads=2)
    model = random_model(cfg, seed=0, device="cuda", dtype=torch.bfloat16)
    got = ladder.ladder(model, batch=1, context=64, rounds=3, repeats=5)
    kernels = [r["kernels"] for r in got["rows"]]
    assert kernels[0] > kernels[1] > kernels[2] == kernels[3] > 0, kernels
    assert all(r["ms"] > 0 and r["floor_share"] > 0 for r in got["rows"])


def test_decode_floor_races_the_rope_kernel_at_batch_1_only(monkeypatch):
    """benchmarks/decode_floor.py --rope-kernel: at batch 1 a third replay captured with
    FusedOps.rope_in_gemv off (and the flag restored after), the default skinny replay's gain
    over it taken per round; other batches keep their two replays."""
    import sys
    from pathlib import Path

    import pandas as pd
    from labkit.engine.model import FusedOps
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks import decode_floor as df
    built = []

    def replay(model, batch, context, *, skinny):
        built.append((batch, skinny, FusedOps.rope_in_gemv))
        a = torch.randn(48, 48)
        return (lambda: a @ a), object()
    monkeypatch.setattr(df.ladder, "decode_replay", replay)
    monkeypatch.setattr(df, "kernel_census", lambda fn: pd.DataFrame(
        {"name": ["k"], "count": [3], "us": [1.0]}))
    monkeypatch.setattr(df, "free_memory", lambda device: None)
    monkeypatch.setattr(df, "l2_statement", lambda *a, **kw: "read from HBM")  # bench_1b: 2 GB
    model = random_model(ModelConfig.tiny(), seed=0, dtype=torch.float32)
    got = df.decode_floor(model, batches=(1, 2), context=16, rounds=3, repeats=2,
                          copy_gbps=100.0, rope_kernel=True)
    assert built == [(1, False, True), (1, True, True), (1, True, False), (2, False, True),
                     (2, True, True)]
    assert FusedOps.rope_in_gemv is True
    names = [(r["batch"], r["matmuls"]) for r in got["rows"]]
    assert names == [(1, "cublas"), (1, "skinny"), (1, "skinny, rope kernel"), (2, "cublas"),
                     (2, "skinny")]
    assert "rope_gain_low" in got["rows"][2] and "skinny_gain" in got["rows"][1]
    assert "rope_gain" not in got["rows"][4] and "skinny_gain" in got["rows"][4]
