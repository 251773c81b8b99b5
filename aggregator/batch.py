"""The write model: wire values checked against the rules and the column types, into a batch.

A :class:`Batch` collects what one pass (a spool read, a Kafka poll) brings: values decoded,
checked and turned into rows per table, window summaries set aside for ClickHouse's own JSON
parser (see ``aggregator.schema``), and dead letters with their reasons. ``Store.write_batch``
stores it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import fields
from operator import attrgetter
from typing import Any

from rankscope.wire.records import (
    FUNCTION_COLUMNS,
    INT64,
    INT_RANGES,
    MAX_VALUE_BYTES,
    STEP_COLUMNS,
    WIRE_VERSION,
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
    checked_str,
    decode,
)
from rankscope.wire.records import check as check_record

from .schema import (
    ARRIVALS,
    ATTEMPTS,
    CHECKPOINTS,
    DEAD_LETTERS,
    EXITS,
    FUNCTIONS,
    HEARTBEATS,
    QUOTES_FIELD,
    RANKS,
    STEPS,
    WINDOWS,
    Table,
)

log = logging.getLogger(__name__)


# --- checking a dead letter's values against its columns ----------------------------------------
#
# A record's rows need no such check: see ``implied`` below.


def _int64(v: Any) -> Any:
    if type(v) is not int:  # bool is an int subclass, and JSON true is not a count
        raise ValueError("an integer")
    if not INT64[0] <= v < INT64[1]:
        raise ValueError(f"within [{INT64[0]}, {INT64[1]})")
    return v


_DEAD_LETTER_CHECKS = tuple(
    (name, {"Int64": _int64, "String": checked_str}[type_]) for name, type_ in DEAD_LETTERS.columns
)


def _checked_dead_letter(values: tuple[Any, ...]) -> tuple[Any, ...]:
    out = []
    for (name, check), v in zip(_DEAD_LETTER_CHECKS, values, strict=True):
        try:
            out.append(check(v))
        except ValueError as exc:
            raise RecordError(f"{DEAD_LETTERS.name}.{name} must be {exc}, got {v!r:.80}") from None
    return tuple(out)


# Step and function rows are spliced onto their record's columns by position, so a reordered
# NamedTuple would silently fill the wrong columns: refuse to import instead.
_FUNCTION_PREFIX = ("job", "rank", "host", "window", "step_lo", "step_hi", "time_us")
for _table, _columns in (
    (STEPS, ("job", "rank", "host", *STEP_COLUMNS)),
    (FUNCTIONS, (*_FUNCTION_PREFIX, *FUNCTION_COLUMNS)),
):
    if _table.column_names != _columns:
        raise ImportError(f"aggregator.schema table {_table.name} is out of step with wire.records")


_COLUMN_RANGES = {"Int32": (-(1 << 31), 1 << 31), "Int64": INT64}
_WIRE_COLUMNS = {
    "str": ("String", "LowCardinality(String)"),
    "float": ("Float64",),
    "dict[str, float]": ("Map(String, Float64)",),
    "dict[str, int]": ("Map(String, Int64)",),
    "dict[str, tuple[int, int]]": ("Map(String, Tuple(Int64, Int64))",),
}


def _wire_types() -> dict[str, set[str]]:
    """Every field and row column of the records, by name: the types wire.records holds it to."""
    out: dict[str, set[str]] = {}
    for cls in (StepBatch, Heartbeat, RankInfo, Checkpoint, Exit, WindowSummary):
        for f in fields(cls):
            out.setdefault(f.name, set()).add(str(f.type))
    for row in (StepRow, FunctionPattern):
        for name, t in row.__annotations__.items():
            out.setdefault(name, set()).add(getattr(t, "__forward_arg__", str(t)))
    return out


def implied(column: str, type_: str, wire: set[str]) -> bool:
    """Whether every value wire.records lets through for a field of these types fits the column."""
    if wire == {"int"}:
        lo, hi = INT_RANGES.get(column, INT64)
        col = _COLUMN_RANGES.get(type_)
        return col is not None and col[0] <= lo and hi <= col[1]
    return len(wire) == 1 and type_ in _WIRE_COLUMNS.get(next(iter(wire)), ())


# A record's rows are not checked again against the column types: decode() and check() already
# hold each field to wire's rules, which imply the column's (a value of the wrong type, out of an
# Int32 column's range, a non-finite float, invalid Unicode: refused there). What the rows hold
# besides (the number of functions, the record type) is made here. Refuse to import where a
# change to either side would let through a value its column cannot hold.
_MADE_HERE = {(WINDOWS.name, "n_functions"), (ARRIVALS.name, "type")}
_WIRE = _wire_types()
for _table in (STEPS, HEARTBEATS, RANKS, ATTEMPTS, CHECKPOINTS, EXITS, WINDOWS, FUNCTIONS, ARRIVALS):
    for _name, _type in zip(_table.column_names, _table.column_types, strict=True):
        if (_table.name, _name) not in _MADE_HERE and not implied(_name, _type, _WIRE.get(_name, set())):
            raise ImportError(f"{_table.name}.{_name} ({_type}) may get values wire.records lets through")


_GETTERS = {t.name: attrgetter(*t.column_names) for t in (HEARTBEATS, RANKS, ATTEMPTS, CHECKPOINTS, EXITS)}


def _attrs(record: Record, table: Table) -> tuple[Any, ...]:
    return _GETTERS[table.name](record)  # type: ignore[no-any-return]


def _record_rows(record: Record) -> list[tuple[Table, tuple[Any, ...]]]:
    """The rows one checked record (decode()'s, or check()'s) becomes, its arrival among them."""
    rows = _rows_of(record)
    if record.seq >= 0:
        rows.append(
            (ARRIVALS, (record.job, record.rank, record.pid, record.seq, record.TYPE, record.time_us))
        )
    return rows


def _rows_of(record: Record) -> list[tuple[Table, tuple[Any, ...]]]:
    if isinstance(record, StepBatch):
        head = (record.job, record.rank, record.host)
        return [(STEPS, head + row) for row in record.rows]
    if isinstance(record, Heartbeat):
        return [(HEARTBEATS, _attrs(record, HEARTBEATS))]
    if isinstance(record, RankInfo):
        return [(t, _attrs(record, t)) for t in (RANKS, ATTEMPTS)]
    if isinstance(record, Checkpoint):
        return [(CHECKPOINTS, _attrs(record, CHECKPOINTS))]
    if isinstance(record, Exit):
        return [(EXITS, _attrs(record, EXITS))]
    if isinstance(record, WindowSummary):
        window = tuple(
            len(record.functions) if c == "n_functions" else getattr(record, c) for c in WINDOWS.column_names
        )
        head = tuple(getattr(record, c) for c in _FUNCTION_PREFIX)
        return [(WINDOWS, window), *((FUNCTIONS, head + f) for f in record.functions)]
    raise TypeError(f"not a record: {type(record).__name__}")


_WINDOW_PREFIX = b'{"v":%d,"type":"window",' % WIRE_VERSION
_QUOTES = QUOTES_FIELD.encode()
"""How the hook's encode() starts a window summary: such values go to ClickHouse's JSON parser."""
_DIGITS = bytes(48 if 48 <= i <= 57 else 32 for i in range(256))
"""Maps every digit to ``0`` and every other byte to a space."""
_LONG_NUMBER = b"0" * 19
"""A run of 19 digits: a JSON integer that may not fit Int64, where ClickHouse would wrap it."""

RAW_PREFIX_BYTES = 4096
"""A dead letter's value longer than ``MAX_VALUE_BYTES`` is kept as its first this many bytes."""


