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
from collections.abc import Iterator
from pathlib import Path

import pytest

from aggregator import Batch, IngestStats, SchemaError, Store, StoreError, ensure_schema, ingest
from aggregator.schema import JOB_TABLES, TABLES, WINDOW_INPUT_OBJECTS
from profiler_hook.records import (
    MAX_VALUE_BYTES,
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
        pid=1000 + rank, nic="mlx5_0", switch="leaf1", backend="gloo", device="cpu",
    )  # fmt: skip


def step_row(step: int, rank: int) -> StepRow:
    start = T0 + step * 100_000
    return StepRow(step, start, 90_000 + rank * 5_000, 1_000, 20_000, 3, 40_000 + rank, 85_000, rank)


def steps(rank: int, lo: int, hi: int) -> StepBatch:
    rows = tuple(step_row(s, rank) for s in range(lo, hi))
    return StepBatch(job=JOB, rank=rank, host=f"node{rank // 2}", time_us=T0 + hi * 100_000, rows=rows)


def heartbeat(rank: int, time_us: int, step: int) -> Heartbeat:
    return Heartbeat(
        job=JOB, rank=rank, host=f"node{rank // 2}", time_us=time_us, step=step, progress_age_s=0.25,
        coll_group="0", coll_op="allreduce", coll_seq=step * 3, coll_age_s=0.01,
        last_seq={"0": step * 3, "1": step}, stack="train.py:42 step", dropped=rank,
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


def all_records() -> list[Record]:
    out: list[Record] = []
    for rank in (0, 1):
        out += [rank_info(rank), steps(rank, 0, 5), steps(rank, 5, 8)]
        out += [heartbeat(rank, T0 + 1_000_000, 4), heartbeat(rank, T0 + 2_000_000, 7)]
        out += [window(rank, 1), window(rank, 2)]
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
    }
    return {name: df.to_dict("records") for name, df in frames.items()}


EXPECTED_COUNTS = {"ranks": 2, "steps": 16, "heartbeats": 4, "windows": 4, "functions": 12}


# --- schema --------------------------------------------------------------------------------------


def test_schema_creation_twice_is_harmless(store: Store) -> None:
    store.write(all_records())
    ensure_schema(store.client, store.database)
    ensure_schema(store.client, store.database)
    assert store.counts(JOB) == EXPECTED_COUNTS
    tables = store.client.query(
        "SELECT name FROM system.tables WHERE database = {db:String}", parameters={"db": store.database}
    ).result_rows
    assert sorted(name for (name,) in tables) == sorted([*TABLES, *WINDOW_INPUT_OBJECTS])


def test_schema_of_another_version_is_refused(store: Store) -> None:
    store.client.command("CREATE DATABASE old_schema")
    store.client.command(
        "CREATE TABLE old_schema.steps (job String) ENGINE = MergeTree ORDER BY job "
        "COMMENT 'rankscope schema 0'"
    )
    with pytest.raises(SchemaError, match=r"old_schema.*another schema version.*steps"):
        ensure_schema(store.client, "old_schema")


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
    expected = [(JOB, r, f"node{r // 2}", *step_row(s, r)) for r in (0, 1) for s in range(8)]
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

    latest = store.heartbeats_latest(JOB)
    assert latest["rank"].tolist() == [0, 1]
    assert latest["time_us"].tolist() == [T0 + 2_000_000] * 2
    assert latest["last_seq"][0] == {"0": 21, "1": 7}
    assert latest["stack"][1] == "train.py:42 step"

    jobs = store.jobs()
    assert jobs.to_dict("records") == [
        {"job": JOB, "ranks": 2, "world_size": 2, "first_us": T0, "last_us": T0 + 2_000_000}
    ]
    assert store.offsets() == {p.relative_to(tmp_path / "spool").as_posix(): p.stat().st_size for p in paths}


def test_reads_of_an_unknown_job_are_empty_frames_with_columns(store: Store) -> None:
    assert store.counts("nope") == dict.fromkeys(JOB_TABLES, 0)
    for name, df in {"steps": store.steps("nope"), "heartbeats": store.heartbeats_latest("nope")}.items():
        assert df.empty and list(df.columns) == list(TABLES[name].column_names)
    assert store.jobs().empty and "job" in store.jobs().columns


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
    store.set_offsets({p.relative_to(tmp_path).as_posix(): 0 for p in paths})

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
    assert store.offset("j/h-rank0-1.jsonl") == len(first) + len(second) + 2
    assert store.counts(JOB)["steps"] == 2

    with path.open("ab") as f:
        f.write(third[25:] + b"\n")
    stats = ingest(tmp_path, store)

    assert stats.records == 1 and stats.bytes == len(third) + 1
    assert store.offset("j/h-rank0-1.jsonl") == path.stat().st_size
    assert store.steps(JOB)["step"].tolist() == [0, 1, 2, 3]
    assert store.dead_letters().empty


