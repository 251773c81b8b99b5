"""Property: any JSON value a hook could send is stored exactly as sent, or dead-lettered."""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rankscope.aggregator import Batch, Store
from rankscope.aggregator.schema import FUNCTIONS, HEARTBEATS, STEPS, WINDOWS, Table
from rankscope.wire.records import (
    Heartbeat,
    Record,
    StepBatch,
    WindowSummary,
    encode,
)
from tests.store.builders import (
    T0,
    heartbeat,
    steps,
    window,
)

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
