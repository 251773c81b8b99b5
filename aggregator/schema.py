"""The ClickHouse schema of the store: every table's columns, engine and sort key, in one place.

Written for modern ClickHouse (23.x+) and tested on chDB. Every table is a ReplacingMergeTree whose
sort key is the identity of a row, so a record ingested twice (a replay after a crash, a spool read
again after its offsets were lost) collapses to one row in queries that use ``FINAL``. Times are
Int64 microseconds since the Unix epoch, as on the wire.

Each table carries the comment ``rankscope schema <STORE_VERSION>``; :func:`ensure_schema` migrates
a database of an older version (``MIGRATIONS``) and refuses one of a newer or unknown version
instead of writing rows that do not fit. (The wire format has a version of its own,
``wire.records.WIRE_VERSION``.)
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from rankscope.wire.errors import SchemaError
from rankscope.wire.records import WIRE_VERSION

log = logging.getLogger(__name__)

STORE_VERSION = 13
DEFAULT_DATABASE = "rankscope"
_COMMENT = f"rankscope schema {STORE_VERSION}"
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True)
class Table:
    """One table: ordered ``(name, ClickHouse type)`` columns, its engine and its sort key."""

    name: str
    columns: tuple[tuple[str, str], ...]
    order_by: tuple[str, ...]
    version: str = ""
    """ReplacingMergeTree's version column: the row with the largest value wins; '' keeps the last insert."""
    engine: str = "ReplacingMergeTree"

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.columns)

    @property
    def column_types(self) -> tuple[str, ...]:
        return tuple(type_ for _, type_ in self.columns)

    def ddl(self, database: str, cluster: str = "") -> list[str]:
        """``CREATE TABLE IF NOT EXISTS`` for this table in ``database``; on a ``cluster``, its
        shards' replicated tables (``<name>_local``) and the ``Distributed`` table over them that
        takes its name, sharded by the first column of the sort key (a job's rows, and a row's
        copies, on one shard: ``FINAL`` collapses them there)."""
        # Backquotes because some column names are SQL keywords (offset, switch, count).
        cols = ",\n    ".join(f"`{name}` {type_}" for name, type_ in self.columns)
        order = ", ".join(f"`{name}`" for name in self.order_by)
        version = f"`{self.version}`" if self.version else ""
        if not cluster:
            return [
                f"CREATE TABLE IF NOT EXISTS `{database}`.`{self.name}` (\n    {cols}\n)\n"
                f"ENGINE = {self.engine}({version})\nORDER BY ({order})\nCOMMENT '{_COMMENT}'"
            ]
        local, on = f"{self.name}{LOCAL}", on_cluster(cluster)
        keeper = f"'/clickhouse/tables/{{shard}}/{database}/{local}', '{{replica}}'"
        return [
            f"CREATE TABLE IF NOT EXISTS `{database}`.`{local}`{on} (\n    {cols}\n)\n"
            f"ENGINE = Replicated{self.engine}({', '.join(filter(None, (keeper, version)))})\n"
            f"ORDER BY ({order})\nCOMMENT '{_COMMENT}'",
            f"CREATE TABLE IF NOT EXISTS `{database}`.`{self.name}`{on} AS `{database}`.`{local}`\n"
            f"ENGINE = Distributed(`{cluster}`, `{database}`, `{local}`, cityHash64(`{self.order_by[0]}`))\n"
            f"COMMENT '{_COMMENT}'",
        ]


LOCAL = "_local"
"""On a cluster, the suffix of a table's shards' own tables (its name is the ``Distributed`` one's)."""


def on_cluster(cluster: str) -> str:
    """`` ON CLUSTER `name` `` for DDL run on every node of ``cluster`` ('' for one server)."""
    return f" ON CLUSTER `{check_identifier(cluster)}`" if cluster else ""


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
        ("spine", "LowCardinality(String)"),  # schema 3
        ("backend", "LowCardinality(String)"),
        ("device", "LowCardinality(String)"),
        ("coverage", "String"),  # schema 4
        ("mesh", "Map(String, Int64)"),  # schema 11
        _TIME,
    ),
    order_by=("job", "rank"),
    # A restarted rank sends a new ``rank`` record; the latest start describes it.
    version="time_us",
)