def test_a_file_that_shrank_is_read_again_from_the_start(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "h-rank0-1.jsonl"
    path.write_bytes(b"".join(encode(r)[1] + b"\n" for r in (rank_info(0), steps(0, 0, 5))))
    ingest(tmp_path, store)
    path.write_bytes(encode(steps(0, 5, 6))[1] + b"\n")  # replaced by a shorter file

    with caplog.at_level(logging.WARNING, logger="aggregator.spool"):
        stats = ingest(tmp_path, store)

    assert stats.records == 1
    assert "shrank" in caplog.text
    assert store.offset("h-rank0-1.jsonl") == path.stat().st_size
    assert store.steps(JOB)["step"].tolist() == [0, 1, 2, 3, 4, 5]


def test_a_file_name_that_is_not_utf8_is_still_ingested(store: Store, tmp_path: Path) -> None:
    path = Path(os.fsdecode(bytes(tmp_path) + b"/rank\xff.jsonl"))
    path.write_bytes(encode(rank_info(0))[1] + b"\n{broken\n")

    stats = ingest(tmp_path, store)

    assert (stats.records, stats.dead_letters) == (1, 1)
    assert store.offsets() == {"rank\\xff.jsonl": path.stat().st_size}
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

    assert store.offset("f.jsonl") == len(lines[0]) + len(lines[1])  # the first batch only
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
    bad_step["rows"][0][0] = "zero"  # decode() does not look inside rows; the store's column check does
    bad_function = json.loads(encode(window(0, 1))[1])
    bad_function["functions"][1][1] = 5  # a function name that is not a string
    oversized = b'{"v":1,"type":"rank","pad":"' + b"x" * MAX_VALUE_BYTES + b'"}'
    cases = [
        (b"{not json", "not JSON"),
        (_value(v=2), "unknown schema version 2"),
        (_value(type=["rank"]), "unknown record type"),
        (_value(rank="0"), "field 'rank' must be int"),
        (json.dumps(bad_step).encode(), "steps.step must be an integer"),
        (json.dumps(bad_function).encode(), "functions.name must be a string"),
        (_value(rank=1 << 40), "ranks.rank is outside"),
        (_value(host="\ud800"), "ranks.host is not valid Unicode"),
        (b"[" * 100_000, "not JSON"),
        (b'{"v":1,"type":"rank","job":"\xff\xfe"}', "not JSON"),
        (oversized, "exceeds the 1048576-byte limit"),
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
    assert store.counts(JOB) == {"ranks": 1, "steps": 2, "heartbeats": 1, "windows": 0, "functions": 0}
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
        if raw.isascii():
            assert row["raw"] == raw.decode()  # kept whole, the oversized one included
    assert dead["raw"][9] == '{"v":1,"type":"rank","job":"\\xff\\xfe"}'  # invalid UTF-8 kept as escapes
    assert len(dead["raw"][10]) == len(oversized)


def test_write_refuses_a_bad_record_and_writes_nothing(store: Store) -> None:
    bad = StepBatch(job=JOB, rank=0, host="h", time_us=T0, rows=(step_row(0, 0)._replace(dur_us="slow"),))  # type: ignore[arg-type]
    with pytest.raises(RecordError, match=r"steps.dur_us must be an integer, got 'slow'"):
        store.write([rank_info(0), bad])
    assert store.counts(JOB) == dict.fromkeys(JOB_TABLES, 0)


def test_dead_letter_keeps_key_and_invalid_utf8(store: Store) -> None:
    store.dead_letter("kafka:rankscope/3", 42, b"job/\xff", b"\x00\xc3(", "not JSON: test")
    row = store.dead_letters().to_dict("records")[0]
    assert (row["source"], row["position"], row["key"]) == ("kafka:rankscope/3", "42", "job/\\xff")
    assert row["raw"] == "\x00\\xc3(" and row["reason"] == "not JSON: test"
    assert row["time_us"] > T0
