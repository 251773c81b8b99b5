"""The ClickHouse schema of the store: every table's columns, engine and sort key, in one place.

Written for modern ClickHouse (23.x+) and tested on chDB. Every table is a ReplacingMergeTree whose
sort key is the identity of a row, so a record ingested twice (a replay after a crash, a spool read
again after its offsets were lost) collapses to one row in queries that use ``FINAL``. Times are
Int64 microseconds since the Unix epoch, as on the wire.

Each table carries the comment ``rankscope schema <SCHEMA_VERSION>``; :func:`ensure_schema` refuses
a database whose tables were made by another version instead of writing rows that do not fit.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from profiler_hook.records import SCHEMA_VERSION as WIRE_VERSION

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
DEFAULT_DATABASE = "rankscope"
_COMMENT = f"rankscope schema {SCHEMA_VERSION}"
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class SchemaError(RuntimeError):
    """The database holds tables this version cannot use, or its name is not a plain identifier."""


@dataclass(frozen=True, slots=True)
class Table:
    """One table: ordered ``(name, ClickHouse type)`` columns, its engine and its sort key."""

    name: str
    columns: tuple[tuple[str, str], ...]
    order_by: tuple[str, ...]
    version: str = ""
    """ReplacingMergeTree's version column: the row with the largest value wins; '' keeps the last insert."""

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.columns)

    @property
    def column_types(self) -> tuple[str, ...]:
        return tuple(type_ for _, type_ in self.columns)

    def ddl(self, database: str) -> str:
        """``CREATE TABLE IF NOT EXISTS`` for this table in ``database``."""
        # Backquotes because some column names are SQL keywords (offset, switch, count).
        cols = ",\n    ".join(f"`{name}` {type_}" for name, type_ in self.columns)
        order = ", ".join(f"`{name}`" for name in self.order_by)
        version = f"`{self.version}`" if self.version else ""
        return (
            f"CREATE TABLE IF NOT EXISTS `{database}`.`{self.name}` (\n    {cols}\n)\n"
            f"ENGINE = ReplacingMergeTree({version})\nORDER BY ({order})\nCOMMENT '{_COMMENT}'"
        )


_JOB = ("job", "LowCardinality(String)")
_HOST = ("host", "LowCardinality(String)")
_RANK = ("rank", "Int32")
_TIME = ("time_us", "Int64")

RANKS = Table(
    "ranks",
    (
        _JOB,
        _RANK,
        _HOST,
        ("local_rank", "Int32"),
        ("world_size", "Int32"),
        ("pid", "Int64"),
        ("nic", "LowCardinality(String)"),
        ("switch", "LowCardinality(String)"),
        ("backend", "LowCardinality(String)"),
        ("device", "LowCardinality(String)"),
        _TIME,
    ),
    order_by=("job", "rank"),
    # A restarted rank sends a new ``rank`` record; the latest start describes it.
    version="time_us",
)

STEPS = Table(
    "steps",
    (
        _JOB,
        _RANK,
        _HOST,
        ("step", "Int64"),
        ("start_us", "Int64"),
        ("dur_us", "Int64"),
        ("data_us", "Int64"),
        ("comm_us", "Int64"),
        ("n_coll", "Int64"),
        ("first_coll_us", "Int64"),
        ("cpu_us", "Int64"),
        ("nivcsw", "Int64"),
    ),
    order_by=("job", "rank", "step"),
    # A rank restarted from a checkpoint runs some steps again; the later run is the one that counts.
    version="start_us",
)

HEARTBEATS = Table(
    "heartbeats",
    (
        _JOB,
        _RANK,
        _HOST,
        _TIME,
        ("step", "Int64"),
        ("progress_age_s", "Float64"),
        ("coll_group", "LowCardinality(String)"),
        ("coll_op", "LowCardinality(String)"),
        ("coll_seq", "Int64"),
        ("coll_age_s", "Float64"),
        ("last_seq", "Map(String, Int64)"),
        ("stack", "String"),
        ("dropped", "Int64"),
    ),
    order_by=("job", "rank", "time_us"),
)

