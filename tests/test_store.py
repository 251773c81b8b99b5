"""The store and the spool reader against a real chDB engine (no mocks).

chDB hosts one engine per process, on one data directory at a time (another directory can be opened
only after every client of the first is closed). So this module shares one module-scoped directory,
held open while its tests run, and every test gets its own *database* inside it
(``Store.embedded(path, database=...)``): tests are isolated (dead letters and offsets are not per
job, so distinct job ids alone would not do) without reopening the engine, and the engine is released
when the module ends, so other test modules can open their own directories.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from aggregator import (
    STORE_VERSION,
    Batch,
    IngestStats,
    SchemaError,
    Store,
    StoreError,
    ensure_schema,
    ingest,
)
from aggregator.batch import RAW_PREFIX_BYTES, _implied
from aggregator.reads import STEP_COLUMNS, SpoolOffset
from aggregator.schema import (
    ARRIVALS_BY_PROCESS_OBJECTS,
    ARRIVALS_BY_PROCESS_TABLE,
    FUNCTIONS,
    HEARTBEATS,
    JOB_TABLES,
    LATEST_HEARTBEATS,
    LATEST_HEARTBEATS_OBJECTS,
    STEPS,
    TABLES,
    WINDOW_INPUT_OBJECTS,
    WINDOWS,
    Table,
    cluster_ddl,
)
from aggregator.spool import MAX_LINE_BYTES, file_id
from diagnosis import diagnose, read_job
from diagnosis.data import LOOKBACK_STEPS, STEP_FIELDS, RecentJob
from diagnosis.diagnose import Settings as diagnose_settings
from tests.jobdata import only
from wire.records import (
    MAX_VALUE_BYTES,
    Checkpoint,
    Exit,
    FunctionPattern,
    Heartbeat,
    RankInfo,
    Record,
    RecordError,
    StepBatch,
    StepRow,
    WindowSummary,
    encode,
)

JOB = "llama's run; DROP TABLE steps"  # quotes and SQL in a job id: values must travel as parameters
T0 = 1_700_000_000_000_000
_db_ids = itertools.count()


@pytest.fixture(scope="module")
def chdb_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The module's chDB directory, held open throughout so tests switch databases, never paths."""
    path = tmp_path_factory.mktemp("chdb") / "data"
    with Store.embedded(path, database="session"):
        yield path


@pytest.fixture
def store(chdb_path: Path) -> Iterator[Store]:
    with Store.embedded(chdb_path, database=f"test_{next(_db_ids)}") as s:
        yield s


# --- records -------------------------------------------------------------------------------------


def rank_info(rank: int, time_us: int = T0) -> RankInfo:
    return RankInfo(
        job=JOB, rank=rank, host=f"node{rank // 2}", time_us=time_us, local_rank=rank % 2, world_size=2,
        pid=1000 + rank, nic="mlx5_0", switch="leaf1", spine="spine0", backend="gloo", device="cpu",
    )  # fmt: skip


def step_row(step: int, rank: int) -> StepRow:
    start = T0 + step * 100_000
    return StepRow(
        step, start, 90_000 + rank * 5_000, 1_000, 20_000, 3, 40_000 + rank, 85_000, rank, 1, 300 + rank
    )


def steps(rank: int, lo: int, hi: int) -> StepBatch:
    rows = tuple(step_row(s, rank) for s in range(lo, hi))
    return StepBatch(job=JOB, rank=rank, host=f"node{rank // 2}", time_us=T0 + hi * 100_000, rows=rows)


def heartbeat(rank: int, time_us: int, step: int, gpu_xids: dict[str, int] | None = None) -> Heartbeat:
    return Heartbeat(
        gpu_xids=gpu_xids or {},
        job=JOB, rank=rank, host=f"node{rank // 2}", time_us=time_us, step=step, progress_age_s=0.25,
        coll_group="0", coll_op="allreduce", coll_seq=step * 3, coll_age_s=0.01,
        last_seq={"0": step * 3, "1": step}, stack="train.py:42 step", dropped=rank,
        samples={"train.py(40): step": step, "": 1},
        sends={"10.0.0.1>10.0.0.2": (step << 20, step * 1_000)} if step else {},
    )  # fmt: skip


def function(kind: str, name: str, count: int, stack: str = "") -> FunctionPattern:
    return FunctionPattern(
        kind, name, stack, count, count * 10.0, 10.0, 9.5, 12.0, 30.0, 0.2, 50.0, 0.1, 4096
    )


def window(rank: int, number: int) -> WindowSummary:
    functions = (
        function("op", "aten::mm", 40),
        function("collective", "allreduce", 3),
        function("python", "forward", 4, stack="train.py:main > train.py:step"),
    )
    return WindowSummary(
        job=JOB, rank=rank, host=f"node{rank // 2}", time_us=T0 + number * 1_000_000, window=number,
        step_lo=number * 10, step_hi=number * 10 + 5, dur_us=500_000,
        busy={"compute": 0.6, "comm": 0.3, "data": 0.05, "idle": 0.05}, n_events=1234 + rank,
        functions=functions,
    )  # fmt: skip


def checkpoint(rank: int, step: int = 5) -> Checkpoint:
    return Checkpoint(
        job=JOB, rank=rank, host=f"node{rank // 2}", time_us=T0 + 600_000, kind="save", step=step,
        start_us=T0 + 500_000, dur_us=90_000 + rank,
    )  # fmt: skip


def exit_record(rank: int) -> Exit:
    """Rank 1 raised, its GPU fallen off the bus; rank 0 was stopped."""
    how = {
        "how": "exception",
        "error": "RuntimeError",
        "message": "boom",
        "frame": "train.py(40): step @41",
        "gpu": {"xid_79": 1, "ecc_uncorrected": 2},
    }
    return Exit(
        job=JOB, rank=rank, host=f"node{rank // 2}", time_us=T0 + 3_000_000 - rank, pid=1000 + rank, step=7,
        **(how if rank else {"how": "signal", "signal": 15}),
    )  # fmt: skip


def all_records() -> list[Record]:
    out: list[Record] = []
    for rank in (0, 1):
        out += [rank_info(rank), steps(rank, 0, 5), checkpoint(rank), steps(rank, 5, 8)]
        out += [
            heartbeat(rank, T0 + 1_000_000, 4),
            heartbeat(rank, T0 + 2_000_000, 7, {"xid_79": 1} if rank else None),
        ]
        out += [window(rank, 1), window(rank, 2), exit_record(rank)]
    return out


def write_spool(root: Path, records: list[Record]) -> list[Path]:
    """One file per rank in ``<job-dir>/<host>-rank<R>.jsonl``, as the hook's spool sink lays them out."""
    paths = []
    for rank in sorted({r.rank for r in records}):
        path = root / "job-a" / f"node{rank // 2}-rank{rank}-{1000 + rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as f:
            f.writelines(encode(r)[1] + b"\n" for r in records if r.rank == rank)
        paths.append(path)
    return paths


def snapshot(store: Store) -> dict[str, list[dict[str, object]]]:
    """Everything the read side returns for JOB, as plain values, for equality checks."""
    frames = {
        "ranks": store.ranks(JOB),
        "steps": store.steps(JOB),
        "windows": store.windows(JOB),
        "functions": store.functions(JOB),
        "heartbeats": store.heartbeats_latest(JOB),
        "attempts": store.attempts(JOB),
        "checkpoints": store.checkpoints(JOB),
        "exits": store.exits(JOB),
    }
    return {name: df.to_dict("records") for name, df in frames.items()}


EXPECTED_COUNTS = {
    "ranks": 2, "attempts": 2, "steps": 16, "heartbeats": 4, "windows": 4, "functions": 12, "checkpoints": 2,
    "exits": 2, "arrivals": 0,  # these records are not numbered, as an older hook's
}  # fmt: skip


def offset_of(store: Store, path: Path) -> int:
    """How far ``path`` has been ingested, by its file identity."""
    fid = file_id(path)
    assert fid is not None
    return store.offset(fid).offset


# --- schema --------------------------------------------------------------------------------------


def test_schema_creation_twice_is_harmless(store: Store) -> None:
    store.write(all_records())
    ensure_schema(store.client, store.database)
    ensure_schema(store.client, store.database)
    assert store.counts(JOB) == EXPECTED_COUNTS
    tables = store.client.query(
        "SELECT name FROM system.tables WHERE database = {db:String}", parameters={"db": store.database}
    ).result_rows
    assert sorted(name for (name,) in tables) == sorted(
        [*TABLES, *WINDOW_INPUT_OBJECTS, *ARRIVALS_BY_PROCESS_OBJECTS, *LATEST_HEARTBEATS_OBJECTS]
    )