ATTEMPTS = Table(
    "attempts",
    (_JOB, _RANK, _HOST, ("attempt", "Int32"), ("pid", "Int64"), ("world_size", "Int32"), _TIME),
    order_by=("job", "rank", "time_us"),
)
"""Every start of every rank (``ranks`` keeps only the latest): the job's attempts and restarts."""

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
        # The row holds the totals of steps ``step .. step + n_steps - 1`` (Store.steps() reads them
        # back one row per step); schema 1 had one row per step.
        ("n_steps", "Int64"),
        ("wait_us", "Int64"),  # schema 5
        ("gc_us", "Int64"),  # schema 13
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
        ("coll_peer", "Int64"),  # schema 11
        ("coll_age_s", "Float64"),
        ("last_seq", "Map(String, Int64)"),
        ("stack", "String"),
        ("dropped", "Int64"),
        ("gpu_util", "Float64"),  # schema 3
        ("gpu_mem_mb", "Float64"),
        ("samples", "Map(String, Int64)"),  # schema 6
        ("sends", "Map(String, Tuple(Int64, Int64))"),  # schema 7
        ("windows", "Int64"),  # schema 10
        ("window_cost_us", "Int64"),
        ("gpu_xids", "Map(String, Int64)"),  # schema 12
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
    # Kind first: the diagnosis reads the patterns every rank is compared on (the run-queue wait,
    # network sends: a row or two of a window's ~300) of every rank, and every pattern of a few
    # ranks; either read then touches only its own rows (schema 9; before, window first).
    order_by=("job", "kind", "rank", "window", "name", "stack"),
    version="time_us",
)

CHECKPOINTS = Table(
    "checkpoints",
    (
        _JOB,
        _RANK,
        _HOST,
        ("kind", "LowCardinality(String)"),
        ("step", "Int64"),
        ("start_us", "Int64"),
        ("dur_us", "Int64"),
        ("attempt", "Int32"),
        _TIME,
    ),
    order_by=("job", "rank", "kind", "start_us"),
)
"""Checkpoint saves and loads timed by ``Hook.checkpoint()``."""

EXITS = Table(
    "exits",
    (
        _JOB,
        _RANK,
        _HOST,
        ("pid", "Int64"),
        ("attempt", "Int32"),
        ("how", "LowCardinality(String)"),
        ("step", "Int64"),
        ("error", "String"),
        ("message", "String"),
        ("frame", "String"),
        ("signal", "Int32"),
        ("gpu", "Map(String, Int64)"),  # schema 12
        _TIME,
    ),
    order_by=("job", "rank", "pid"),
)
"""How each rank's process ended (schema 11): one row per process."""

ARRIVALS = Table(
    "arrivals",
    (_JOB, _RANK, ("pid", "Int64"), ("seq", "Int64"), ("type", "LowCardinality(String)"), _TIME),
    order_by=("job", "rank", "pid", "seq"),
)
"""One row per record stored, by its number (``seq``) among those its process made for its job and
rank: the numbers a rank's process made and the store lacks are records lost on the way
(``Reads.missing``). Records of hooks that do not number them (``seq`` -1) have none."""

ARRIVALS_BY_PROCESS = "arrivals_by_process"
"""Per job, rank and process, the largest record number stored and the set of those stored (a
compressed bitmap: a process's numbers are dense), kept up to date from ``arrivals`` by a view, so
that the records lost on the way (``Reads.missing``) are read from one row per process, not one
per record."""


ARRIVALS_BY_PROCESS_TABLE = Table(
    ARRIVALS_BY_PROCESS,
    (
        _JOB,
        _RANK,
        ("pid", "Int64"),
        ("last", "AggregateFunction(max, Int64)"),
        ("seqs", "AggregateFunction(groupBitmap, UInt64)"),
    ),
    order_by=("job", "rank", "pid"),
    engine="AggregatingMergeTree",
)
ARRIVALS_BY_PROCESS_OBJECTS = (ARRIVALS_BY_PROCESS, f"{ARRIVALS_BY_PROCESS}_from_arrivals")
"""The table and the view that fills it."""


