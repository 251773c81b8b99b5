"""Bad input on a real chDB engine: lines that become dead letters with their reasons, and values
stored exactly as sent or refused, never changed."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from rankscope.aggregator import Batch, Store, ingest
from rankscope.aggregator.batch import RAW_PREFIX_BYTES, implied
from rankscope.aggregator.schema import JOB_TABLES
from rankscope.aggregator.spool import MAX_LINE_BYTES
from rankscope.wire.records import (
    MAX_VALUE_BYTES,
    FunctionPattern,
    RecordError,
    StepBatch,
    encode,
)
from tests.store.builders import (
    JOB,
    T0,
    checkpoint,
    function,
    heartbeat,
    rank_info,
    step_row,
    steps,
    window,
)

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
    assert implied("rank", "Int32", {"int"}) and implied("step", "Int64", {"int"})
    assert not implied("step", "Int32", {"int"})
    assert not implied("count", "Float64", {"int"})
    assert implied("name", "LowCardinality(String)", {"str"}) and not implied("name", "Int64", {"str"})
    assert not implied("rank", "Int32", set())  # a column no record field fills


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
