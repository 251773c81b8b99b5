"""Records written to a real chDB store read back as sent, by every read the diagnosis makes; a
spool replayed is stored once."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from rankscope.aggregator import IngestStats, Store, ensure_schema, ingest
from rankscope.aggregator.reads import STEP_COLUMNS, SpoolOffset
from rankscope.aggregator.schema import (
    ARRIVALS_BY_PROCESS_OBJECTS,
    JOB_TABLES,
    LATEST_HEARTBEATS_OBJECTS,
    TABLES,
)
from rankscope.aggregator.spool import file_id
from rankscope.diagnosis import diagnose, read_job
from rankscope.diagnosis.data import RecentJob
from rankscope.wire.records import FunctionPattern
from tests.store.builders import (
    EXPECTED_COUNTS,
    JOB,
    T0,
    all_records,
    exit_record,
    function,
    heartbeat,
    rank_info,
    snapshot,
    step_row,
    steps,
    write_spool,
)


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