WINDOWS = Table(
    "windows",
    (
        _JOB,
        _RANK,
        _HOST,
        ("window", "Int64"),
        ("step_lo", "Int64"),
        ("step_hi", "Int64"),
        _TIME,
        ("dur_us", "Int64"),
        ("busy", "Map(String, Float64)"),
        ("n_events", "Int64"),
        ("n_functions", "Int32"),
    ),
    order_by=("job", "window", "rank"),
    version="time_us",
)

FUNCTIONS = Table(
    "functions",
    (
        _JOB,
        _RANK,
        _HOST,
        ("window", "Int64"),
        ("step_lo", "Int64"),
        ("step_hi", "Int64"),
        # The window record's time: the version, so a re-sent window replaces its functions as a whole.
        _TIME,
        ("kind", "LowCardinality(String)"),
        ("name", "String"),
        ("stack", "String"),
        ("count", "Int64"),
        ("total_us", "Float64"),
        ("mean_us", "Float64"),
        ("p50_us", "Float64"),
        ("p90_us", "Float64"),
        ("max_us", "Float64"),
        ("cv", "Float64"),
        ("interval_us", "Float64"),
        ("interval_cv", "Float64"),
        ("nbytes", "Int64"),
    ),
    order_by=("job", "window", "rank", "kind", "name", "stack"),
    version="time_us",
)

DEAD_LETTERS = Table(
    "dead_letters",
    (
        ("source", "String"),
        ("position", "String"),
        ("key", "String"),
        ("raw", "String"),
        ("reason", "String"),
        _TIME,
    ),
    order_by=("source", "position"),
)

INGEST_OFFSETS = Table(
    "ingest_offsets",
    (("source", "String"), ("offset", "UInt64"), _TIME),
    order_by=("source",),
    # Versioned by commit time, not by offset: after a spool file shrank the reader restarts at 0,
    # and a max-offset version would hide that smaller offset behind the stale larger one.
    version="time_us",
)

TABLES: dict[str, Table] = {
    t.name: t for t in (RANKS, STEPS, HEARTBEATS, WINDOWS, FUNCTIONS, DEAD_LETTERS, INGEST_OFFSETS)
}
JOB_TABLES = ("ranks", "steps", "heartbeats", "windows", "functions")
"""The tables whose rows belong to a job."""

# --- window summaries parsed by ClickHouse ---------------------------------------------------------
#
# A window summary is ~300 function rows: checking and serializing them value by value in Python
# caps one aggregator near 100 summaries/s. Instead the aggregator inserts the wire values as they
# came (``FORMAT JSONEachRow``) into WINDOW_INPUT, a Null table that stores nothing; two
# materialized views explode each value into its ``windows`` row and its ``functions`` rows. The
# engine parses strictly: a value of the wrong type fails the insert, and the constraint below
# fails it when a field is missing (NULL) or the version or type is wrong. The aggregator then
# falls back to checking that batch record by record in Python, which dead-letters the bad ones.
WINDOW_INPUT_NAME = "window_input"
WINDOW_INPUT_OBJECTS = (WINDOW_INPUT_NAME, "windows_from_input", "functions_from_input")
"""The input table and its two views."""
_HEADER = [c for c in WINDOWS.columns if c[0] != "n_functions"]
_REQUIRED = [name for name, type_ in _HEADER if not type_.startswith("Map")]
_FUNCTION_ROW = [c for c in FUNCTIONS.columns if c not in _HEADER]


def _plain(type_: str) -> str:
    """``T`` for ``LowCardinality(T)``; any other type as it is."""
    inner = type_.removeprefix("LowCardinality(")
    return inner[:-1] if inner != type_ else type_