def test_a_store_on_a_cluster_is_sharded_by_job_over_replicated_tables(store: Store) -> None:
    """``--clickhouse-cluster``: each table becomes its shards' replicated table (``<name>_local``,
    the same columns and sort key as on one server) and a ``Distributed`` table of its name over
    them, sharded by the first sort column (a job's rows and a row's copies on one shard, where
    ``FINAL`` collapses them); input tables and views on every node. chDB runs no cluster (no
    Keeper, no remote servers): checked here, every statement parses (``formatQuery``), and the
    queries of the diagnosis and the service read the names the ``Distributed`` tables take."""
    ddl = cluster_ddl("rs", "prod")
    for statement in ddl:
        store.client.query("SELECT formatQuery({q:String})", parameters={"q": statement})
        assert " ON CLUSTER `prod`" in statement, statement
    for table in [*TABLES.values(), ARRIVALS_BY_PROCESS_TABLE, LATEST_HEARTBEATS]:
        (one,) = table.ddl("rs")
        local, shared = table.ddl("rs", "prod")
        assert local in ddl and shared in ddl
        keeper = f"'/clickhouse/tables/{{shard}}/rs/{table.name}_local', '{{replica}}'"
        assert local == one.replace(
            f"`rs`.`{table.name}` (", f"`rs`.`{table.name}_local` ON CLUSTER `prod` ("
        ).replace(f"{table.engine}(", f"Replicated{table.engine}({keeper}" + (", " if table.version else ""))
        comment = one[one.index("COMMENT") :]
        assert shared.endswith(
            f"AS `rs`.`{table.name}_local`\nENGINE = Distributed(`prod`, `rs`, `{table.name}_local`, "
            f"cityHash64(`{table.order_by[0]}`))\n{comment}"
        )
    views = [d for d in ddl if "MATERIALIZED VIEW" in d]
    assert len(views) == 5 and "TO `rs`.`arrivals_by_process_local` " in views[-2]
    assert "FROM `rs`.`arrivals_local` " in views[-2]  # each shard counts the arrivals it stores
    assert "TO `rs`.`latest_heartbeats_local` " in views[-1] and "FROM `rs`.`heartbeats_local`" in views[-1]


def test_schema_of_another_version_is_refused(store: Store) -> None:
    store.client.command("CREATE DATABASE old_schema")
    store.client.command(
        "CREATE TABLE old_schema.steps (job String) ENGINE = MergeTree ORDER BY job "
        "COMMENT 'rankscope schema 0'"
    )
    with pytest.raises(SchemaError, match=r"old_schema.*another schema version.*steps"):
        ensure_schema(store.client, "old_schema")


def test_a_store_of_schema_1_is_migrated_and_its_rows_read_as_before(store: Store) -> None:
    store.write(all_records())
    before = store.steps(JOB)
    ranks = store.ranks(JOB)
    # What schema 1 had: steps without n_steps or wait_us, ranks without spine, no latest
    # heartbeats, every table's comment saying so.
    latest = store.heartbeats_latest(JOB)
    store.client.command(f"DROP VIEW {store.database}.{LATEST_HEARTBEATS_OBJECTS[1]}")
    store.client.command(f"DROP TABLE {store.database}.{LATEST_HEARTBEATS_OBJECTS[0]}")
    store.client.command(f"ALTER TABLE {store.database}.steps DROP COLUMN n_steps")
    store.client.command(f"ALTER TABLE {store.database}.steps DROP COLUMN wait_us")
    store.client.command(f"ALTER TABLE {store.database}.ranks DROP COLUMN spine")
    store.client.command(f"ALTER TABLE {store.database}.ranks DROP COLUMN coverage")
    for column in ("gpu_util", "gpu_mem_mb", "samples", "sends", "windows", "window_cost_us", "gpu_xids"):
        store.client.command(f"ALTER TABLE {store.database}.heartbeats DROP COLUMN {column}")
    exits = store.exits(JOB)
    store.client.command(f"ALTER TABLE {store.database}.exits DROP COLUMN gpu")
    for name in TABLES:
        store.client.command(f"ALTER TABLE {store.database}.{name} MODIFY COMMENT 'rankscope schema 1'")
    ensure_schema(store.client, store.database)
    # Exits stored before schema 12 say no GPU fault.
    assert store.exits(JOB).to_dict("records") == exits.assign(gpu=[{}] * len(exits)).to_dict("records")
    pd.testing.assert_frame_equal(store.steps(JOB), before.assign(wait_us=0.0))  # none was known
    assert store.ranks(JOB).assign(spine="spine0", coverage=ranks["coverage"]).to_dict(
        "records"
    ) == ranks.to_dict("records")
    assert (store.ranks(JOB)["coverage"] == "").all(), "ranks stored before the migration say no coverage"
    assert (store.ranks(JOB)["spine"] == "").all(), "ranks stored before the migration name no spine"
    gpu = ["gpu_util", "gpu_mem_mb", "gpu_xids"]
    assert store.heartbeats_latest(JOB).drop(columns=gpu).equals(latest.drop(columns=gpu))
    comments = store.client.query(
        "SELECT DISTINCT comment FROM system.tables WHERE database = {db:String} AND name IN {t:Array(String)}",
        parameters={"db": store.database, "t": list(TABLES)},
    ).result_rows
    assert comments == [(f"rankscope schema {STORE_VERSION}",)]


def test_functions_stored_under_schema_8s_sort_key_are_copied_to_the_new_one(store: Store) -> None:
    """Schema 9 sorts function rows by kind first; a store of schema 8 (window first) has them
    copied, every row kept, and its window summaries still land in the new table."""
    records = all_records()
    db = store.database
    store.client.command(f"DROP VIEW {db}.functions_from_input")
    store.client.command(f"DROP TABLE {db}.functions")
    old = FUNCTIONS.ddl(db)[0].replace("`kind`, `rank`, `window`", "`window`, `rank`, `kind`")
    store.client.command(old)
    ensure_schema(store.client, db)  # the view made again, into the old table
    store.write(records)
    store.client.command(f"ALTER TABLE {db}.functions MODIFY COMMENT 'rankscope schema 8'")
    before = store.functions(JOB)
    assert len(before) > 0
    key = "SELECT sorting_key FROM system.tables WHERE database = {db:String} AND name = 'functions'"
    assert store.client.query(key, parameters={"db": db}).result_rows == [
        ("job, window, rank, kind, name, stack",)
    ]
    ensure_schema(store.client, db)
    assert store.client.query(key, parameters={"db": db}).result_rows == [
        ("job, kind, rank, window, name, stack",)
    ]
    pd.testing.assert_frame_equal(store.functions(JOB), before)
    store.write(records)  # again: the view fills the new table, and FINAL collapses the copies
    pd.testing.assert_frame_equal(store.functions(JOB), before)
    assert store.counts(JOB) == EXPECTED_COUNTS


def test_a_jobs_read_holds_its_last_steps_and_the_windows_since_the_first(store: Store) -> None:
    """``read_job`` reads a job's last ``last_steps`` steps (``LOOKBACK_STEPS`` by default: a
    job's whole history grows without end), and the windows taken since the first of them."""
    store.write([*all_records(), window(0, 0), window(1, 0)])  # steps 0-7; windows at 0, 1 and 2 s
    whole = read_job(store, JOB, last_steps=None)
    assert sorted(whole.steps["step"].unique()) == list(range(8))
    assert set(whole.spans()["window"]) == {0, 1, 2}
    cut = read_job(store, JOB, last_steps=3)
    assert sorted(cut.steps["step"].unique()) == [5, 6, 7]
    assert int(cut.steps["start_us"].min()) > T0  # window 0, taken at T0, is older
    assert set(cut.spans()["window"]) == {1, 2}
    assert set(cut.functions_of([0, 1])["window"]) == {1, 2}
    assert read_job(store, JOB, last_steps=8).steps.equals(whole.steps)
    assert read_job(store, JOB).steps.equals(whole.steps)  # shorter than LOOKBACK_STEPS
    assert store.last_step(JOB) == 7 and store.last_step("no such job") is None


def test_the_default_read_reaches_back_as_far_as_every_detector_looks() -> None:
    s = diagnose_settings()
    assert s.straggler.steps.shift_steps + s.straggler.steps.warmup_steps <= LOOKBACK_STEPS
    assert s.straggler.steps.last_steps + s.straggler.steps.warmup_steps <= LOOKBACK_STEPS
    assert s.job_wide.steps + s.job_wide.warmup_steps <= LOOKBACK_STEPS


def _rows(df: pd.DataFrame, columns: list[str]) -> list[tuple[object, ...]]:
    return sorted(map(tuple, df[columns].itertuples(index=False)))


