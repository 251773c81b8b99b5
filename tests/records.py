"""Records as a hook sends them, and what the store should hold of them: what the tests share."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rankscope.wire.records import (
    Checkpoint,
    Exit,
    FunctionPattern,
    Heartbeat,
    RankInfo,
    Record,
    StepBatch,
    StepRow,
    WindowSummary,
    decode,
)

if TYPE_CHECKING:  # the torch releases' test environments have no server extras
    from rankscope.aggregator import Store


class ListSink:
    """A hook's sink that keeps the values it is sent."""

    def __init__(self) -> None:
        self.got: list[bytes] = []

    def send(self, key: bytes, value: bytes) -> None:
        self.got.append(value)

    def close(self) -> None:
        pass


def spool_records(spool: Path, job: str) -> dict[int, list]:
    """The records of ``job`` in a spool directory, per rank."""
    out: dict[int, list] = defaultdict(list)
    for f in sorted((spool / job).glob("*.jsonl")):
        for line in f.read_bytes().splitlines():
            rec = decode(line)
            out[rec.rank].append(rec)
    return out


def synthetic_records(job: str, ranks: int = 6, batches: int = 10) -> list[Record]:
    """Records of every type, as a hook would send them, for tests that need no training job."""
    out: list[Record] = []
    t0 = 1_700_000_000_000_000
    for r in range(ranks):
        host = f"node{r // 2}"
        out.append(
            RankInfo(job=job, rank=r, host=host, time_us=t0, local_rank=r % 2, world_size=ranks, pid=r)
        )
        for b in range(batches):
            rows = tuple(
                StepRow(s, t0 + s * 1000, 900, 10, 200, 2, 600, 850, 0, 1) for s in range(b * 10, b * 10 + 10)
            )
            out.append(StepBatch(job=job, rank=r, host=host, time_us=t0 + b, rows=rows))
            out.append(
                Heartbeat(job=job, rank=r, host=host, time_us=t0 + b, step=b * 10 + 9, progress_age_s=0.1)
            )
        fns = tuple(
            FunctionPattern("op", f"aten::op{i}", "", 5, 50.0, 10.0, 10.0, 11.0, 12.0, 0.1, 100.0, 0.1, 0)
            for i in range(20)
        )
        out.append(
            WindowSummary(
                job=job, rank=r, host=host, time_us=t0, window=1, step_lo=10, step_hi=15, dur_us=5000,
                busy={"compute": 0.9}, n_events=100, functions=fns,
            )
        )  # fmt: skip
        out.append(
            Exit(job=job, rank=r, host=host, time_us=t0 + batches, pid=r, how="close", step=batches * 10 - 1)
        )
    return out


def expected_counts(records: Iterable[Record]) -> dict[str, int]:
    """Rows per table that ``records`` make, keyed as the store's tables deduplicate them."""
    from rankscope.aggregator.schema import JOB_TABLES

    keys: dict[str, set[tuple[Any, ...]]] = {t: set() for t in JOB_TABLES}
    for r in records:
        if r.seq >= 0:
            keys["arrivals"].add((r.job, r.rank, r.pid, r.seq))
        if isinstance(r, RankInfo):
            keys["ranks"].add((r.job, r.rank))
            keys["attempts"].add((r.job, r.rank, r.time_us))
        elif isinstance(r, Checkpoint):
            keys["checkpoints"].add((r.job, r.rank, r.kind, r.start_us))
        elif isinstance(r, Exit):
            keys["exits"].add((r.job, r.rank, r.pid))
        elif isinstance(r, StepBatch):
            keys["steps"].update((r.job, r.rank, row.step) for row in r.rows)
        elif isinstance(r, Heartbeat):
            keys["heartbeats"].add((r.job, r.rank, r.time_us))
        elif isinstance(r, WindowSummary):
            keys["windows"].add((r.job, r.window, r.rank))
            keys["functions"].update((r.job, r.window, r.rank, f.kind, f.name, f.stack) for f in r.functions)
    return {t: len(k) for t, k in keys.items()}


def assert_stored_once(store: Store, job: str, records: list[Record], dropped: int = 0) -> None:
    """``records`` stored once each, and the numbers their hooks gave out missing only for the
    ``dropped`` ones (dropped before the last one stored: those after it leave no gap)."""
    assert store.counts(job) == expected_counts(records)
    steps = store.steps(job)
    assert not steps.duplicated(["rank", "step"]).any()
    missing = store.missing(job)
    assert int((missing["made"] - missing["stored"]).sum()) == dropped, missing