def _arrivals_by_process_ddl(database: str, cluster: str = "") -> list[str]:
    """The table, its view, and last what fills it from a store made before it (one server)."""
    # On a cluster, each shard's view reads the arrivals its shard stores, into its own table.
    local = LOCAL if cluster else ""
    select = (
        "SELECT job, rank, pid, maxState(seq) AS last, groupBitmapState(toUInt64(seq)) AS seqs "
        f"FROM `{database}`.`{ARRIVALS.name}{local}` WHERE seq >= 0 GROUP BY job, rank, pid"
    )
    t = f"`{database}`.`{ARRIVALS_BY_PROCESS}{local}`"
    return [
        *ARRIVALS_BY_PROCESS_TABLE.ddl(database, cluster),
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS `{database}`.`{ARRIVALS_BY_PROCESS_OBJECTS[1]}`"
        f"{on_cluster(cluster)} TO {t} AS {select}",
        # A store made before this table: what ``arrivals`` holds already. Both aggregates are
        # idempotent, so rows the view also counted (inserted meanwhile) change nothing.
        f"INSERT INTO {t} {select}",
    ]


LATEST_HEARTBEATS = Table(
    "latest_heartbeats",
    tuple(c for c in HEARTBEATS.columns if c[0] not in ("samples", "sends")),
    order_by=("job", "rank"),
    version="time_us",
)
"""Per job and rank, its latest heartbeat (without its stack samples and link sends), kept up to
date from ``heartbeats`` by a view: what the hang rule reads of every rank (``Reads.heartbeats_latest``)
from one row per rank, not sorted out of every heartbeat (docs/benchmarks.md has the figures)."""
LATEST_HEARTBEATS_OBJECTS = (LATEST_HEARTBEATS.name, f"{LATEST_HEARTBEATS.name}_from_heartbeats")
"""The table and the view that fills it."""


def _latest_heartbeats_ddl(database: str, cluster: str = "") -> list[str]:
    """The table, its view, and last what fills it from a store made before it (one server)."""
    local = LOCAL if cluster else ""
    names = ", ".join(f"`{c}`" for c in LATEST_HEARTBEATS.column_names)
    select = f"SELECT {names} FROM `{database}`.`{HEARTBEATS.name}{local}`"
    t = f"`{database}`.`{LATEST_HEARTBEATS.name}{local}`"
    return [
        *LATEST_HEARTBEATS.ddl(database, cluster),
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS `{database}`.`{LATEST_HEARTBEATS_OBJECTS[1]}`"
        f"{on_cluster(cluster)} TO {t} AS {select}",
        # A store made before this table: each rank's latest heartbeat it holds (rows the view
        # also wrote meanwhile are the same or later: the latest wins).
        f"INSERT INTO {t} {select} ORDER BY job, rank, time_us DESC LIMIT 1 BY job, rank",
    ]


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

SPOOL_OFFSETS = Table(
    "spool_offsets",
    (
        # The file's identity (``aggregator.spool.file_id``: device, inode and a hash of its first
        # line), not its path: two spools ingested into one store may hold the same relative path,
        # and a file replaced under its name is another file.
        ("file", "String"),
        ("path", "String"),
        ("offset", "UInt64"),
        ("in_line", "UInt8"),
        _TIME,
    ),
    order_by=("file",),
    # Versioned by commit time, not by offset: after a spool file shrank the reader restarts at 0,
    # and a max-offset version would hide that smaller offset behind the stale larger one.
    version="time_us",
)
"""How far each spool file has been ingested. ``path`` (relative to the spool root) is for people;
``in_line`` = 1 says the offset lies inside an oversized line that was dead-lettered already, whose
rest up to its newline is skipped. A store made before this table keeps an unused
``ingest_offsets`` table (keyed by path): its spool files are read once more from the start, which
adds no rows (see above)."""

