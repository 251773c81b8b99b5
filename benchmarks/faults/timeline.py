"""A job's stored records as they stood at any moment: replay the diagnosis at increasing times.

The detection delay of a fault is the time from its onset until a diagnosis run at that moment
would have reported it. :class:`Timeline` holds everything stored about a job with the time each
piece arrived, and :meth:`Timeline.at` cuts it at a moment: step rows count from the time their
batch left the rank (the ``steps`` record's ``time_us``, read from the spool: the store keeps only
the rows), window summaries from their record time, and each rank's latest heartbeat is its latest
one sent by then; the stack samples and link sends are those of the heartbeats sent by then.
Aggregator latency (ingest passes, ClickHouse inserts) is not included.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from rankscope.aggregator import Store
from rankscope.aggregator.schema import HEARTBEATS
from rankscope.diagnosis.data import JobData


def step_arrivals(spool_job_dir: str | Path) -> pd.DataFrame:
    """``rank, step, sent_us``: when each step row was shipped, from the spool files of one job."""
    rows: list[tuple[int, int, int]] = []
    for path in sorted(Path(spool_job_dir).glob("*.jsonl")):
        with path.open("rb") as fh:
            for line in fh:
                if b'"type":"steps"' not in line or not line.endswith(b"\n"):
                    continue
                try:
                    d = json.loads(line)
                except ValueError:
                    continue
                rank, sent = int(d["rank"]), int(d["time_us"])
                # A row covers ``n_steps`` steps from ``step`` on (its last column; one in version 1).
                rows.extend(
                    (rank, s, sent)
                    for r in d["rows"]
                    for s in range(int(r[0]), int(r[0]) + (r[9] if len(r) > 9 else 1))
                )
    df = pd.DataFrame(rows, columns=["rank", "step", "sent_us"])
    return df.groupby(["rank", "step"], as_index=False)["sent_us"].min()


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    job: str
    ranks: pd.DataFrame
    steps: pd.DataFrame
    """The stored step rows plus ``avail_us``: when the row reached the transport."""
    functions: pd.DataFrame
    heartbeats: pd.DataFrame
    """Every heartbeat, not only the latest."""
    links: pd.DataFrame
    """Every heartbeat's link sends (``Store.link_sends``)."""

    @classmethod
    def load(cls, store: Store, job: str, spool_job_dir: str | Path) -> Timeline:
        steps = store.steps(job)
        sent = step_arrivals(spool_job_dir)
        if not steps.empty:
            steps = steps.merge(sent, on=["rank", "step"], how="left")
            fallback = steps["start_us"] + steps["dur_us"]
            steps["avail_us"] = steps["sent_us"].fillna(fallback).astype("int64")
        sql = (
            f"SELECT * FROM `{store.database}`.`{HEARTBEATS.name}` WHERE job = {{job:String}} "
            "ORDER BY rank, time_us"
        )
        hb = store.client.query_df(sql, parameters={"job": job})
        if hb.columns.empty:
            hb = pd.DataFrame(columns=list(HEARTBEATS.column_names))
        return cls(
            job=job,
            ranks=store.ranks(job),
            steps=steps,
            functions=store.functions(job),
            heartbeats=hb.drop_duplicates(["rank", "time_us"]),  # at least once: some came twice
            links=store.link_sends(job),
        )

    @property
    def end_us(self) -> int:
        """The last moment anything arrived."""
        ends = [0]
        if not self.steps.empty:
            ends.append(int(self.steps["avail_us"].max()))
        if not self.heartbeats.empty:
            ends.append(int(self.heartbeats["time_us"].max()))
        return max(ends)

    def last_step(self, t_us: int) -> int:
        """The highest step any rank had shipped by ``t_us`` (-1 if none)."""
        if self.steps.empty:
            return -1
        s = self.steps[self.steps["avail_us"] <= t_us]["step"]
        return int(s.max()) if len(s) else -1

    def at(self, t_us: int) -> JobData:
        """What a diagnosis at ``t_us`` would have read."""
        steps = self.steps
        if not steps.empty:
            steps = steps[steps["avail_us"] <= t_us].drop(columns=["sent_us", "avail_us"])
        functions = self.functions
        if not functions.empty:
            functions = functions[functions["time_us"] <= t_us]
        hb = self.heartbeats
        samples = JobData(job=self.job).samples
        if not hb.empty:
            hb = hb[hb["time_us"] <= t_us]
            counts = [
                (r, fn, n) for r, got in zip(hb["rank"], hb["samples"], strict=True) for fn, n in got.items()
            ]
            if counts:
                samples = pd.DataFrame(counts, columns=list(samples.columns))
                samples = samples.groupby(["rank", "function"], as_index=False)["samples"].sum()
            hb = hb.sort_values(["rank", "time_us"]).groupby("rank").tail(1)
        return JobData(
            job=self.job,
            ranks=self.ranks,
            steps=steps.reset_index(drop=True),
            functions=functions.reset_index(drop=True),
            heartbeats=hb.reset_index(drop=True),
            samples=samples,
            links=self.links[self.links["time_us"] <= t_us].reset_index(drop=True),
        )