def _window_quotes(value: bytes) -> int | None:
    """The ``"`` characters of a window value outside escapes, or None if ClickHouse must not parse it.

    None for a value that is not UTF-8, or that holds a run of 19 digits: ClickHouse would store
    such a value changed (see ``aggregator.schema``), so Python decodes it instead.
    """
    if not value.isascii():
        try:
            value.decode()
        except UnicodeDecodeError:
            return None
    if _LONG_NUMBER in value.translate(_DIGITS):
        return None
    if b"\\" in value:  # escaped backslashes first: in ``\\"`` the quote ends a string
        value = value.replace(b"\\\\", b"").replace(b'\\"', b"")
    return value.count(b'"')


def _now_us() -> int:
    return time.time_ns() // 1000


class Batch:
    """Rows of many records and dead letters, grouped per table, written by :meth:`Store.write_batch`.

    :meth:`add` checks a whole record before taking any of its rows, so a bad record (which
    ``decode`` let through, e.g. a string inside a step row) can be dead-lettered by the caller
    instead of failing the insert of everything else.
    """

    def __init__(self) -> None:
        self.rows: dict[str, list[tuple[Any, ...]]] = {}
        self.window_values: list[tuple[str, str | int, bytes, bytes, int]] = []
        """Window summaries as they came (source, position, key, value, quote characters in the
        value), for ClickHouse to parse."""
        self.records = 0
        """Records added."""
        self.dead_letters = 0
        """Dead letters added."""
        self.nbytes = 0
        """Bytes of the wire values taken by :meth:`add_value`."""

    def __len__(self) -> int:
        return self.records + self.dead_letters

    def add_value(self, source: str, position: str | int, key: bytes, value: bytes) -> None:
        """Take one wire value, or keep it as a dead letter with the reason; never raises.

        A window summary in the hook's encoding is kept as bytes: :meth:`Store.write_batch` has
        ClickHouse parse and check it by the same rules (see ``aggregator.schema.WINDOW_INPUT_NAME``),
        which is ~6x faster than checking its few hundred function rows here.
        """
        self.nbytes += len(value)
        if (
            value.startswith(_WINDOW_PREFIX)
            and len(value) <= MAX_VALUE_BYTES
            and b'"functions":[' in value
            and b'"busy":{' in value
        ):
            quotes = _window_quotes(value)
            if quotes is not None:
                self.window_values.append((source, position, key, value, quotes))
                self.records += 1
                return
        self._add_decoded(source, position, key, value)

    def check_windows(self) -> None:
        """Check the window values record by record in Python instead: rows, or dead letters."""
        values, self.window_values = self.window_values, []
        self.records -= len(values)
        for source, position, key, value, _ in values:
            self._add_decoded(source, position, key, value)

    def _add_decoded(self, source: str, position: str | int, key: bytes, value: bytes) -> None:
        try:
            self._take(decode(value))  # decode() checked it
        except RecordError as exc:
            self.dead_letter(source, position, key, value, str(exc))
        except Exception as exc:
            # A bug in decoding must not stall a partition or a spool file: the same value would
            # fail on every retry.
            log.warning(
                "unexpected error decoding %s at %s: %r; kept as a dead letter", source, position, exc
            )
            self.dead_letter(source, position, key, value, f"unexpected {type(exc).__name__}: {exc}")

    def add(self, record: Record) -> None:
        """Take one record's rows; raises RecordError (taking nothing) if a value breaks the rules
        of ``wire.records.decode`` or does not fit its column."""
        self._take(check_record(record))

    def _take(self, record: Record) -> None:
        rows = _record_rows(record)
        for table, row in rows:
            self.rows.setdefault(table.name, []).append(row)
        self.records += 1

    def dead_letter(self, source: str, position: str | int, key: bytes, raw: bytes, reason: str) -> None:
        """Keep a value that could not be stored, with where it came from and why.

        Bytes are decoded with ``backslashreplace``: invalid UTF-8 survives as ``\\xNN`` escapes. A
        value over ``MAX_VALUE_BYTES`` is kept as its first ``RAW_PREFIX_BYTES``, the reason saying so.
        """
        if len(raw) > MAX_VALUE_BYTES:
            reason = f"{reason} (kept: its first {RAW_PREFIX_BYTES} of {len(raw)} bytes)"
            raw = raw[:RAW_PREFIX_BYTES]
        row = (
            source,
            str(position),
            key.decode("utf-8", "backslashreplace"),
            raw.decode("utf-8", "backslashreplace"),
            reason,
            _now_us(),
        )
        self.rows.setdefault(DEAD_LETTERS.name, []).append(_checked_dead_letter(row))
        self.dead_letters += 1