TABLES: dict[str, Table] = {
    t.name: t
    for t in (
        RANKS,
        ATTEMPTS,
        STEPS,
        HEARTBEATS,
        WINDOWS,
        FUNCTIONS,
        CHECKPOINTS,
        EXITS,
        ARRIVALS,
        DEAD_LETTERS,
        SPOOL_OFFSETS,
    )
}
JOB_TABLES = (
    "ranks",
    "attempts",
    "steps",
    "heartbeats",
    "windows",
    "functions",
    "checkpoints",
    "exits",
    "arrivals",
)
"""The tables whose rows belong to a job."""

# --- window summaries parsed by ClickHouse ---------------------------------------------------------
#
# A window summary is ~300 function rows: checking and serializing them value by value in Python
# caps one aggregator near 100 summaries/s. Instead the aggregator inserts the wire values as they
# came (``FORMAT JSONEachRow``) into WINDOW_INPUT, a Null table that stores nothing; two
# materialized views explode each value into its ``windows`` row and its ``functions`` rows.
#
# ClickHouse's JSON parser is lenient where ``wire.records.decode`` is not: it reads
# "7" and "0.5" into number columns, wraps an integer that overflows, reads NaN, ``inf``, ``07``,
# ``.5``, trailing commas, unknown escapes and raw control characters. So a value must pass, in
# ClickHouse, everything decode() checks before it is stored this way:
#
# * WINDOW_JSON, a second Null table, takes the same values first (``FORMAT LineAsString``) and
#   refuses any that is not strict JSON (``isValidJSON``: simdjson, RFC 8259);
# * INPUT_SETTINGS refuse a boolean, number, array or object where a string is due, a boolean
#   where a number is, a null outside a tuple, and any unknown or repeated field;
# * the constraint of WINDOW_INPUT refuses a missing field, another version or type, a rank out of
#   range, a non-finite float (and a null read into a function's float, as NaN), a null read into a
#   function's integer (Nullable for that), a key repeated in ``busy``, and a string where a number
#   is due: the aggregator counts the value's quote characters (``_quotes``, added in front of the
#   value), which must be those of the strings the summary has (its keys, three per function, …);
# * ``aggregator.batch.Batch`` keeps out of this path a value that is not UTF-8 or that holds a run
#   of 19 digits (an integer that might overflow Int64), and decodes those itself.
#
# A refused insert fails as a whole: the aggregator then checks that batch record by record in
# Python, which dead-letters the bad ones with decode()'s reason and stores the rest.
WINDOW_INPUT_NAME = "window_input"
WINDOW_JSON_NAME = "window_json"
WINDOW_INPUT_OBJECTS = (
    WINDOW_INPUT_NAME,
    "windows_from_input",
    "functions_from_input",
    "arrivals_from_input",
    WINDOW_JSON_NAME,
)
"""The input tables and views (all store nothing)."""
WINDOW_INPUT_VERSION = 5
"""Version of the input objects; a store holding another has them replaced (they hold no data)."""
_INPUT_COMMENT = f"{_COMMENT}, window input {WINDOW_INPUT_VERSION}"
INPUT_SETTINGS = {
    "input_format_skip_unknown_fields": 0,
    "input_format_null_as_default": 0,
    "input_format_json_read_bools_as_numbers": 0,
    "input_format_json_read_bools_as_strings": 0,
    "input_format_json_read_numbers_as_strings": 0,
    "input_format_json_read_objects_as_strings": 0,
    "input_format_json_read_arrays_as_strings": 0,
    "input_format_json_empty_as_default": 0,
    "input_format_json_throw_on_bad_escape_sequence": 1,
    "precise_float_parsing": 1,  # the correctly rounded float, as Python's json reads it
}
"""Settings of the JSONEachRow insert into WINDOW_INPUT."""
_HEADER = [c for c in WINDOWS.columns if c[0] != "n_functions"]
_REQUIRED = [name for name, type_ in _HEADER if not type_.startswith("Map")]
_FUNCTION_ROW = [c for c in FUNCTIONS.columns if c not in _HEADER]
QUOTES_FIELD = "_quotes"
"""The field the aggregator puts in front of a window value: how many ``"`` it holds outside escapes."""


