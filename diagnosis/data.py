"""The diagnosis input: one job's stored records as data frames (one column per field).

The store fills these (``aggregator.Store.job_data``); tests and the simulator build them directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    ranks: pd.DataFrame = field(default_factory=lambda: _empty(["rank", "host", "nic", "switch"]))
    """One row per rank: rank, host, nic, switch."""
    steps: pd.DataFrame = field(default_factory=lambda: _empty(STEP_FIELDS))
    """One row per rank and step (``StepRow`` columns)."""
    functions: pd.DataFrame = field(default_factory=lambda: _empty(FUNCTION_FIELDS))
    """One row per rank, window and function (``FunctionPattern`` columns)."""
    heartbeats: pd.DataFrame = field(default_factory=lambda: _empty(HEARTBEAT_FIELDS))
    """The latest heartbeat of each rank."""

    def hosts(self) -> dict[int, str]:
        return dict(zip(self.ranks["rank"].astype(int), self.ranks["host"].astype(str), strict=False))
