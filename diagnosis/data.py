"""The diagnosis input: one job's stored records as data frames (one column per field).

The store fills these (``aggregator.Store.job_data``); tests and the simulator build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import pandas as pd

STEP_FIELDS = ["rank", "step", "dur_us", "data_us", "comm_us", "n_coll", "first_coll_us", "cpu_us", "nivcsw"]
FUNCTION_FIELDS = [
    "rank",
    "window",
    "step_lo",
    "step_hi",
    "kind",
    "name",
    "stack",
    "count",
    "total_us",
    "mean_us",
]
HEARTBEAT_FIELDS = [
    "rank",
    "time_us",
    "step",
    "progress_age_s",
    "coll_group",
    "coll_op",
    "coll_seq",
    "last_seq",
    "stack",
]


def _empty(columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame({c: [] for c in columns})


@dataclass(frozen=True, slots=True, kw_only=True)
class JobData:
    job: str
    ranks: pd.DataFrame = field(default_factory=lambda: _empty(["rank", "host", "nic", "switch", "spine"]))
    """One row per rank: rank, host, nic, switch, spine."""
    steps: pd.DataFrame = field(default_factory=lambda: _empty(STEP_FIELDS))
    """One row per rank and step (``StepRow`` columns)."""
    functions: pd.DataFrame = field(default_factory=lambda: _empty(FUNCTION_FIELDS))
    """One row per rank, window and function (``FunctionPattern`` columns)."""
    heartbeats: pd.DataFrame = field(default_factory=lambda: _empty(HEARTBEAT_FIELDS))
    """The latest heartbeat of each rank."""

    def hosts(self) -> dict[int, str]:
        return dict(zip(self.ranks["rank"].astype(int), self.ranks["host"].astype(str), strict=False))


class StoreReader(Protocol):
    """What :func:`read_job` needs of a store (``aggregator.Store`` has it; the diagnosis does not
    import the aggregator: data flows from it, not back)."""

    def ranks(self, job: str) -> pd.DataFrame: ...
    def steps(self, job: str, since_step: int | None = None, since_us: int | None = None) -> pd.DataFrame: ...
    def functions(
        self, job: str, windows: list[int] | None = None, since_us: int | None = None
    ) -> pd.DataFrame: ...
    def heartbeats_latest(self, job: str) -> pd.DataFrame: ...


def read_job(store: StoreReader, job: str, since_us: int | None = None) -> JobData:
    """Everything the diagnosis reads about ``job`` in ``store``.

    With ``since_us``, only the steps and the windows from then on (the ranks and each rank's
    latest heartbeat whenever they came): what a running job's diagnosis needs, in time that does
    not grow with the job's age.
    """
    return JobData(
        job=job,
        ranks=store.ranks(job),
        steps=store.steps(job, since_us=since_us),
        functions=store.functions(job, since_us=since_us),
        heartbeats=store.heartbeats_latest(job),
    )