def _plain(type_: str) -> str:
    """``T`` for ``LowCardinality(T)``; any other type as it is."""
    inner = type_.removeprefix("LowCardinality(")
    return inner[:-1] if inner != type_ else type_


def _function_input_type(type_: str) -> str:
    return "Nullable(Int64)" if type_ == "Int64" else _plain(type_)


_STRINGS = 2 + len(_HEADER) + 1 + 1 + sum(_plain(t) == "String" for _, t in _HEADER)
"""Strings in a summary besides the keys of ``busy`` and the functions' strings: the keys ``v``,
``type``, those of the header and ``functions``; the values of ``type`` and the header's strings."""
_FUNCTION_STRINGS = sum(_plain(t) == "String" for _, t in _FUNCTION_ROW)
_INPUT_COLUMNS = [
    (QUOTES_FIELD, "UInt64"),
    ("v", "Nullable(Int64)"),
    ("type", "Nullable(String)"),
    # rank as Int64: range-checked by the constraint rather than wrapped around by the parser.
    *(
        (name, f"Nullable({'Int64' if name == 'rank' else _plain(t)})") if name in _REQUIRED else (name, t)
        for name, t in _HEADER
    ),
    # Left out by the hook at their defaults (see ``wire.records.encode``), as by older hooks.
    ("pid", "Int64 DEFAULT 0"),
    ("seq", "Int64 DEFAULT -1"),
    # Plain String, not LowCardinality, inside the array: building a dictionary value by value while
    # parsing 300 tuples costs ~8% of the aggregator's CPU; the view converts whole columns instead.
    # Integers Nullable: inside a tuple the parser reads null as 0 whatever the settings (and as NaN
    # for a Float64, which isFinite refuses).
    ("functions", f"Array(Tuple({', '.join(_function_input_type(t) for _, t in _FUNCTION_ROW)}))"),
]
_FUNCTION_CHECK = " AND ".join(
    f"isFinite(f.{i})" if t == "Float64" else f"isNotNull(f.{i})"
    for i, (_, t) in enumerate(_FUNCTION_ROW, 1)
    if t != "String" and not t.startswith("LowCardinality")
)
_INPUT_CHECK = " AND ".join(
    [
        # pid and seq are keys of the value where they are not at their defaults.
        f"{QUOTES_FIELD} = 2 * ({_STRINGS} + (pid != 0) + (seq != -1) + length(busy) + "
        f"{_FUNCTION_STRINGS} * length(functions))",
        "pid BETWEEN 0 AND 2147483647",  # records.INT_RANGES
        "seq >= -1",
        f"v = {WIRE_VERSION}",
        "type = 'window'",
        "rank BETWEEN 0 AND 2147483647",  # records.INT_RANGES
        "dur_us >= 0",  # records.INT_RANGES
        "arrayAll(x -> isFinite(x), mapValues(busy))",
        "length(arrayDistinct(mapKeys(busy))) = length(busy)",
        f"arrayAll(f -> {_FUNCTION_CHECK}, functions)",
    ]
    + [f"`{name}` IS NOT NULL" for name in _REQUIRED]
)