def _nullable(name: str, type_: str) -> tuple[str, str]:
    if name == "rank":
        type_ = "Int64"  # range-checked below rather than wrapped around by the parser
    return name, f"Nullable({_plain(type_)})"


_INPUT_COLUMNS = [
    ("v", "Nullable(Int64)"),
    ("type", "Nullable(String)"),
    *(_nullable(name, type_) if name in _REQUIRED else (name, type_) for name, type_ in _HEADER),
    # Plain String, not LowCardinality, inside the array: building a dictionary value by value while
    # parsing 300 tuples costs ~8% of the aggregator's CPU; the view converts whole columns instead.
    ("functions", f"Array(Tuple({', '.join(_plain(t) for _, t in _FUNCTION_ROW)}))"),
]
_INPUT_CHECK = " AND ".join(
    [f"v = {WIRE_VERSION}", "type = 'window'", "rank BETWEEN 0 AND 2147483647"]
    + [f"`{name}` IS NOT NULL" for name in _REQUIRED]
)


def _window_input_ddl(database: str) -> list[str]:
    """The Null input table and the two views that fill ``windows`` and ``functions`` from it."""
    cols = ",\n    ".join(f"`{name}` {type_}" for name, type_ in _INPUT_COLUMNS)
    t = f"`{database}`.`{WINDOW_INPUT_NAME}`"

    def header(names: list[str]) -> str:
        return ", ".join(f"assumeNotNull(`{n}`) AS `{n}`" if n in _REQUIRED else f"`{n}`" for n in names)

    fn = ", ".join(f"f.{i} AS `{name}`" for i, (name, _) in enumerate(_FUNCTION_ROW, 1))
    return [
        f"CREATE TABLE IF NOT EXISTS {t} (\n    {cols},\n    CONSTRAINT complete CHECK {_INPUT_CHECK}\n)\n"
        f"ENGINE = Null\nCOMMENT '{_COMMENT}'",
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS `{database}`.`{WINDOW_INPUT_OBJECTS[1]}` TO `{database}`.`windows` "
        f"AS SELECT {header([n for n, _ in _HEADER])}, toInt32(length(functions)) AS n_functions FROM {t}",
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS `{database}`.`{WINDOW_INPUT_OBJECTS[2]}` TO `{database}`.`functions` "
        f"AS SELECT {header([n for n, _ in FUNCTIONS.columns if n not in dict(_FUNCTION_ROW)])}, {fn} "
        f"FROM {t} ARRAY JOIN functions AS f",
    ]


def check_identifier(database: str) -> str:
    """Return ``database`` if it is a plain identifier; it is spliced into SQL, so nothing else is."""
    if not isinstance(database, str) or not _IDENTIFIER.match(database):
        raise SchemaError(f"database name {database!r} must match {_IDENTIFIER.pattern}")
    return database


def ensure_schema(client: Any, database: str = DEFAULT_DATABASE) -> None:
    """Create the database and every table if missing; harmless to call again.

    ``client`` is a clickhouse_connect client (chDB or server). Raises :class:`SchemaError` when an
    existing table carries another schema version's comment.
    """
    check_identifier(database)
    # Checked before creating anything, so a refused database is left as it was found.
    found = client.query(
        "SELECT name, comment FROM system.tables WHERE database = {db:String}",
        parameters={"db": database},
    ).result_rows
    wrong = {name: comment for name, comment in found if name in TABLES and comment != _COMMENT}
    if wrong:
        raise SchemaError(
            f"database {database!r} has tables from another schema version {wrong}; this code writes "
            f"{_COMMENT!r}: use another database or migrate it"
        )
    client.command(f"CREATE DATABASE IF NOT EXISTS `{database}`")
    for table in TABLES.values():
        client.command(table.ddl(database))
    for ddl in _window_input_ddl(database):
        client.command(ddl)
    log.debug("schema %s ready in database %s", SCHEMA_VERSION, database)
