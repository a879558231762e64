"""What the ranks measured, gathered (:class:`TPResult`): per round the slowest rank's step
times (a step ends for everyone when it ends for the last rank), the in-step compute and comm of
the rank that finished computing last, each metric within its round and its range over the
rounds; every rank's errors; both ranks' traces on one timeline. :func:`sweep_summary` gives one
row per experiment: its best chunk count and what that step achieved.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import pandas as pd

from labkit.lessons.multi_gpu_overlap.experiment import TPExperiment
from labkit.lessons.multi_gpu_overlap.metrics import (
    BOUNDS,
    out_of_model,
    overlap_metrics,
)
from labkit.lessons.multi_gpu_overlap.traces import merge_rank_traces
from labkit.measure.profile import Trace
from labkit.measure.rounds import Spread

METRICS = ("serial_us", "overlapped_us", "compute_us", "comm_us", "ideal_us", "pipeline_us",
           "efficiency", "of_pipeline", "speedup", "ceiling", "hidden_fraction")


@dataclass
class TPResult:
    """Every rank's measurements of one experiment. A step ends when its slowest rank ends, so
    each round takes its step times from the slowest rank."""
    experiment: TPExperiment
    backend: str
    ranks: list[dict]

    @property
    def has_rounds(self) -> bool:
        """Timed in interleaved rounds with the in-step split; a recording without rounds holds
        one median per rank and case, its compute and comm timed alone."""
        return all("rounds" in r for r in self.ranks)

    @property
    def round_table(self) -> pd.DataFrame:
        """One row per round and chunk count, every metric computed within its round. Compute
        and comm come from the rank that finished computing last: the other rank's comm time
        holds its wait for that peer."""
        if not self.has_rounds:
            raise ValueError("this result has no rounds (one median per rank and case): "
                             "re-record it with `make record` on a 2-GPU host")
        per_rank = [r["rounds"] for r in self.ranks]
        rows = []
        for i in range(len(per_rank[0]["serial"])):
            serial = max(r["serial"][i] for r in per_rank)
            for k in self.experiment.chunk_counts:
                last = max(per_rank, key=lambda r: r[f"compute {k}"][i])
                rows.append({"round": i, "num_chunks": k, **overlap_metrics(
                    serial, max(r[f"overlapped {k}"][i] for r in per_rank),
                    last[f"compute {k}"][i], last[f"comm {k}"][i], k)})
        return pd.DataFrame(rows)

    def spreads(self, num_chunks: int) -> dict[str, Spread]:
        """Every metric at ``num_chunks`` over the rounds (one value where there are none)."""
        if self.has_rounds:
            rows = self.round_table[lambda t: t.num_chunks == num_chunks]
            return {m: Spread.of(rows[m].tolist()) for m in METRICS}
        row = self.table.set_index("num_chunks").loc[num_chunks]
        return {m: Spread.of([row[m]]) for m in METRICS}

    @property
    def table(self) -> pd.DataFrame:
        """One row per chunk count: each metric's median over the rounds, the speed-up's range,
        and the bounded metrics that passed their bound in every round (``out_of_model``)."""
        if not self.has_rounds:
            return self._single_median_table()
        rounds = self.round_table
        table = rounds.groupby("num_chunks", as_index=False)[list(METRICS)].median()
        by_k = rounds.groupby("num_chunks")
        table["speedup_low"] = by_k.speedup.min().values
        table["speedup_high"] = by_k.speedup.max().values
        table["out_of_model"] = [", ".join(out_of_model(self.spreads(int(k)))) or "-"
                                 for k in table.num_chunks]
        return table

    def _single_median_table(self) -> pd.DataFrame:
        """A recording of one median per rank and case, its columns each the slowest rank's."""
        per_rank = pd.DataFrame([row for r in self.ranks for row in r["rows"]])
        slowest = per_rank.groupby("num_chunks", as_index=False).max()
        rows = [{"num_chunks": int(r.num_chunks),
                 **overlap_metrics(r.serial_us, r.overlapped_us, r.compute_us, r.comm_us,
                                   int(r.num_chunks))}
                for r in slowest.itertuples()]
        table = pd.DataFrame(rows)
        table["out_of_model"] = [", ".join(out_of_model({n: Spread.of([row[n]]) for n in BOUNDS}))
                                 or "-" for _, row in table.iterrows()]
        return table

    @property
    def errors(self) -> pd.DataFrame:
        return pd.DataFrame({f"rank {r['rank']}": r["errors"] for r in self.ranks})

    def trace(self, mode: str) -> Trace:
        """``mode`` "serial" or "overlapped": both ranks' step on one timeline."""
        return merge_rank_traces([r["traces"][mode] for r in self.ranks])

    def to_dict(self) -> dict:
        return {"experiment": asdict(self.experiment), "backend": self.backend,
                "ranks": self.ranks}

    @classmethod
    def from_dict(cls, d: dict) -> TPResult:
        exp = dict(d["experiment"], chunk_counts=tuple(d["experiment"]["chunk_counts"]))
        return cls(TPExperiment(**exp), d["backend"], d["ranks"])

    def figure(self, title: str):
        """Step time per chunk count (medians over the rounds); dotted: the best overlap can do
        (max of the two), dashed: the best a pipeline of that many chunks can do."""
        import plotly.express as px

        table = self.table
        long = table.melt(id_vars=["num_chunks"], var_name="time", value_name="us", value_vars=[
            "serial_us", "overlapped_us", "compute_us", "comm_us", "ideal_us", "pipeline_us"])
        fig = px.line(long, x="num_chunks", y="us", color="time", markers=True, log_x=True,
                      title=title, labels={"num_chunks": "chunks per step", "us": "us per step"})
        fig.update_xaxes(tickvals=table.num_chunks.tolist())
        fig.update_traces(selector={"name": "pipeline_us"}, line_dash="dash")
        return fig.update_traces(selector={"name": "ideal_us"}, line_dash="dot")

    @property
    def imbalance(self) -> float:
        """|log(compute / communication)| unchunked: 0 when the two take equally long."""
        row = self.table.sort_values("num_chunks").iloc[0]
        return abs(math.log(row.compute_us / row.comm_us))

    def best_chunks(self) -> int:
        """The chunk count with the highest median speed-up over the serial step; one chunk
        (the serial step's own work, nothing overlapped) only where it is the only count."""
        table = self.table
        overlapping = table[table.num_chunks > 1] if (table.num_chunks > 1).any() else table
        return int(overlapping.loc[overlapping.speedup.idxmax()].num_chunks)

    def comm_stretch(self) -> float:
        """How much longer the communication ran in the traced overlapped step than in the
        serial one, averaged over ranks (one traced step each)."""
        serial, overlapped = (self.trace(m).summary for m in ("serial", "overlapped"))
        stretch = [overlapped[k]["comm_us"] / serial[k]["comm_us"] for k in serial
                   if serial[k]["comm_us"] > 0]
        return sum(stretch) / len(stretch) if stretch else float("nan")


def sweep_summary(results: list[TPResult]) -> pd.DataFrame:
    """One row per experiment: its best chunk count and what that step achieved (medians, the
    speed-up's range where there are rounds), and ``comm_stretch``: communication that shares
    the GPU with matmuls runs slower."""
    rows = []
    for r in results:
        table, e = r.table, r.experiment
        best = table.set_index("num_chunks").loc[r.best_chunks()]
        one = table.loc[table.num_chunks.idxmin()]
        rows.append({"tokens": e.tokens, "ffn": e.ffn,
                     "compute_over_comm": one.compute_us / one.comm_us,
                     "serial_us": one.serial_us, "best_chunks": r.best_chunks(),
                     "best_overlapped_us": best.overlapped_us, "speedup": best.speedup,
                     **({"speedup_low": best.speedup_low, "speedup_high": best.speedup_high}
                        if r.has_rounds else {}),
                     "ceiling": best.ceiling, "efficiency": best.efficiency,
                     "of_pipeline": best.of_pipeline, "comm_stretch": r.comm_stretch()})
    return pd.DataFrame(rows)