def _window_input_ddl(database: str, cluster: str = "") -> list[str]:
    """The Null input tables and the views that fill ``windows``, ``functions`` and ``arrivals``
    (on a cluster, on every node, into the ``Distributed`` tables)."""
    on = on_cluster(cluster)
    cols = ",\n    ".join(f"`{name}` {type_}" for name, type_ in _INPUT_COLUMNS)
    t = f"`{database}`.`{WINDOW_INPUT_NAME}`"

    def header(names: list[str]) -> str:
        return ", ".join(f"assumeNotNull(`{n}`) AS `{n}`" if n in _REQUIRED else f"`{n}`" for n in names)

    fn = ", ".join(
        f"assumeNotNull(f.{i}) AS `{name}`" if t == "Int64" else f"f.{i} AS `{name}`"
        for i, (name, t) in enumerate(_FUNCTION_ROW, 1)
    )
    view = "CREATE MATERIALIZED VIEW IF NOT EXISTS"
    return [
        f"CREATE TABLE IF NOT EXISTS `{database}`.`{WINDOW_JSON_NAME}`{on} (\n    json String,\n"
        f"    CONSTRAINT strict_json CHECK isValidJSON(json)\n)\nENGINE = Null\nCOMMENT '{_INPUT_COMMENT}'",
        f"CREATE TABLE IF NOT EXISTS {t}{on} (\n    {cols},\n    CONSTRAINT complete CHECK {_INPUT_CHECK}\n)\n"
        f"ENGINE = Null\nCOMMENT '{_INPUT_COMMENT}'",
        f"{view} `{database}`.`{WINDOW_INPUT_OBJECTS[1]}`{on} TO `{database}`.`windows` "
        f"AS SELECT {header([n for n, _ in _HEADER])}, toInt32(length(functions)) AS n_functions FROM {t}",
        f"{view} `{database}`.`{WINDOW_INPUT_OBJECTS[2]}`{on} TO `{database}`.`functions` "
        f"AS SELECT {header([n for n, _ in FUNCTIONS.columns if n not in dict(_FUNCTION_ROW)])}, {fn} "
        f"FROM {t} ARRAY JOIN functions AS f",
        f"{view} `{database}`.`{WINDOW_INPUT_OBJECTS[3]}`{on} TO `{database}`.`arrivals` "
        f"AS SELECT {header(['job', 'rank'])}, pid, seq, 'window' AS type, {header(['time_us'])} "
        f"FROM {t} WHERE seq >= 0",
    ]


def _drop_stale_input(client: Any, database: str, found: dict[str, str]) -> None:
    """Drop input objects of another WINDOW_INPUT_VERSION (they hold no data) so they are made anew."""
    if WINDOW_INPUT_NAME not in found or found[WINDOW_INPUT_NAME] == _INPUT_COMMENT:
        return
    log.info("replacing the window input objects of %s (found %r)", database, found[WINDOW_INPUT_NAME])
    for name in WINDOW_INPUT_OBJECTS[1:4]:
        client.command(f"DROP VIEW IF EXISTS `{database}`.`{name}`")
    for name in (WINDOW_INPUT_NAME, WINDOW_JSON_NAME):
        client.command(f"DROP TABLE IF EXISTS `{database}`.`{name}`")


def check_identifier(database: str) -> str:
    """Return ``database`` if it is a plain identifier; it is spliced into SQL, so nothing else is."""
    if not isinstance(database, str) or not _IDENTIFIER.match(database):
        raise SchemaError(f"database name {database!r} must match {_IDENTIFIER.pattern}")
    return database