def test_a_recent_job_reads_only_what_the_store_gained_and_holds_what_a_fresh_read_would(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RecentJob`` (what ``rankscope serve`` diagnoses): after each update it holds the rows
    ``read_job`` would read for the same span, though it read only the new ones; a rank whose rows
    come late is caught up, and a restarted rank makes it read afresh."""
    recent, read_rows = RecentJob(JOB, recent_s=3.0), []  # 3 s: 30 steps of 100 ms
    real_steps = store.steps

    def counting_steps(*args: Any, **kwargs: Any) -> pd.DataFrame:
        df = real_steps(*args, **kwargs)
        read_rows.append((len(df), "after_us" in kwargs))
        return df

    monkeypatch.setattr(store, "steps", counting_steps)
    step_cols = ["rank", "step", "start_us", "dur_us", "comm_us"]
    fn_cols = ["rank", "window", "name", "total_us"]

    def check(last_step: int) -> None:
        last_us = T0 + last_step * 100_000
        got, want = recent.update(store, last_us), read_job(store, JOB, since_us=last_us - 3_000_000)
        # read_job keeps a whole row whose end is in the span; the held frame may keep a little
        # more (it drops old rows every tenth of the span): compare over the span.
        lo = last_us - 3_000_000
        in_span = lambda df: df[df["start_us"] >= lo]  # noqa: E731
        assert _rows(in_span(got.steps), step_cols) == _rows(in_span(want.steps), step_cols)
        first = want.functions["window"].min() if not want.functions.empty else 1 << 62
        over = lambda df: df[df["window"] >= first]  # noqa: E731
        assert _rows(over(got.functions), fn_cols) == _rows(want.functions, fn_cols)
        assert got.ranks.equals(want.ranks) and got.heartbeats.equals(want.heartbeats)

    store.write([rank_info(0), rank_info(1), steps(0, 0, 20), steps(1, 0, 20), window(0, 0), window(1, 0)])
    check(20)
    for lo in range(20, 80, 10):  # rank 1's rows of steps 40..60 come a cycle late
        late = 40 <= lo < 60
        # Rank 0 ships blocks of 10 steps whose duration does not divide evenly: the block's
        # last step reads back ending a fraction of a microsecond off the row's end.
        block = StepRow(
            lo, T0 + lo * 100_000, 1_000_001 - lo % 20, 10_000, 200_000, 30, 4_000, 850_000, 0, 10
        )
        store.write([replace(steps(0, lo, lo + 10), rows=(block,)), heartbeat(0, T0 + lo * 100_000, lo)])
        store.write([] if late else [steps(1, 40 if lo == 60 else lo, lo + 10)])
        store.write([window(r, lo // 10) for r in (0, 1)] if lo % 20 == 0 else [])
        read_rows.clear()
        check(lo + 10)
        # The update read 10 steps a rank (30 for the late rank's catch-up), read_job the span.
        assert read_rows[0] == (10 + (30 if lo == 60 else 0 if late else 10), True), (lo, read_rows)
    # Rank 1 restarts from a checkpoint at step 70 and redoes steps 70..79 later.
    again = rank_info(1, T0 + 9_000_000)
    redo = StepBatch(
        job=JOB, rank=1, host="node0", time_us=T0 + 10_000_000,
        rows=tuple(step_row(s, 1)._replace(start_us=T0 + 9_000_000 + (s - 70) * 100_000) for s in range(70, 80)),
    )  # fmt: skip
    store.write([again, redo])
    read_rows.clear()
    check(100)
    assert read_rows[0][1] is False  # read afresh


def test_a_row_of_a_block_of_steps_reads_back_as_its_steps(store: Store) -> None:
    row = StepRow(100, T0, 40_000, 4_000, 8_000, 12, 1_500, 30_000, 3, 4, 2_000)  # steps 100..103, totals
    store.write([StepBatch(job=JOB, rank=0, host="h", time_us=T0, rows=(row,))])
    df = store.steps(JOB)
    assert df["step"].tolist() == [100, 101, 102, 103]
    assert df["start_us"].tolist() == [T0, T0 + 10_000, T0 + 20_000, T0 + 30_000]
    assert df[
        ["dur_us", "data_us", "comm_us", "n_coll", "cpu_us", "nivcsw", "wait_us"]
    ].drop_duplicates().values.tolist() == [[10_000, 1_000, 2_000, 3, 7_500, 0.75, 500]]
    assert (df["first_coll_us"] == 1_500).all()
    assert store.steps(JOB, since_step=102)["step"].tolist() == [102, 103]
    assert read_job(store, JOB, since_us=T0 + 35_000).steps["step"].tolist() == [100, 101, 102, 103]
    assert read_job(store, JOB, since_us=T0 + 45_000).steps.empty  # the block ended before
    # A rank restarted from a checkpoint, with rows of one step over the same steps: the later run counts.
    again = StepRow(102, T0 + 60_000, 9_000, 0, 0, 3, 100, 9_000, 0, 1)
    store.write([StepBatch(job=JOB, rank=0, host="h", time_us=T0, rows=(again,))])
    df = store.steps(JOB)
    assert df["step"].tolist() == [100, 101, 102, 103] and df["dur_us"].tolist()[2] == 9_000


def test_a_large_jobs_steps_are_read_in_buckets_summed_up_by_the_store(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of blocks of 4 steps, read in buckets of 8: each bucket's means per step are those of
    its steps read one by one. ``read_job`` reads buckets where ranks x steps exceed
    ``MAX_STEP_CELLS``, the fewest steps a bucket that keep the buckets under ``MAX_BUCKETS``, and
    the diagnosis names the same straggler from them."""
    blocks = [
        StepBatch(
            job=JOB, rank=r, host=f"node{r}", time_us=T0 + lo * 10_000,
            rows=tuple(
                StepRow(b, T0 + b * 10_000, 4 * (10_000 + 5_000 * (r == 2)), 400, 4 * 3_000, 12, 900,
                        4 * (6_000 + 5_000 * (r == 2)), 2, 4, 4 * (100 + b))
                for b in range(lo, lo + 64, 4)
            ),
        )
        for r in range(8)
        for lo in range(0, 1024, 64)
    ]  # fmt: skip
    store.write([*map(rank_info, range(8)), *blocks])
    one_by_one = store.steps(JOB)
    got = store.steps(JOB, width=8, since_step=16)
    assert got["width"].eq(8).all() and got["step"].min() == 16 and len(got) == 8 * (1024 - 16) // 8
    assert (got["step"] % 8 == 0).all() and list(got.columns) == [*STEP_COLUMNS, "width"]
    cut = one_by_one[one_by_one["step"] >= 16]
    means = cut.groupby(["rank", cut["step"] // 8 * 8]).agg(
        {
            **dict.fromkeys(["dur_us", "data_us", "comm_us", "first_coll_us", "cpu_us", "wait_us"], "mean"),
            "start_us": "min",
        }
    )
    # Buckets come in no order (sorting 2 million of them took ClickHouse 1 s; the diagnosis places
    # each by its rank and step).
    by_step = got.set_index(["rank", "step"]).sort_index()
    assert np.allclose(by_step[means.columns].to_numpy(), means.to_numpy())
    whole = read_job(store, JOB)
    # 8 x 1,024 steps: one by one, only the columns the diagnosis uses (``STEP_FIELDS``).
    assert whole.steps.equals(one_by_one[[c for c in STEP_COLUMNS if c in [*STEP_FIELDS, "start_us"]]])
    asked = store.steps(JOB, width=8, since_step=16, columns=["cpu_us"])
    assert list(asked.columns) == ["rank", "step", "start_us", "cpu_us", "width"]
    assert asked.equals(got[asked.columns])
    monkeypatch.setattr("diagnosis.data.MAX_STEP_CELLS", 8 * 1024 // 3)
    data = read_job(store, JOB)
    assert data.steps["width"].eq(4).all() and len(data.steps) == 8 * 1024 // 4
    # Buckets of 2 would keep under this, but half of them would hold no row (a block begins
    # every 4 steps): a bucket is as wide as a stored row at least.
    monkeypatch.setattr("diagnosis.data.MAX_STEP_CELLS", 8 * 1024 // 2)
    in_order = lambda df: df.sort_values(["rank", "step"], ignore_index=True)  # noqa: E731
    assert in_order(read_job(store, JOB).steps).equals(in_order(data.steps))
    f, g = only(diagnose(data).findings), only(diagnose(whole).findings)
    assert (f.cause, f.ranks) == (g.cause, g.ranks) == ("compute", [2])
    assert f.evidence["ratio"] == pytest.approx(g.evidence["ratio"], rel=0.01)
    # Fewer buckets allowed than steps one by one (``MAX_BUCKETS``): wider buckets, under it.
    monkeypatch.setattr("diagnosis.data.MAX_BUCKETS", 8 * 1024 // 8)
    wide = read_job(store, JOB).steps
    assert wide["width"].eq(8).all() and len(wide) == 8 * 1024 // 8
    assert only(diagnose(replace(data, steps=wide)).findings).ranks == [2]


def test_a_recent_large_job_is_held_in_buckets_each_ranks_last_read_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job too large to hold step by step (``MAX_STEP_CELLS``): ``RecentJob`` holds the buckets
    ``read_job`` reads, though an update reads only each rank's last bucket again (it gained rows)
    and those after it; as the job grows into wider buckets, it reads afresh."""
    for limit in ("MAX_STEP_CELLS", "MAX_BUCKETS"):  # 8 ranks: 1 a bucket to 16 steps … 8 past 64
        monkeypatch.setattr(f"diagnosis.data.{limit}", 8 * 64 // 4)
    recent, reads = RecentJob(JOB, recent_s=3600.0), []
    real_steps = store.steps

    def counting_steps(*args: Any, **kwargs: Any) -> pd.DataFrame:
        df = real_steps(*args, **kwargs)
        reads.append((len(df), kwargs.get("width", 1), "after_us" in kwargs))
        return df

    monkeypatch.setattr(store, "steps", counting_steps)
    columns = [*STEP_FIELDS, "start_us", "width"]
    store.write([rank_info(r) for r in range(8)])
    for hi in range(4, 100, 4):  # each rank ships blocks of 4 steps; each step a little longer
        store.write(
            replace(
                steps(r, hi - 4, hi),
                rows=tuple(step_row(s, r)._replace(dur_us=90_000 + 100 * s) for s in range(hi - 4, hi)),
            )
            for r in range(8)
        )
        reads.clear()
        got = recent.update(store, T0 + hi * 100_000).steps.reindex(columns=columns)
        want = read_job(store, JOB).steps.reindex(columns=columns)
        w = 1 if hi <= 16 else 2 if hi <= 32 else 4 if hi <= 64 else 8
        assert want["width"].fillna(1).eq(w).all()
        order = lambda df: df.sort_values(["rank", "step"]).to_numpy(dtype=float, na_value=1)  # noqa: E731
        assert len(got) == len(want) and np.allclose(order(got), order(want)), hi
        n, width, incremental = reads[0]
        if hi in (20, 36, 68):  # the first update in wider buckets
            assert (width, incremental) == (w, False)
        elif hi > 68:
            # A rank's last bucket again, and the next where the new block began one.
            assert (width, incremental, n) == (8, True, 8 * (1 + (hi % 8 == 4))), hi


def test_stack_samples_are_summed_per_rank_and_function_each_heartbeat_once(store: Store) -> None:
    beats = [heartbeat(0, T0, 4), heartbeat(0, T0 + 5_000_000, 9), heartbeat(1, T0 + 5_000_000, 9)]
    store.write([*beats, beats[1]])  # a heartbeat ingested twice (at-least-once) counts once
    got = store.stack_samples(JOB)
    assert got.values.tolist() == [
        [0, "", 2],
        [0, "train.py(40): step", 13],
        [1, "", 1],
        [1, "train.py(40): step", 9],
    ]
    assert store.stack_samples(JOB, since_us=T0 + 1)["samples"].tolist() == [1, 9, 1, 9]
    assert read_job(store, JOB).samples.equals(got)
    empty = store.stack_samples("nope")
    assert empty.empty and list(empty.columns) == ["rank", "function", "samples"]


def test_link_sends_are_read_per_heartbeat_and_link_each_heartbeat_once(store: Store) -> None:
    beats = [heartbeat(0, T0, 0), heartbeat(0, T0 + 5_000_000, 9), heartbeat(1, T0 + 5_000_000, 4)]
    store.write([*beats, beats[1]])  # a heartbeat ingested twice (at-least-once) is read once
    got = store.link_sends(JOB)
    assert got.values.tolist() == [  # the first heartbeat sent nothing yet: no row
        [0, T0 + 5_000_000, "10.0.0.1>10.0.0.2", 9 << 20, 9_000],
        [1, T0 + 5_000_000, "10.0.0.1>10.0.0.2", 4 << 20, 4_000],
    ]
    assert store.link_sends(JOB, since_us=T0 + 5_000_001).empty
    assert read_job(store, JOB).links.equals(got)
    assert list(store.link_sends("nope").columns) == ["rank", "time_us", "link", "nbytes", "send_us"]


def test_database_name_must_be_an_identifier(store: Store) -> None:
    with pytest.raises(SchemaError, match="must match"):
        Store(store.client, database="x; DROP DATABASE y")


def test_second_engine_path_in_one_process_is_a_clear_error(store: Store, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="one data directory per process"):
        Store.embedded(tmp_path / "other")


# --- round trip ----------------------------------------------------------------------------------


def test_every_record_type_round_trips_through_the_spool(store: Store, tmp_path: Path) -> None:
    records = all_records()
    paths = write_spool(tmp_path / "spool", records)

    stats = ingest(tmp_path / "spool", store)

    assert isinstance(stats, IngestStats)
    assert (stats.files, stats.records, stats.dead_letters) == (2, len(records), 0)
    assert stats.bytes == sum(p.stat().st_size for p in paths)
    assert store.counts(JOB) == EXPECTED_COUNTS

    ranks = store.ranks(JOB)
    assert ranks.to_dict("records") == [
        {k: getattr(rank_info(r), k) for k in TABLES["ranks"].column_names} for r in (0, 1)
    ]

    df = store.steps(JOB)
    expected = [(r, *step_row(s, r)._replace(n_steps=None)) for r in (0, 1) for s in range(8)]
    expected = [tuple(v for v in row if v is not None) for row in expected]  # one row per step
    assert [tuple(row) for row in df.itertuples(index=False)] == expected
    assert store.steps(JOB, since_step=6)["step"].tolist() == [6, 7, 6, 7]

    windows = store.windows(JOB)
    assert windows[["window", "rank"]].values.tolist() == [[1, 0], [1, 1], [2, 0], [2, 1]]
    assert windows["busy"][0] == {"compute": 0.6, "comm": 0.3, "data": 0.05, "idle": 0.05}
    assert windows["n_functions"].tolist() == [3, 3, 3, 3]
    assert windows["n_events"].tolist() == [1234, 1235, 1234, 1235]

    functions = store.functions(JOB)
    assert len(functions) == 12
    mm = functions[(functions["name"] == "aten::mm") & (functions["window"] == 2) & (functions["rank"] == 1)]
    assert mm.iloc[0][list(FunctionPattern._fields)].tolist() == list(function("op", "aten::mm", 40))
    assert set(store.functions(JOB, windows=[2])["window"]) == {2}
    empty = store.functions(JOB, windows=[])
    assert empty.empty and list(empty.columns) == list(TABLES["functions"].column_names)
    some = store.functions(JOB, windows=[2], columns=["name", "rank"])
    assert list(some.columns) == ["name", "rank"] and len(some) == 6

    latest = store.heartbeats_latest(JOB)
    assert latest["rank"].tolist() == [0, 1]
    assert latest["time_us"].tolist() == [T0 + 2_000_000] * 2
    assert latest["last_seq"][0] == {"0": 21, "1": 7}
    assert latest["stack"][1] == "train.py:42 step"
    assert latest["gpu_xids"].tolist() == [{}, {"xid_79": 1}]
    assert "samples" not in latest and "sends" not in latest  # summed up by stack_samples and link_sends
    some = store.heartbeats_latest(JOB, columns=["stack", "rank", "nope"])
    assert list(some.columns) == ["rank", "stack"] and some["stack"][1] == "train.py:42 step"

    exits = store.exits(JOB)  # by time: rank 1 first
    assert exits.to_dict("records") == [
        {k: getattr(exit_record(r), k) for k in TABLES["exits"].column_names} for r in (1, 0)
    ]

    jobs = store.jobs()
    assert jobs.to_dict("records") == [
        {"job": JOB, "ranks": 2, "world_size": 2, "first_us": T0, "last_us": T0 + 2_000_000}
    ]
    assert store.offsets() == {
        file_id(p): SpoolOffset(p.relative_to(tmp_path / "spool").as_posix(), p.stat().st_size) for p in paths
    }


def test_each_ranks_latest_heartbeat_is_kept_by_a_view_and_filled_in_for_an_older_store(store: Store) -> None:
    """``heartbeats_latest`` reads one row per rank that a view keeps (``LATEST_HEARTBEATS``), not
    every heartbeat: the latest by time however the heartbeats came (late, twice, in two batches);
    a store made before the view gets it filled from the heartbeats it holds."""
    beats = [heartbeat(r, T0 + t * 1_000_000, t) for r in range(3) for t in range(6)]
    store.write(beats[5::-1])  # rank 0's, newest first
    store.write([*beats[6:], beats[3], beats[17]])  # the others', and two again
    want = [(r, T0 + 5_000_000, 5) for r in range(3)]
    got = store.heartbeats_latest(JOB)
    assert got[["rank", "time_us", "step"]].values.tolist() == [list(w) for w in want]
    table, view = LATEST_HEARTBEATS_OBJECTS
    held = f"SELECT count() FROM `{store.database}`.`{table}` FINAL"
    assert store.client.query(held).result_rows == [(3,)]
    store.client.command(f"DROP VIEW `{store.database}`.`{view}`")
    store.client.command(f"DROP TABLE `{store.database}`.`{table}`")
    ensure_schema(store.client, store.database)
    assert store.heartbeats_latest(JOB).equals(got)
    store.write([heartbeat(1, T0 + 9_000_000, 9)])  # the view fills it again
    assert store.heartbeats_latest(JOB)["step"].tolist() == [5, 9, 5]


def test_reads_of_an_unknown_job_are_empty_frames_with_columns(store: Store) -> None:
    assert store.counts("nope") == dict.fromkeys(JOB_TABLES, 0)
    assert store.steps("nope").empty and list(store.steps("nope").columns) == STEP_COLUMNS
    df = store.heartbeats_latest("nope")
    assert df.empty and list(df.columns) == [
        c for c in TABLES["heartbeats"].column_names if c not in ("samples", "sends")
    ]
    assert store.jobs().empty and "job" in store.jobs().columns


def test_the_records_a_process_numbered_and_the_store_lacks_are_reported_missing(
    store: Store, tmp_path: Path
) -> None:
    """Each record's ``seq`` lands in ``arrivals`` (window summaries through ClickHouse's JSON
    path as well): a number missing between a process's first and last is a record lost on the
    way; a replay neither hides nor makes one, and a restarted process (a new pid) counts anew."""
    made = [r for r in all_records() if r.rank == 0]  # rank info, steps, a checkpoint, steps, ...
    numbered = [dataclasses.replace(r, pid=7, seq=i) for i, r in enumerate(made)]
    lost = {2, 6}  # the checkpoint and the first window never arrive
    kept = [r for r in numbered if r.seq not in lost]
    restarted = [dataclasses.replace(r, pid=8, seq=i) for i, r in enumerate(made[:3])]
    whole = [dataclasses.replace(r, rank=1, pid=9, seq=i) for i, r in enumerate(made)]
    write_spool(tmp_path, kept + kept[:3] + restarted + whole)  # a replay of three
    stats = ingest(tmp_path, store)
    assert stats.dead_letters == 0 and not store.windows(JOB).empty
    assert store.counts(JOB)["arrivals"] == len(kept) + len(restarted) + len(whole)
    missing = store.missing(JOB)
    assert missing.to_dict("records") == [{"rank": 0, "pid": 7, "made": len(made), "stored": len(made) - 2}]
    assert store.missing("another job").empty
    data = read_job(store, JOB)
    assert diagnose(data).analyzed["records_missing"] == f"2 of {len(made)} records (rank 0)"
    # What ``rankscope serve`` diagnoses says so too.
    recent = RecentJob(JOB, recent_s=3600).update(store, int(store.ranks(JOB)["time_us"].max()))
    assert diagnose(recent).analyzed["records_missing"] == f"2 of {len(made)} records (rank 0)"
    # A store made before the per-process table gets it filled from the arrivals it holds.
    for name, kind in zip(ARRIVALS_BY_PROCESS_OBJECTS, ("TABLE", "VIEW"), strict=True):
        store.client.command(f"DROP {kind} `{store.database}`.`{name}`")
    ensure_schema(store.client, store.database)
    assert store.missing(JOB).to_dict("records") == missing.to_dict("records")


# --- replays ------------------------------------------------------------------------------------


def test_ingesting_the_same_spool_twice_adds_nothing(store: Store, tmp_path: Path) -> None:
    write_spool(tmp_path, all_records())
    ingest(tmp_path, store)
    before = snapshot(store)

    again = ingest(tmp_path, store)

    assert (again.files, again.records, again.bytes) == (0, 0, 0)
    assert store.counts(JOB) == EXPECTED_COUNTS
    assert snapshot(store) == before


def test_a_replay_after_lost_offsets_does_not_duplicate(store: Store, tmp_path: Path) -> None:
    paths = write_spool(tmp_path, all_records())
    ingest(tmp_path, store)
    before = snapshot(store)
    # Offsets lost (or never committed because of a crash): every line is read and written again.
    store.set_offsets({str(file_id(p)): SpoolOffset(p.relative_to(tmp_path).as_posix(), 0) for p in paths})

    replay = ingest(tmp_path, store)

    assert replay.records == len(all_records())
    assert store.counts(JOB) == EXPECTED_COUNTS
    assert snapshot(store) == before


def test_writing_the_same_records_twice_does_not_duplicate(store: Store) -> None:
    assert store.write(all_records()) == len(all_records())
    before = snapshot(store)
    assert store.write(all_records()) == len(all_records())
    assert store.counts(JOB) == EXPECTED_COUNTS
    assert snapshot(store) == before


def test_a_restarted_rank_replaces_its_rank_record_and_rerun_steps(store: Store) -> None:
    restarted = dataclasses.replace(rank_info(0), pid=7, time_us=T0 + 9_000_000)
    rerun = dataclasses.replace(
        steps(0, 2, 3), rows=(step_row(2, 0)._replace(start_us=T0 + 9_000_000, dur_us=1),)
    )
    store.write([restarted, rerun])
    # Arriving late (e.g. from a slower spool file) must not bring the older start back.
    store.write([rank_info(0), steps(0, 0, 3)])
    assert store.ranks(JOB)["pid"].tolist() == [7]
    df = store.steps(JOB)
    assert df["step"].tolist() == [0, 1, 2]
    assert df["dur_us"].tolist()[-1] == 1


# --- torn lines, shrinking files, failures ---------------------------------------------------------


def test_a_torn_final_line_is_ingested_only_once_completed(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "j" / "h-rank0-1.jsonl"
    path.parent.mkdir()
    first, second, third = (encode(r)[1] for r in (rank_info(0), steps(0, 0, 2), steps(0, 2, 4)))
    path.write_bytes(first + b"\n" + second + b"\n" + third[:25])

    stats = ingest(tmp_path, store)

    assert stats.records == 2 and stats.dead_letters == 0
    assert offset_of(store, path) == len(first) + len(second) + 2
    assert store.counts(JOB)["steps"] == 2

    with path.open("ab") as f:
        f.write(third[25:] + b"\n")
    stats = ingest(tmp_path, store)

    assert stats.records == 1 and stats.bytes == len(third) + 1
    assert offset_of(store, path) == path.stat().st_size
    assert store.steps(JOB)["step"].tolist() == [0, 1, 2, 3]
    assert store.dead_letters().empty


def test_a_file_that_shrank_is_read_again_from_the_start(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "h-rank0-1.jsonl"
    path.write_bytes(b"".join(encode(r)[1] + b"\n" for r in (rank_info(0), steps(0, 0, 5))))
    ingest(tmp_path, store)
    # Truncated in place, the same first line (so the same file), then written again: shorter.
    path.write_bytes(b"".join(encode(r)[1] + b"\n" for r in (rank_info(0), steps(0, 5, 6))))

    with caplog.at_level(logging.WARNING, logger="aggregator.spool"):
        stats = ingest(tmp_path, store)

    assert stats.records == 2
    assert "shrank" in caplog.text
    assert offset_of(store, path) == path.stat().st_size
    assert store.steps(JOB)["step"].tolist() == [0, 1, 2, 3, 4, 5]


def test_a_file_name_that_is_not_utf8_is_still_ingested(store: Store, tmp_path: Path) -> None:
    path = Path(os.fsdecode(bytes(tmp_path) + b"/rank\xff.jsonl"))
    path.write_bytes(encode(rank_info(0))[1] + b"\n{broken\n")

    stats = ingest(tmp_path, store)

    assert (stats.records, stats.dead_letters) == (1, 1)
    assert [(o.path, o.offset) for o in store.offsets().values()] == [
        ("rank\\xff.jsonl", path.stat().st_size)
    ]
    assert store.dead_letters()["source"].tolist() == ["rank\\xff.jsonl"]


class FailingStore(Store):
    """A real store whose second batch write fails, as if the server went away mid-ingest."""

    writes = 0

    def write_batch(self, batch: Batch) -> int:
        self.writes += 1
        if self.writes == 2:
            raise StoreError("injected failure")
        return super().write_batch(batch)


def test_offsets_are_committed_only_after_the_write(store: Store, tmp_path: Path) -> None:
    lines = [encode(steps(0, s, s + 1))[1] + b"\n" for s in range(5)]
    (tmp_path / "f.jsonl").write_bytes(b"".join(lines))
    failing = FailingStore(store.client, store.database)

    with pytest.raises(StoreError, match="injected"):
        ingest(tmp_path, failing, batch_records=2)

    assert offset_of(store, tmp_path / "f.jsonl") == len(lines[0]) + len(lines[1])  # the first batch only
    assert store.steps(JOB)["step"].tolist() == [0, 1]
    stats = ingest(tmp_path, store, batch_records=2)
    assert stats.records == 3
    assert store.steps(JOB)["step"].tolist() == [0, 1, 2, 3, 4]


# --- dead letters ---------------------------------------------------------------------------------


def _value(**fields: object) -> bytes:
    return json.dumps({**json.loads(encode(rank_info(0))[1]), **fields}).encode()


def test_bad_lines_become_dead_letters_and_good_lines_around_them_are_stored(
    store: Store, tmp_path: Path
) -> None:
    good = [encode(r)[1] for r in (rank_info(0), steps(0, 0, 2), heartbeat(0, T0, 1))]
    bad_step = json.loads(good[1])
    bad_step["rows"][0][0] = "zero"
    bad_function = json.loads(encode(window(0, 1))[1])
    bad_function["functions"][1][1] = 5  # a function name that is not a string
    oversized = b'{"v":1,"type":"rank","pad":"' + b"x" * MAX_VALUE_BYTES + b'"}'
    bad_kind = json.loads(encode(checkpoint(0))[1]) | {"kind": "snapshot"}
    cases = [
        (b"{not json", "not JSON"),
        (_value(v=4), "unknown schema version 4"),
        (_value(type=["rank"]), "unknown record type"),
        (_value(rank="0"), "field 'rank' must be int"),
        (json.dumps(bad_step).encode(), "rows[0].step must be int, got 'zero'"),
        (json.dumps(bad_function).encode(), "functions[1].name must be str, got 5"),
        (_value(rank=1 << 40), "field 'rank' must be int in [0, 2147483648)"),
        (_value(host="\ud800"), "field 'host' must be valid Unicode"),
        (b"[" * 100_000, "not JSON"),
        (b'{"v":1,"type":"rank","job":"\xff\xfe"}', "not JSON"),
        (oversized, f"line of {len(oversized) + 1} bytes exceeds the {MAX_LINE_BYTES}-byte limit"),
        (json.dumps(bad_kind).encode(), "checkpoint kind must be one of ('save', 'load'), got 'snapshot'"),
        (json.dumps(bad_kind | {"kind": "save", "attempt": -1}).encode(), "field 'attempt' must be int in"),
        (good[0].decode().encode("utf-16"), "not JSON"),  # RFC 8259: UTF-8, no byte order mark
        (b"\xef\xbb\xbf" + good[0], "not JSON"),
    ]
    lines = [
        good[0],
        b"",
        *(raw for raw, _ in cases[:6]),
        good[1],
        b"   ",
        *(raw for raw, _ in cases[6:]),
        good[2],
    ]
    (tmp_path / "r.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))

    stats = ingest(tmp_path, store)

    assert (stats.records, stats.dead_letters) == (3, len(cases))
    assert store.counts(JOB) == {
        **dict.fromkeys(JOB_TABLES, 0),
        "ranks": 1,
        "attempts": 1,
        "steps": 2,
        "heartbeats": 1,
    }
    dead = store.dead_letters()
    assert len(dead) == len(cases)
    positions = list(itertools.accumulate((len(line) + 1 for line in lines), initial=0))
    bad_positions = [
        str(p) for p, line in zip(positions, lines, strict=False) if line.strip() and line not in good
    ]
    assert dead["position"].tolist() == bad_positions
    assert set(dead["source"]) == {"r.jsonl"}
    for (raw, reason), row in zip(cases, dead.to_dict("records"), strict=True):
        assert reason in row["reason"], (reason, row["reason"])
        if raw.isascii() and raw is not oversized:
            assert row["raw"] == raw.decode()  # kept whole
    assert dead["raw"][9] == '{"v":1,"type":"rank","job":"\\xff\\xfe"}'  # invalid UTF-8 kept as escapes
    assert dead["raw"][10] == oversized[:RAW_PREFIX_BYTES].decode()


def test_a_column_that_could_get_a_value_wire_lets_through_is_found() -> None:
    """Rows are not checked against their columns again: the aggregator refuses to import where
    wire's rules would let through a value the column cannot hold (here, made up: a step number,
    any Int64, into an Int32 column; an integer field into a Float64 one)."""
    assert _implied("rank", "Int32", {"int"}) and _implied("step", "Int64", {"int"})
    assert not _implied("step", "Int32", {"int"})
    assert not _implied("count", "Float64", {"int"})
    assert _implied("name", "LowCardinality(String)", {"str"}) and not _implied("name", "Int64", {"str"})
    assert not _implied("rank", "Int32", set())  # a column no record field fills


def test_write_refuses_a_bad_record_and_writes_nothing(store: Store) -> None:
    bad = StepBatch(job=JOB, rank=0, host="h", time_us=T0, rows=(step_row(0, 0)._replace(dur_us="slow"),))  # type: ignore[arg-type]
    with pytest.raises(RecordError, match=r"rows\[0\].dur_us must be int, got 'slow'"):
        store.write([rank_info(0), bad])
    assert store.counts(JOB) == dict.fromkeys(JOB_TABLES, 0)


def test_dead_letter_keeps_key_and_invalid_utf8(store: Store) -> None:
    store.dead_letter("kafka:rankscope/3", 42, b"job/\xff", b"\x00\xc3(", "not JSON: test")
    row = store.dead_letters().to_dict("records")[0]
    assert (row["source"], row["position"], row["key"]) == ("kafka:rankscope/3", "42", "job/\\xff")
    assert row["raw"] == "\x00\\xc3(" and row["reason"] == "not JSON: test"
    assert row["time_us"] > T0


# --- strict values: stored as sent or dead-lettered, never changed ---------------------------------


def _window_json(number: int, **changes: object) -> dict:
    """Window ``number`` of rank 0 as a JSON object, with top-level fields replaced."""
    return {**json.loads(encode(window(0, number))[1]), **changes}


def _function_changed(number: int, column: int, value: object) -> dict:
    d = _window_json(number)
    d["functions"][0][column] = value
    return d


def _dumps(d: dict) -> bytes:
    """As the hook encodes (so that ClickHouse parses it), NaN and Infinity allowed."""
    return json.dumps(d, separators=(",", ":")).encode()


def test_window_values_clickhouse_would_read_leniently_are_dead_lettered_with_the_reason(
    store: Store, tmp_path: Path
) -> None:
    """The issue's cases: a wrapped count, "7", "0.5", true, NaN, rank -1, and what else ClickHouse's
    JSON parser takes that JSON or decode() does not; the good window around them is stored."""
    good = _dumps(_window_json(1))
    duplicate_busy = _dumps(_window_json(14)).replace(b'"busy":{', b'"busy":{"idle":0.5,')
    cases = [
        (_dumps(_function_changed(2, 3, 99999999999999999999)), "functions[0].count must be int in ["),
        (_dumps(_function_changed(3, 3, "7")), "functions[0].count must be int, got '7'"),
        (_dumps(_function_changed(4, 4, "0.5")), "functions[0].total_us must be float, got '0.5'"),
        (_dumps(_function_changed(5, 3, True)), "functions[0].count must be int, got True"),
        (_dumps(_function_changed(6, 9, float("nan"))), "NaN is not a JSON number"),
        (_dumps(_function_changed(7, 9, float("inf"))), "Infinity is not a JSON number"),
        (_dumps(_window_json(8, rank=-1)), "field 'rank' must be int in [0, 2147483648), got -1"),
        (_dumps(_window_json(9, busy={"compute": "0.5"})), "field 'busy' must be dict[str, float]"),
        (_dumps(_window_json(10, time_us=str(T0))), f"field 'time_us' must be int, got '{T0}'"),
        (_dumps(_window_json(11, window=11.0)), "field 'window' must be int, got 11.0"),
        (_dumps(_function_changed(12, 3, None)), "functions[0].count must be int, got None"),
        (_dumps(_window_json(13)).replace(b'"n_events":1234', b'"n_events":01234'), "not JSON"),
        (duplicate_busy, "an object repeats the key 'idle'"),
        (_dumps(_window_json(15)).replace(b"]]}", b"],]}"), "not JSON"),  # a trailing comma
        (_dumps(_window_json(16)).replace(b"aten::mm", b"aten::mm\\q"), "not JSON"),  # no such escape
        (_dumps(_window_json(17)).replace(b"aten::mm", b"aten::\x01mm"), "not JSON"),  # a raw control byte
        (_dumps(_window_json(18)).replace(b'"n_events":1234', b'"n_events":+1234'), "not JSON"),
        (_dumps(_function_changed(19, 10, 1e400)).replace(b"Infinity", b"1e400"), "must be a finite float"),
    ]
    (tmp_path / "w.jsonl").write_bytes(b"".join(v + b"\n" for v in [good, *(raw for raw, _ in cases)]))

    stats = ingest(tmp_path, store)

    assert (stats.records, stats.dead_letters) == (1, len(cases))
    assert store.windows(JOB)["window"].tolist() == [1]
    assert set(store.functions(JOB)["window"]) == {1}
    reasons = store.dead_letters()["reason"].tolist()
    for (_, reason), got in zip(cases, reasons, strict=True):
        assert reason in got, (reason, got)


def test_a_batch_of_good_window_values_is_stored_by_clickhouse_as_sent(store: Store) -> None:
    """The fast path still takes what the hook sends, unicode and escapes included, unchanged."""
    functions = (
        function("op", 'aten::"quoted"\\back', 3),
        function("python", "ünïcode ✓ \U0001f600", 2, stack='a > "b" > \\c'),
        function("op", "x" * 5, 1)._replace(cv=0.30000000000000004, total_us=5e-324, nbytes=2**59),
    )
    windows = [dataclasses.replace(window(0, 1), functions=functions), window(1, 1)]
    batch = Batch()
    for i, w in enumerate(windows):
        batch.add_value("b", i, b"", encode(w)[1])
    assert len(batch.window_values) == 2  # ClickHouse parses them

    store.write_batch(batch)

    assert batch.window_values and batch.dead_letters == 0  # not refused and checked in Python
    got = store.functions(JOB, windows=[1])
    got = got[got["rank"] == 0].sort_values("name")
    assert [tuple(r) for r in got[list(FunctionPattern._fields)].itertuples(index=False)] == sorted(
        functions, key=lambda f: f.name
    )


def test_a_heartbeat_with_rank_minus_one_or_infinity_is_a_dead_letter(store: Store, tmp_path: Path) -> None:
    """Values decoded in Python meet the same rules: no rank -1, no NaN or Infinity (a HANG finding
    and an ``Infinity`` in ``diagnose --json`` came of it)."""
    hb = json.loads(encode(heartbeat(0, T0, 3))[1])
    cases = [
        ({**hb, "rank": -1}, "field 'rank' must be int in [0, 2147483648), got -1"),
        ({**hb, "progress_age_s": float("inf")}, "Infinity is not a JSON number"),
        ({**hb, "progress_age_s": float("nan")}, "NaN is not a JSON number"),
        ({**hb, "coll_age_s": float("-inf")}, "-Infinity is not a JSON number"),
        ({**hb, "last_seq": {"0": 1.5}}, "field 'last_seq' must be dict[str, int]"),
        ({**hb, "dropped": True}, "field 'dropped' must be int, got True"),
    ]
    lines = [json.dumps(d).encode() for d, _ in cases] + [
        b'{"v":1,"type":"heartbeat","progress_age_s":1e999}'
    ]
    (tmp_path / "h.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))

    stats = ingest(tmp_path, store)

    assert (stats.records, stats.dead_letters) == (0, len(lines))
    reasons = store.dead_letters()["reason"].tolist()
    for (_, reason), got in zip(cases, reasons, strict=False):
        assert reason in got, (reason, got)
    assert "must be a finite float" in reasons[-1] or "lacks field" in reasons[-1]
    with pytest.raises(RecordError, match="must be a finite float"):
        store.write([dataclasses.replace(heartbeat(0, T0, 3), progress_age_s=float("inf"))])
    with pytest.raises(RecordError, match=r"field 'rank' must be int in \[0, 2147483648\)"):
        store.write([rank_info(-1)])
    assert store.counts(JOB) == dict.fromkeys(JOB_TABLES, 0)


# --- spool files: identity, links, oversized lines --------------------------------------------------


def test_two_spools_with_the_same_relative_path_are_both_read_whole(store: Store, tmp_path: Path) -> None:
    """Offsets are per file, not per path: the second spool's file is read from its start."""
    a = write_spool(tmp_path / "a", [rank_info(0), steps(0, 0, 3)])
    b = write_spool(tmp_path / "b", [rank_info(1), steps(1, 0, 5)])
    b[0].rename(a[0].parent.parent.parent / "b" / a[0].relative_to(tmp_path / "a"))  # the same name
    assert sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.jsonl")) == sorted(
        p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.jsonl")
    )

    first, second = ingest(tmp_path / "a", store), ingest(tmp_path / "b", store)

    assert (first.records, second.records) == (2, 2)
    assert store.counts(JOB)["ranks"] == 2
    assert store.steps(JOB).groupby("rank")["step"].count().to_dict() == {0: 3, 1: 5}


def test_a_file_replaced_by_a_larger_one_is_read_from_its_start(store: Store, tmp_path: Path) -> None:
    path = write_spool(tmp_path, [rank_info(0), steps(0, 0, 2)])[0]
    ingest(tmp_path, store)
    replacement = tmp_path / "new.tmp"
    replacement.write_bytes(
        b"".join(
            encode(r)[1] + b"\n" for r in [rank_info(0, T0 + 1), *(steps(0, s, s + 1) for s in range(2, 12))]
        )
    )
    replacement.replace(path)  # larger than the file it replaces

    stats = ingest(tmp_path, store)

    assert stats.records == 11
    assert store.steps(JOB)["step"].tolist() == list(range(12))
    assert store.ranks(JOB)["time_us"].tolist() == [T0 + 1]


def test_links_out_of_the_spool_are_not_followed(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``*.jsonl`` link to a file outside the spool is skipped with a warning; one inside it is read once."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(encode(rank_info(1))[1] + b"\nroot:x:0:0\n")
    spool = tmp_path / "spool"
    inside = write_spool(spool, [rank_info(0)])[0]
    (spool / "job-a" / "evil.jsonl").symlink_to(secret)
    (spool / "job-a" / "again.jsonl").symlink_to(inside)
    (spool / "job-b").symlink_to(tmp_path, target_is_directory=True)
    (tmp_path / "outside.jsonl").write_bytes(encode(rank_info(1))[1] + b"\n")

    with caplog.at_level(logging.WARNING, logger="aggregator.spool"):
        stats = ingest(spool, store)

    assert (stats.records, stats.dead_letters, stats.skipped) == (1, 0, 1)
    assert f"job-a/evil.jsonl is not read: a link to {secret}, outside the spool" in caplog.text
    assert store.ranks(JOB)["rank"].tolist() == [0]
    assert store.dead_letters().empty


def test_an_oversized_line_is_a_dead_letter_with_its_size_and_read_in_bounded_memory(
    store: Store, tmp_path: Path
) -> None:
    """A 24 MiB line: dead-lettered with its size and first bytes, the lines after it stored, and
    never held whole in memory (it took ~10x its size)."""
    import tracemalloc

    giant = b'{"v":1,"type":"heartbeat","stack":"' + b"x" * (24 << 20) + b'"}'
    good = [encode(r)[1] for r in (rank_info(0), steps(0, 0, 2))]
    path = tmp_path / "g.jsonl"
    path.write_bytes(good[0] + b"\n" + giant + b"\n" + good[1] + b"\n")

    tracemalloc.start()
    try:
        stats = ingest(tmp_path, store)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert (stats.records, stats.dead_letters) == (2, 1)
    assert peak < 8 << 20, f"peak {peak >> 20} MiB of Python memory for a {len(giant) >> 20} MiB line"
    row = store.dead_letters().to_dict("records")[0]
    assert row["position"] == str(len(good[0]) + 1)
    assert f"line of {len(giant) + 1} bytes exceeds the {MAX_LINE_BYTES}-byte limit" in row["reason"]
    assert row["raw"] == giant[:RAW_PREFIX_BYTES].decode()
    assert offset_of(store, path) == path.stat().st_size


def test_a_giant_unfinished_line_is_dead_lettered_once_and_not_read_again(
    store: Store, tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    head = encode(rank_info(0))[1] + b"\n"
    path.write_bytes(head + b'{"v":1,"type":"heartbeat","stack":"' + b"y" * (3 << 20))

    torn_size = path.stat().st_size
    first = ingest(tmp_path, store)
    again = ingest(tmp_path, store)  # the torn line is not read again
    with path.open("ab") as f:  # the writer finishes it, then writes more
        f.write(b"y" * 100 + b'"}\n' + encode(steps(0, 0, 2))[1] + b"\n")
    last = ingest(tmp_path, store)

    assert (first.records, first.dead_letters, first.bytes) == (1, 1, torn_size)
    assert (again.records, again.dead_letters, again.bytes) == (0, 0, 0)
    assert (last.records, last.dead_letters) == (1, 0)
    reason = store.dead_letters()["reason"].tolist()
    assert len(reason) == 1 and "at least" in reason[0] and "no newline yet" in reason[0]
    assert store.steps(JOB)["step"].tolist() == [0, 1]
    assert offset_of(store, path) == path.stat().st_size


# --- property: any JSON value is stored exactly as sent, or dead-lettered ---------------------------

_JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()
    | st.text(max_size=8)
    | st.from_regex(r"\A-?[0-9]{1,3}(\.[0-9]{1,3})?\Z")  # "7", "0.5": numbers in quotes
)
_JSON_VALUES = st.recursive(
    _JSON_SCALARS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=6,
)
_FITTING: dict[type, st.SearchStrategy] = {
    int: st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.integers(min_value=-(2**31), max_value=2**31),
    float: st.floats(allow_nan=False, allow_infinity=False)
    | st.integers(min_value=-(2**64), max_value=2**64),
    str: st.text(),
}
"""Values that may well fit where a value of the key type was."""
_prop_ids = itertools.count()


@pytest.fixture(scope="module")
def prop_store(chdb_path: Path) -> Iterator[Store]:
    with Store.embedded(chdb_path, database="property") as s:
        yield s


def _sent(n: int, kind: str) -> dict:
    """Record ``n`` of ``kind`` as a JSON object whose job, host, window and time are its own."""
    record: Record = {"heartbeat": heartbeat(0, T0 + n, 3), "steps": steps(0, 0, 2), "window": window(0, n)}[
        kind
    ]
    marker = f"property-{n}-{'x' * 10}"  # longer than any generated string: no value can take it
    return {**json.loads(encode(record)[1]), "job": marker, "host": marker + "h", "time_us": T0 + n}


def _mutated(data: st.DataObject, d: dict) -> None:
    """Replace one value of ``d`` (a field, a map entry, a row's value) by an arbitrary JSON value, or drop it."""
    where = [*d, "extra"]
    for name in ("rows", "functions"):
        where += [(name, i, j) for i in range(len(d.get(name, []))) for j in range(len(d[name][i]))]
    where += [("busy", k) for k in (*d.get("busy", {}), "new")] + [
        ("last_seq", k) for k in (*d.get("last_seq", {}), "new")
    ]
    target = data.draw(st.sampled_from(where), label="where")
    now = d.get(target) if isinstance(target, str) else d.get(target[0])
    if now is not None and not isinstance(target, str):
        now = now[target[1]][target[2]] if len(target) == 3 else now.get(target[1])
    fits = _FITTING.get(type(now), _JSON_VALUES)  # half of the time a value of the type it had
    value = data.draw(st.one_of(_JSON_VALUES, fits), label="value")
    if isinstance(target, str):
        if data.draw(st.booleans(), label="drop") and target != "extra":
            del d[target]
        else:
            d[target] = value
    elif len(target) == 3:
        d[target[0]][target[1]][target[2]] = value
    elif target[0] in d:
        d[target[0]][target[1]] = value


def _stored(store: Store, kind: str, d: dict) -> list[tuple]:
    """The rows the store holds for the record sent as ``d``, found by its job or host marker."""
    tables = {"heartbeat": [HEARTBEATS], "steps": [STEPS], "window": [WINDOWS, FUNCTIONS]}[kind]
    n = d.get("job") if isinstance(d.get("job"), str) and d["job"].startswith("property-") else None
    marker = n or str(d.get("host"))
    rows = []
    for t in tables:
        sql = (
            f"SELECT * FROM `{store.database}`.`{t.name}` FINAL "
            "WHERE job = {m:String} OR host = {h:String} ORDER BY ALL"
        )
        rows += [
            (t.name, *r) for r in store.client.query(sql, parameters={"m": marker, "h": marker}).result_rows
        ]
    return rows


def _row(table: Table, values: Iterable) -> tuple:
    """``values`` as ``table`` keeps them: a JSON number in a Float64 column as the nearest double."""
    out: list = [table.name]
    for (_, type_), x in zip(table.columns, values, strict=True):
        if type_ == "Float64":
            x = float(x)
        elif type_ == "Map(String, Float64)":
            x = {k: float(y) for k, y in x.items()}
        out.append(x)
    return tuple(out)


def _expected(kind: str, d: dict) -> list[tuple]:
    """The rows ``d`` becomes if stored as sent (defaults for the optional fields it lacks)."""
    cls = {"heartbeat": Heartbeat, "steps": StepBatch, "window": WindowSummary}[kind]
    v = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
    for f in dataclasses.fields(cls):
        if f.name not in v:
            v[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if kind == "heartbeat":
        v["sends"] = {
            k: tuple(x) for k, x in v["sends"].items()
        }  # JSON's pairs are lists, a Tuple column's tuples
        return [_row(HEARTBEATS, (v[c] for c in HEARTBEATS.column_names))]
    if kind == "steps":
        return sorted(_row(STEPS, (v["job"], v["rank"], v["host"], *r)) for r in v["rows"])
    head = tuple(v[c] for c in ("job", "rank", "host", "window", "step_lo", "step_hi", "time_us"))
    functions = {(f[0], f[1], f[2]): f for f in v["functions"]}  # FINAL keeps one row per function
    return [
        _row(WINDOWS, (len(v["functions"]) if c == "n_functions" else v[c] for c in WINDOWS.column_names)),
        *sorted(_row(FUNCTIONS, (*head, *f)) for f in functions.values()),
    ]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_json_value_is_stored_exactly_as_sent_or_dead_lettered(
    prop_store: Store, data: st.DataObject
) -> None:
    """A record with one value replaced by an arbitrary JSON value (NaN, 2**70, "7", true, [..], a
    lone surrogate, a missing field…) is either stored exactly as it was sent or dead-lettered with
    a reason; never silently changed. Window summaries take ClickHouse's path, the rest Python's."""
    n = next(_prop_ids)
    kind = data.draw(st.sampled_from(["window", "window", "heartbeat", "steps"]), label="kind")
    d = _sent(n, kind)
    _mutated(data, d)
    raw = json.dumps(d, separators=(",", ":"), ensure_ascii=data.draw(st.booleans(), label="ascii"))
    batch = Batch()
    batch.add_value("property", n, b"", raw.encode("utf-8", "surrogatepass"))

    prop_store.write_batch(batch)

    dead = prop_store.client.query(
        f"SELECT reason FROM `{prop_store.database}`.dead_letters FINAL "
        "WHERE source = 'property' AND position = {p:String}",
        parameters={"p": str(n)},
    ).result_rows
    stored = _stored(prop_store, kind, d)
    event(f"{kind}: {'dead letter' if dead else 'stored'}{' by ClickHouse' if batch.window_values else ''}")
    if dead:
        assert dead[0][0] and not stored, (dead, stored)
    else:
        assert sorted(stored) == sorted(_expected(kind, d)), raw


def test_nvml_samples_in_heartbeats_give_each_ranks_gpu_use(store: Store) -> None:
    from diagnosis.efficiency import measure

    sampled = [replace(heartbeat(0, T0 + i * 1_000_000, i), gpu_util=u, gpu_mem_mb=m) for i, (u, m) in
               enumerate([(80.0, 1000.0), (90.0, 3000.0)])]  # fmt: skip
    store.write([*sampled, sampled[0], heartbeat(1, T0, 0), steps(0, 0, 5), steps(1, 0, 5)])
    gpu = store.gpu_usage(JOB)
    assert gpu.to_dict("records") == [{"rank": 0, "gpu_util": 85.0, "gpu_mem_mb": 3000.0, "samples": 2}]
    assert store.gpu_usage(JOB, since_us=T0 + 500_000)["gpu_util"].tolist() == [90.0]
    e = measure(JOB, store.steps(JOB), store.windows(JOB), store.ranks(JOB), gpu)
    assert [(r.rank, r.gpu_util, r.gpu_mem_mb) for r in e.ranks] == [(0, 85.0, 3000.0), (1, None, None)]


def test_what_a_ranks_windows_cost_is_read_from_its_heartbeats_as_a_share_of_its_run(store: Store) -> None:
    from diagnosis.efficiency import measure
    from renderers.text import format_efficiency

    beats = [
        replace(heartbeat(0, T0 + i * 10_000_000, i), windows=n, window_cost_us=c)
        for i, (n, c) in enumerate([(0, 0), (1, 30_000), (2, 50_000)])
    ]
    store.write([*beats, beats[1], heartbeat(1, T0, 0), steps(0, 0, 5), steps(1, 0, 5)])
    costs = store.window_costs(JOB)
    assert costs.to_dict("records") == [
        {"rank": 0, "windows": 2, "cost_us": 50_000, "span_us": 20_000_000},
        {"rank": 1, "windows": 0, "cost_us": 0, "span_us": 0},
    ]
    e = measure(JOB, store.steps(JOB), store.windows(JOB), store.ranks(JOB), None, costs)
    assert [(r.rank, r.window_cost) for r in e.ranks] == [(0, 0.0025), (1, None)]
    assert " 0.25%" in format_efficiency(e)
    # The diagnosis says the most any rank's windows cost, from its start (the rank record) on.
    store.write([rank_info(0, T0 - 20_000_000), rank_info(1)])
    analyzed = diagnose(read_job(store, JOB)).analyzed
    assert analyzed["window_cost"] == 0.00125  # 50 ms in the 40 s from rank 0's start
