"""The spool reader and the aggregator's ingest on a real chDB engine: torn lines, shrinking files and
failures, dead letters with their reasons, values stored as sent or refused, never changed."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rankscope.aggregator import Batch, Store, StoreError, ingest
from rankscope.aggregator.batch import RAW_PREFIX_BYTES, _implied
from rankscope.aggregator.schema import FUNCTIONS, HEARTBEATS, JOB_TABLES, STEPS, WINDOWS, Table
from rankscope.aggregator.spool import MAX_LINE_BYTES
from rankscope.diagnosis import diagnose, read_job
from rankscope.wire.records import (
    MAX_VALUE_BYTES,
    FunctionPattern,
    Heartbeat,
    Record,
    RecordError,
    StepBatch,
    WindowSummary,
    encode,
)
from tests.store.builders import (
    JOB,
    T0,
    checkpoint,
    function,
    heartbeat,
    offset_of,
    rank_info,
    step_row,
    steps,
    window,
    write_spool,
)

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

    with caplog.at_level(logging.WARNING, logger="rankscope.aggregator.spool"):
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
        (_value(v=99), "unknown schema version 99"),
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

    with caplog.at_level(logging.WARNING, logger="rankscope.aggregator.spool"):
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
    from rankscope.diagnosis.efficiency import measure

    sampled = [replace(heartbeat(0, T0 + i * 1_000_000, i), gpu_util=u, gpu_mem_mb=m) for i, (u, m) in
               enumerate([(80.0, 1000.0), (90.0, 3000.0)])]  # fmt: skip
    store.write([*sampled, sampled[0], heartbeat(1, T0, 0), steps(0, 0, 5), steps(1, 0, 5)])
    gpu = store.gpu_usage(JOB)
    assert gpu.to_dict("records") == [{"rank": 0, "gpu_util": 85.0, "gpu_mem_mb": 3000.0, "samples": 2}]
    assert store.gpu_usage(JOB, since_us=T0 + 500_000)["gpu_util"].tolist() == [90.0]
    e = measure(JOB, store.steps(JOB), store.windows(JOB), store.ranks(JOB), gpu)
    assert [(r.rank, r.gpu_util, r.gpu_mem_mb) for r in e.ranks] == [(0, 85.0, 3000.0), (1, None, None)]


def test_what_a_ranks_windows_cost_is_read_from_its_heartbeats_as_a_share_of_its_run(store: Store) -> None:
    from rankscope.diagnosis.efficiency import measure
    from rankscope.renderers.text import format_efficiency

    beats = [
        replace(heartbeat(0, T0 + i * 10_000_000, i), windows=n, window_cost_us=c)
        for i, (n, c) in enumerate([(0, 0), (1, 30_000), (2, 50_000)])
    ]
    store.write([*beats, beats[1], heartbeat(1, T0, 0), steps(0, 0, 5), steps(1, 0, 5)])
    costs = store.window_costs(JOB)
    assert costs.to_dict("records") == [
        {"rank": 0, "windows": 2, "window_cost_us": 50_000, "time_us": T0 + 20_000_000},
        {"rank": 1, "windows": 0, "window_cost_us": 0, "time_us": T0},
    ]
    # From each rank's start (its rank record: where its budget starts counting) to its last word,
    # in the efficiency report and the diagnosis alike.
    store.write([rank_info(0, T0 - 20_000_000), rank_info(1)])
    e = measure(JOB, store.steps(JOB), store.windows(JOB), store.ranks(JOB), None, costs)
    assert [(r.rank, r.window_cost) for r in e.ranks] == [(0, 0.00125), (1, None)]  # 50 ms in 40 s
    assert " 0.12%" in format_efficiency(e)
    assert diagnose(read_job(store, JOB)).analyzed["window_cost"] == 0.00125