def ensure_schema(client: Any, database: str = DEFAULT_DATABASE, cluster: str = "") -> None:
    """Create the database and every table if missing; harmless to call again.

    ``client`` is a clickhouse_connect client (chDB or server). Raises :class:`SchemaError` when an
    existing table carries another schema version's comment. With ``cluster``, on every node of
    that ClickHouse cluster (see :meth:`Table.ddl`); a cluster's store is made at this schema
    version, older ones are refused, not migrated.
    """
    check_identifier(database)
    # Checked before creating anything, so a refused database is left as it was found.
    found = client.query(
        "SELECT name, comment FROM system.tables WHERE database = {db:String}",
        parameters={"db": database},
    ).result_rows
    if cluster:
        _ensure_on_cluster(client, database, cluster, found)
        return
    older = {name for name, comment in found if name in TABLES and comment in MIGRATIONS}
    wrong = {
        name: comment
        for name, comment in found
        if name in TABLES and comment != _COMMENT and name not in older
    }
    if wrong:
        raise SchemaError(
            f"database {database!r} has tables from another schema version {wrong}; this code writes "
            f"{_COMMENT!r}: use another database or migrate it"
        )
    client.command(f"CREATE DATABASE IF NOT EXISTS `{database}`")
    _drop_stale_input(client, database, dict(found))
    for table in TABLES.values():
        client.command(table.ddl(database)[0])
    for name in sorted(older):
        if name in REKEYED and int(dict(found)[name].rsplit(" ", 1)[-1]) < REKEYED[name]:
            _rekey(client, database, TABLES[name])
        if name == HEARTBEATS.name and LATEST_HEARTBEATS.name in dict(found):
            # The latest heartbeats' table takes the new columns, and its view, which names the
            # columns it copies, is made anew below.
            for alter in (*_TO_10[name], *_TO_11[name], *_TO_12[name]):
                client.command(f"ALTER TABLE `{database}`.`{LATEST_HEARTBEATS.name}` {alter}")
            client.command(f"DROP VIEW IF EXISTS `{database}`.`{LATEST_HEARTBEATS_OBJECTS[1]}`")
        _migrate(client, database, name, dict(found)[name])
    for ddl in _window_input_ddl(database):
        client.command(ddl)
    for ddl_of, derived, source in (
        (_arrivals_by_process_ddl, ARRIVALS_BY_PROCESS, ARRIVALS.name),
        (_latest_heartbeats_ddl, LATEST_HEARTBEATS.name, HEARTBEATS.name),
    ):
        made = ddl_of(database)
        for ddl in made if derived not in dict(found) and source in dict(found) else made[:-1]:
            client.command(ddl)
    log.debug("schema %s ready in database %s", STORE_VERSION, database)


def cluster_ddl(database: str, cluster: str) -> list[str]:
    """Every statement that makes the store in ``database`` on every node of ``cluster``."""
    on = on_cluster(cluster)
    return [
        f"CREATE DATABASE IF NOT EXISTS `{database}`{on}",
        *(ddl for table in TABLES.values() for ddl in table.ddl(database, cluster)),
        *_window_input_ddl(database, cluster),
        *_arrivals_by_process_ddl(database, cluster)[:-1],
        *_latest_heartbeats_ddl(database, cluster)[:-1],
    ]


def _ensure_on_cluster(client: Any, database: str, cluster: str, found: list[tuple[str, str]]) -> None:
    if wrong := {name: comment for name, comment in found if name in TABLES and comment != _COMMENT}:
        raise SchemaError(
            f"database {database!r} on cluster {cluster!r} has tables from another schema version "
            f"{wrong}; this code writes {_COMMENT!r} and migrates no cluster: use another database"
        )
    for ddl in cluster_ddl(database, cluster):
        client.command(ddl)
    log.debug("schema %s ready in database %s on cluster %s", STORE_VERSION, database, cluster)


_TO_3 = {
    "ranks": ["ADD COLUMN IF NOT EXISTS `spine` LowCardinality(String) DEFAULT '' AFTER `switch`"],
    "heartbeats": [
        "ADD COLUMN IF NOT EXISTS `gpu_util` Float64 DEFAULT -1",
        "ADD COLUMN IF NOT EXISTS `gpu_mem_mb` Float64 DEFAULT -1",
    ],
}
_TO_4 = {"ranks": ["ADD COLUMN IF NOT EXISTS `coverage` String DEFAULT '' AFTER `device`"]}
_TO_5 = {"steps": ["ADD COLUMN IF NOT EXISTS `wait_us` Int64 DEFAULT 0"]}
_TO_6 = {"heartbeats": ["ADD COLUMN IF NOT EXISTS `samples` Map(String, Int64)"]}
_TO_7 = {"heartbeats": ["ADD COLUMN IF NOT EXISTS `sends` Map(String, Tuple(Int64, Int64))"]}
_TO_10 = {
    "heartbeats": [
        "ADD COLUMN IF NOT EXISTS `windows` Int64 DEFAULT 0",
        "ADD COLUMN IF NOT EXISTS `window_cost_us` Int64 DEFAULT 0",
    ]
}
"""Schema 10: what the windows cost each rank, in its heartbeats (``latest_heartbeats`` too: see
:func:`ensure_schema`)."""
_TO_11 = {
    "heartbeats": ["ADD COLUMN IF NOT EXISTS `coll_peer` Int64 DEFAULT -1 AFTER `coll_seq`"],
    "ranks": ["ADD COLUMN IF NOT EXISTS `mesh` Map(String, Int64) AFTER `coverage`"],
}
"""Schema 11: a point-to-point call's peer in heartbeats, each rank's place in the job's device mesh
(and the table ``exits``, made as any missing table is)."""
_TO_12 = {
    "exits": ["ADD COLUMN IF NOT EXISTS `gpu` Map(String, Int64) AFTER `signal`"],
    "heartbeats": ["ADD COLUMN IF NOT EXISTS `gpu_xids` Map(String, Int64)"],
}
"""Schema 12: a rank's GPU faults since attach in its exit record, its XIDs in its heartbeats
(``latest_heartbeats`` too)."""

_TO_13 = {"steps": ["ADD COLUMN IF NOT EXISTS `gc_us` Int64 DEFAULT 0"]}
"""Schema 13: the garbage collector's pauses in the steps."""


def _then(*steps: dict[str, list[str]]) -> dict[str, list[str]]:
    """Migration steps applied one after another, per table."""
    out: dict[str, list[str]] = {}
    for step in steps:
        for table, alters in step.items():
            out[table] = out.get(table, []) + alters
    return out


_STEPS_TO = {
    2: {"steps": ["ADD COLUMN IF NOT EXISTS `n_steps` Int64 DEFAULT 1"]},
    3: _TO_3,
    4: _TO_4,
    5: _TO_5,
    6: _TO_6,
    7: _TO_7,
    # schema 8 added a table, ``arrivals``; schema 9 changed the sort key of ``functions`` (REKEYED)
    10: _TO_10,
    11: _TO_11,
    12: _TO_12,
    13: _TO_13,
}
"""The ALTERs that bring a table of the schema before to each schema, by table."""

MIGRATIONS: dict[str, dict[str, list[str]]] = {
    f"rankscope schema {v}": _then(*(alters for to, alters in _STEPS_TO.items() if to > v))
    for v in range(1, STORE_VERSION)
}
"""For each older schema's comment, the ALTERs that bring its tables (by name) to this version."""


REKEYED = {"functions": 9}
"""Tables whose sort key changed, with the schema that changed it: a table of an older schema is
copied (an ALTER cannot change a sort key)."""


def _rekey(client: Any, database: str, table: Table) -> None:
    """Copy ``table``'s rows into a table of its current sort key, which then takes its place.

    Safe to run again if interrupted: until the exchange, ``table`` is the old one, whole."""
    t, new = f"`{database}`.`{table.name}`", f"`{database}`.`{table.name}_rekeyed`"
    client.command(table.ddl(database)[0].replace(t, new, 1))
    client.command(f"TRUNCATE TABLE {new}")  # rows of an interrupted copy
    names = ", ".join(f"`{c}`" for c in table.column_names)
    client.command(f"INSERT INTO {new} ({names}) SELECT {names} FROM {t}")
    # The view that fills it follows the table it was made for: made anew after (see ensure_schema).
    client.command(f"DROP VIEW IF EXISTS `{database}`.`{WINDOW_INPUT_OBJECTS[2]}`")
    client.command(f"EXCHANGE TABLES {t} AND {new}")
    client.command(f"DROP TABLE {new}")
    log.info("table %s.%s copied to its new sort key %s", database, table.name, table.order_by)


def _migrate(client: Any, database: str, name: str, comment: str) -> None:
    """Bring table ``name`` from the schema of ``comment`` to this one (each step is idempotent)."""
    for alter in MIGRATIONS[comment].get(name, []):
        client.command(f"ALTER TABLE `{database}`.`{name}` {alter}")
    client.command(f"ALTER TABLE `{database}`.`{name}` MODIFY COMMENT '{_COMMENT}'")
    log.info("table %s.%s migrated from %r to %r", database, name, comment, _COMMENT)
