"""The store: decoded records in, pandas frames out, over one clickhouse_connect client.

Two ways to open it, same SQL behind both:

* :meth:`Store.embedded` — chDB inside this process (the default deployment). chDB hosts one engine
  per process: any number of Stores may be open on the same directory, but a second directory can
  only be opened once every Store on the first is closed, and no other process may open a directory
  while this one holds it. So the aggregator, the diagnosis and the API share one process (and
  ideally one Store); training ranks never open the store.
* :meth:`Store.server` — a ClickHouse server (23.x+).

Example::

    with Store.embedded("/var/lib/rankscope/db") as store:
        store.write(records)
        steps = store.steps("llama-7b-run3", since_step=100)

Wire values are held to the rules of ``profiler_hook.records.decode`` (a JSON integer where an
integer is due, within range, finite floats, valid Unicode…): each is stored exactly as sent or
kept as a dead letter with the reason, never changed. Every row is also checked against its column
type before anything is inserted (see :class:`Batch`): clickhouse_connect would otherwise coerce
``"7"`` into an Int64 silently, or fail the whole insert on one out-of-range integer.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import clickhouse_connect
import pandas as pd
from clickhouse_connect.driver.exceptions import ClickHouseError

from diagnosis.data import JobData
from profiler_hook.records import (
    FUNCTION_COLUMNS,
    MAX_VALUE_BYTES,
    STEP_COLUMNS,
    WIRE_VERSION,
    Heartbeat,
    RankInfo,
    Record,
    RecordError,
    StepBatch,
    WindowSummary,
    decode,
)
from profiler_hook.records import check as check_record

from .embedded import fd2_captured, open_problem, path_problem
from .errors import RankscopeError
from .schema import (
    DEAD_LETTERS,
    DEFAULT_DATABASE,
    FUNCTIONS,
    HEARTBEATS,
    INPUT_SETTINGS,
    JOB_TABLES,
    QUOTES_FIELD,
    RANKS,
    SPOOL_OFFSETS,
    STEPS,
    TABLES,
    WINDOW_INPUT_NAME,
    WINDOW_JSON_NAME,
    WINDOWS,
    Table,
    check_identifier,
    ensure_schema,
)

log = logging.getLogger(__name__)


class StoreError(RankscopeError, RuntimeError):
    """The store could not be opened, written or read; the message says which and why."""


class SpoolOffset(NamedTuple):
    """How far one spool file has been ingested (see ``aggregator.schema.SPOOL_OFFSETS``)."""

    path: str
    """The file's path relative to its spool root when the offset was committed (for people)."""
    offset: int
    """Bytes ingested."""
    in_line: bool = False
    """The offset lies inside an oversized line already dead-lettered: skip to its newline."""


# --- checking values against column types -------------------------------------------------------


def _int_check(lo: int, hi: int) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if type(v) is not int:  # bool is an int subclass, and JSON true is not a count
            raise ValueError("must be an integer")
        if not lo <= v < hi:
            raise ValueError(f"is outside [{lo}, {hi})")
        return v

    return check


def _float(v: Any) -> float:
    if type(v) is int:
        try:
            v = float(v)
        except OverflowError:
            raise ValueError("is too large for Float64") from None
    elif type(v) is not float:
        raise ValueError("must be a number")
    if not math.isfinite(v):
        raise ValueError("must be finite")
    return v  # type: ignore[no-any-return]


def _str(v: Any) -> str:
    if type(v) is not str:
        raise ValueError("must be a string")
    if not v.isascii():
        try:
            v.encode()
        except UnicodeEncodeError:  # a lone surrogate from a JSON "\ud800" escape
            raise ValueError("is not valid Unicode") from None
    return v


def _map_check(value_check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if type(v) is not dict:
            raise ValueError("must be an object")
        return {_str(k): value_check(x) for k, x in v.items()}

    return check


_Int64 = _int_check(-(1 << 63), 1 << 63)
_CHECKS: dict[str, Callable[[Any], Any]] = {
    "UInt8": _int_check(0, 1 << 8),
    "Int32": _int_check(-(1 << 31), 1 << 31),
    "Int64": _Int64,
    "UInt64": _int_check(0, 1 << 64),
    "Float64": _float,
    "String": _str,
    "LowCardinality(String)": _str,
    "Map(String, Int64)": _map_check(_Int64),
    "Map(String, Float64)": _map_check(_float),
}
_TABLE_CHECKS = {
    t.name: tuple(zip(t.column_names, (_CHECKS[type_] for type_ in t.column_types), strict=True))
    for t in TABLES.values()
}


def _checked(table: Table, values: tuple[Any, ...]) -> tuple[Any, ...]:
    out = []
    for (name, check), v in zip(_TABLE_CHECKS[table.name], values, strict=True):
        try:
            out.append(check(v))
        except ValueError as exc:
            raise RecordError(f"{table.name}.{name} {exc}, got {v!r:.80}") from None
    return tuple(out)


# Step and function rows are spliced onto their record's columns by position, so a reordered
# NamedTuple would silently fill the wrong columns: refuse to import instead.
_FUNCTION_PREFIX = ("job", "rank", "host", "window", "step_lo", "step_hi", "time_us")
for _table, _columns in (
    (STEPS, ("job", "rank", "host", *STEP_COLUMNS)),
    (FUNCTIONS, (*_FUNCTION_PREFIX, *FUNCTION_COLUMNS)),
):
    if _table.column_names != _columns:
        raise ImportError(f"aggregator.schema table {_table.name} is out of step with profiler_hook.records")


def _attrs(record: Record, table: Table) -> tuple[Any, ...]:
    return tuple(getattr(record, c) for c in table.column_names)


def _record_rows(record: Record) -> list[tuple[Table, tuple[Any, ...]]]:
    """The checked rows one record becomes; raises RecordError naming the first bad value."""
    if isinstance(record, StepBatch):
        head = (record.job, record.rank, record.host)
        return [(STEPS, _checked(STEPS, head + tuple(row))) for row in record.rows]
    if isinstance(record, Heartbeat):
        return [(HEARTBEATS, _checked(HEARTBEATS, _attrs(record, HEARTBEATS)))]
    if isinstance(record, RankInfo):
        return [(RANKS, _checked(RANKS, _attrs(record, RANKS)))]
    if isinstance(record, WindowSummary):
        window = tuple(
            len(record.functions) if c == "n_functions" else getattr(record, c) for c in WINDOWS.column_names
        )
        rows = [(WINDOWS, _checked(WINDOWS, window))]
        head = tuple(getattr(record, c) for c in _FUNCTION_PREFIX)
        rows += [(FUNCTIONS, _checked(FUNCTIONS, head + tuple(f))) for f in record.functions]
        return rows
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


_STORAGE_FAILURES = ("NOT_ENOUGH_SPACE", "No space left on device", "Read-only file system")
"""In a refused insert's message: the store cannot write, whatever the values."""


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
        of ``profiler_hook.records.decode`` or does not fit its column."""
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
        self.rows.setdefault(DEAD_LETTERS.name, []).append(_checked(DEAD_LETTERS, row))
        self.dead_letters += 1


class Store:
    """Records and dead letters in ClickHouse tables; reads return pandas DataFrames.

    Queries read with ``FINAL`` (or in a way duplicates cannot change), so rows ingested twice count
    once. Job values travel as bound parameters, never spliced into SQL.
    """

    def __init__(self, client: Any, database: str = DEFAULT_DATABASE) -> None:
        """Wrap an open clickhouse_connect ``client`` and create the schema if missing."""
        self._client = client
        self._db = check_identifier(database)
        self._last_commit_us = 0
        self._closed = False
        self.reopen: Callable[[], Store] | None = None
        """Opens another Store on the same database (a second connection), where known."""
        ensure_schema(client, database)

    @classmethod
    def embedded(
        cls, path: str | os.PathLike[str], database: str = DEFAULT_DATABASE, create: bool = True
    ) -> Store:
        """Open (or, with ``create``, create) a chDB store in directory ``path``, inside this process.

        Stores on the same path share chDB's one engine per process; opening a different path
        while one is open, or a path another process holds, raises :class:`StoreError`. So does a
        path that is not a directory, a directory that holds files but no chDB store, and without
        ``create`` a path that holds no rankscope store (no ``database``): nothing is made there.
        """
        abspath = os.path.abspath(os.fspath(path))
        check_identifier(database)  # before chDB makes the directory
        problem = path_problem(abspath, create)
        if problem:
            raise StoreError(problem)
        printed: list[bytes] = []
        try:
            with fd2_captured(printed):
                client = clickhouse_connect.get_client(interface="chdb", path=abspath)
        except ClickHouseError as exc:
            raise StoreError(open_problem(abspath, exc, b"".join(printed))) from exc
        if not create:
            try:
                found = client.query(
                    "SELECT count() FROM system.databases WHERE name = {db:String}",
                    parameters={"db": database},
                ).result_rows[0][0]
            except BaseException:
                client.close()
                raise
            if not found:
                client.close()
                raise StoreError(f"{abspath} is not a rankscope store (it has no database {database!r})")
        store = cls._owning(client, database)
        store.reopen = lambda: cls.embedded(abspath, database)
        return store

    @classmethod
    def server(
        cls,
        host: str = "localhost",
        port: int | None = None,
        username: str = "default",
        password: str = "",
        database: str = DEFAULT_DATABASE,
        secure: bool = False,
    ) -> Store:
        """Connect to a ClickHouse server over HTTP(S); ``port`` defaults to 8123, or 8443 if ``secure``."""
        try:
            # The database may not exist yet, so the client is not bound to it; tables are qualified.
            client = clickhouse_connect.get_client(
                host=host, port=port, username=username, password=password, secure=secure
            )
        except ClickHouseError as exc:
            raise StoreError(f"cannot connect to ClickHouse at {host}:{port} as {username!r}: {exc}") from exc
        store = cls._owning(client, database)
        store.reopen = lambda: cls.server(host, port, username, password, database, secure)
        return store

    @classmethod
    def _owning(cls, client: Any, database: str) -> Store:
        try:
            return cls(client, database)
        except BaseException:
            # A chDB client left open would keep its engine, and refuse every other path, for good.
            client.close()
            raise

    @property
    def client(self) -> Any:
        """The clickhouse_connect client, for queries this class does not offer."""
        return self._client

    @property
    def database(self) -> str:
        """The database holding the tables; qualify table names with it."""
        return self._db

    def close(self) -> None:
        """Release the client (for chDB, the engine once no other Store uses it). Idempotent."""
        if not self._closed:
            self._closed = True
            self._client.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- write side -----------------------------------------------------------------------------

    def write(self, records: Iterable[Record]) -> int:
        """Insert records, one insert per table; returns how many were written.

        Raises RecordError (writing nothing) if a record holds a value its column cannot take.
        """
        batch = Batch()
        for record in records:
            try:
                batch.add(record)
            except RecordError as exc:
                raise RecordError(f"record {record.key!r} of type {record.TYPE!r}: {exc}") from None
        return self.write_batch(batch)

    def write_batch(self, batch: Batch) -> int:
        """Insert everything in ``batch``, one insert per table; returns the records written.

        Not atomic across tables: on failure some tables may hold the batch already, which is
        harmless because a retry replaces those rows (ReplacingMergeTree + FINAL). When ClickHouse
        refuses the batch's window values while the database answers, a value is malformed: the
        batch falls back to :meth:`Batch.check_windows`, which dead-letters the bad ones.
        """
        if batch.window_values:
            try:
                self._insert_windows(batch.window_values)
            except StoreError as exc:
                if not self._answers() or any(e in str(exc) for e in _STORAGE_FAILURES):
                    raise  # not the values' fault: checking them one by one would fail the same way
                log.warning("ClickHouse refused window summaries (%s); checking them one by one", exc)
                batch.check_windows()
        for name, rows in batch.rows.items():
            self._insert(TABLES[name], rows)
        return batch.records

    def dead_letter(self, source: str, position: str | int, key: bytes, raw: bytes, reason: str) -> None:
        """Store one value that could not be ingested (see :meth:`Batch.dead_letter` for many)."""
        batch = Batch()
        batch.dead_letter(source, position, key, raw, reason)
        self.write_batch(batch)

    def set_offsets(self, offsets: Mapping[str, SpoolOffset]) -> None:
        """Record how far each spool file (by ``aggregator.spool.file_id``) has been ingested."""
        if not offsets:
            return
        # The version column must grow with every commit, even two in the same microsecond, so
        # that the latest commit wins even when it moves an offset backwards.
        now = max(_now_us(), self._last_commit_us + 1)
        self._last_commit_us = now
        rows = [(f, o.path, o.offset, int(o.in_line), now) for f, o in offsets.items()]
        self._insert(SPOOL_OFFSETS, rows)

    def _insert_windows(self, values: list[tuple[str, str | int, bytes, bytes, int]]) -> None:
        """Have ClickHouse check the window values as strict JSON, then parse and store them."""
        # Parallel parsing costs ~25% more CPU for these ~40 KB rows and gains no time here.
        settings: dict[str, Any] = {"input_format_parallel_parsing": 0}
        try:
            self._client.raw_insert(
                f"{self._db}.{WINDOW_JSON_NAME}",
                insert_block=b"\n".join(v[3] for v in values),
                settings=settings,
                # One value per line (a value with a raw newline fails the check: Python decodes it).
                fmt="LineAsString",
            )
            self._client.raw_insert(
                f"{self._db}.{WINDOW_INPUT_NAME}",
                insert_block=b"\n".join(b'{"%s":%d,%s' % (_QUOTES, q, v[1:]) for *_, v, q in values),
                # Collapsing replaced rows within the block at insert (optimize_on_insert) costs
                # ~13% of the CPU per summary; every read is FINAL, which collapses them anyway.
                settings={**settings, **INPUT_SETTINGS, "optimize_on_insert": 0},
                fmt="JSONEachRow",
            )
        except ClickHouseError as exc:
            raise StoreError(f"insert of {len(values)} window summaries failed: {exc}") from exc

    def create(self, table: Table) -> None:
        """Create ``table`` (a :class:`~aggregator.schema.Table` another layer owns) if missing."""
        try:
            self._client.command(table.ddl(self._db))
        except ClickHouseError as exc:
            raise StoreError(f"cannot create {self._db}.{table.name}: {exc}") from exc

    def insert(self, table: Table, rows: list[tuple[Any, ...]]) -> None:
        """Insert ``rows`` (tuples in ``table``'s column order) into ``table``."""
        self._insert(table, rows)

    def select(self, table: Table, where: str = "", params: dict[str, Any] | None = None) -> pd.DataFrame:
        """``SELECT * FROM table FINAL [WHERE where]``; values only as bound ``params``."""
        sql = f"SELECT * FROM {self._t(table)} FINAL" + (f" WHERE {where}" if where else "")
        return self._frame(sql, params or {}, table.column_names)

    def _answers(self) -> bool:
        """Whether the database answers a trivial query (tells bad data from a database that is down)."""
        try:
            self._client.command("SELECT 1")
            return True
        except ClickHouseError:
            return False

    def _insert(self, table: Table, rows: list[tuple[Any, ...]]) -> None:
        if not rows:
            return
        try:
            self._client.insert(
                table.name,
                rows,
                column_names=list(table.column_names),
                column_type_names=list(table.column_types),  # saves a DESCRIBE per insert
                database=self._db,
            )
        except (ClickHouseError, ValueError, TypeError) as exc:
            raise StoreError(
                f"insert of {len(rows)} rows into {self._db}.{table.name} failed: {exc}"
            ) from exc

    # --- read side ------------------------------------------------------------------------------

    def offset(self, file: str) -> SpoolOffset:
        """How far the spool file ``file`` (its ``aggregator.spool.file_id``) has been ingested."""
        return self.offsets(file).get(file, SpoolOffset("", 0))

    def offsets(self, file: str | None = None) -> dict[str, SpoolOffset]:
        """Every spool file's ingested offset (only ``file``'s if given), in one query."""
        where, params = ("WHERE file = {file:String}", {"file": file}) if file is not None else ("", {})
        sql = f"SELECT file, path, `offset`, in_line FROM {self._t(SPOOL_OFFSETS)} FINAL {where}"
        rows = self._query(sql, params).result_rows
        return {f: SpoolOffset(path, int(offset), bool(in_line)) for f, path, offset, in_line in rows}

    def jobs(self) -> pd.DataFrame:
        """One row per job: ``job, ranks, world_size, first_us, last_us`` (latest job first)."""
        # min/max/uniqExact do not change with duplicate rows, so no FINAL (which costs a merge).
        sql = f"""
            SELECT job, uniqExact(rank) AS ranks, max(world_size) AS world_size,
                   min(t0) AS first_us, max(t1) AS last_us
            FROM (
                SELECT job, rank, world_size, time_us AS t0, time_us AS t1 FROM {self._t(RANKS)}
                UNION ALL
                SELECT job, rank, 0, start_us, start_us + dur_us FROM {self._t(STEPS)}
                UNION ALL
                SELECT job, rank, 0, time_us, time_us FROM {self._t(HEARTBEATS)}
                UNION ALL
                SELECT job, rank, 0, time_us, time_us FROM {self._t(WINDOWS)}
            )
            GROUP BY job ORDER BY last_us DESC, job"""
        return self._frame(sql, {}, ("job", "ranks", "world_size", "first_us", "last_us"))

    def step_rates(self, last_s: float = 60.0) -> pd.DataFrame:
        """One row per job: ``job, step, steps_per_s`` over its last ``last_s`` seconds of steps."""
        sql = f"""
            SELECT s.job AS job, max(s.step + s.n_steps - 1) AS step,
                   (max(s.step + s.n_steps) - min(s.step))
                       / greatest((max(s.start_us + s.dur_us) - min(s.start_us)) / 1e6, 1e-3) AS steps_per_s
            FROM {self._t(STEPS)} AS s
            INNER JOIN (SELECT job, max(start_us) AS t FROM {self._t(STEPS)} GROUP BY job) AS l
                ON s.job = l.job
            WHERE s.start_us >= l.t - {{span:Int64}}
            GROUP BY s.job"""
        return self._frame(sql, {"span": int(last_s * 1e6)}, ("job", "step", "steps_per_s"))

    def ranks(self, job: str) -> pd.DataFrame:
        """The ``rank`` records of ``job``, one row per rank (its latest start)."""
        return self._select(RANKS, job, "", {}, "rank")

    def steps(self, job: str, since_step: int | None = None) -> pd.DataFrame:
        """One row per step of ``job`` (only steps ``>= since_step`` if given), ordered by rank and
        step: the stored rows of ``n_steps`` steps each read back as that many steps with the row's
        mean values (durations and counts as floats)."""
        if since_step is None:
            return self._steps(job, "", {})
        return self._steps(job, "AND step + n_steps > {since:Int64}", {"since": since_step}, since_step)

    def windows(self, job: str) -> pd.DataFrame:
        """Window summaries of ``job`` (without functions), ordered by window and rank."""
        return self._select(WINDOWS, job, "", {}, "window, rank")

    def functions(self, job: str, windows: list[int] | None = None) -> pd.DataFrame:
        """Function patterns of ``job``, of the given windows only if ``windows`` is not None."""
        order = "window, rank, kind, name, stack"
        if windows is None:
            return self._select(FUNCTIONS, job, "", {}, order)
        where = "AND window IN {windows:Array(Int64)}"
        return self._select(FUNCTIONS, job, where, {"windows": list(windows)}, order)

    def heartbeats_latest(self, job: str) -> pd.DataFrame:
        """The latest heartbeat of each rank of ``job``, ordered by rank."""
        # Duplicate heartbeats are identical rows, so LIMIT 1 BY needs no FINAL.
        sql = (
            f"SELECT * FROM {self._t(HEARTBEATS)} WHERE job = {{job:String}} "
            "ORDER BY rank, time_us DESC LIMIT 1 BY rank"
        )
        return self._frame(sql, {"job": job}, HEARTBEATS.column_names)

    def job_data(self, job: str, since_us: int | None = None) -> JobData:
        """Everything the diagnosis reads about ``job``, as one :class:`diagnosis.JobData`.

        With ``since_us``, only the steps that started and the windows taken from then on (the
        ranks and each rank's latest heartbeat whenever they came): what a running job's
        diagnosis needs, in time that does not grow with the job's age.
        """
        if since_us is None:
            steps, functions = self.steps(job), self.functions(job)
        else:
            steps = self._steps(job, "AND start_us + dur_us > {since:Int64}", {"since": since_us})
            where = (
                f"AND window IN (SELECT window FROM {self._t(WINDOWS)} "
                "WHERE job = {job:String} AND time_us >= {since:Int64})"
            )
            functions = self._select(
                FUNCTIONS, job, where, {"since": since_us}, "window, rank, kind, name, stack"
            )
        return JobData(
            job=job,
            ranks=self.ranks(job),
            steps=steps,
            functions=functions,
            heartbeats=self.heartbeats_latest(job),
        )

    def dead_letters(self, limit: int = 1000) -> pd.DataFrame:
        """Up to ``limit`` dead letters, ordered by source and position (raw values can be 1 MB each)."""
        # Positions are strings (a byte offset, a Kafka offset…): shorter first sorts numbers numerically.
        sql = (
            f"SELECT * FROM {self._t(DEAD_LETTERS)} FINAL "
            "ORDER BY source, length(position), position LIMIT {limit:UInt64}"
        )
        return self._frame(sql, {"limit": limit}, DEAD_LETTERS.column_names)

    def counts(self, job: str) -> dict[str, int]:
        """Rows per table for ``job`` (after FINAL), e.g. ``{"steps": 1200, "ranks": 8, ...}``."""
        sql = " UNION ALL ".join(
            f"SELECT '{name}', count() FROM {self._t(TABLES[name])} FINAL WHERE job = {{job:String}}"
            for name in JOB_TABLES
        )
        counts = dict.fromkeys(JOB_TABLES, 0)
        counts.update({name: int(n) for name, n in self._query(sql, {"job": job}).result_rows})
        return counts

    # --- helpers --------------------------------------------------------------------------------

    def _t(self, table: Table) -> str:
        return f"`{self._db}`.`{table.name}`"

    def _steps(
        self, job: str, where: str, params: dict[str, Any], since_step: int = -(1 << 63)
    ) -> pd.DataFrame:
        """The step rows that match ``where``, one row per step (see :meth:`steps`)."""
        # A rank restarted from a checkpoint may have rows of other lengths over the same steps: the
        # later run (larger start) counts, as ReplacingMergeTree keeps it for rows of one step.
        sql = f"""
            SELECT job, rank, host, s + i AS step, t + intDiv(d * i, n) AS start_us, d / n AS dur_us,
                   da / n AS data_us, c / n AS comm_us, nc / n AS n_coll, fc AS first_coll_us,
                   cpu / n AS cpu_us, cs / n AS nivcsw
            FROM (
                SELECT job, rank, host, step AS s, start_us AS t, dur_us AS d, data_us AS da,
                       comm_us AS c, n_coll AS nc, first_coll_us AS fc, cpu_us AS cpu, nivcsw AS cs,
                       n_steps AS n
                FROM {self._t(STEPS)} FINAL WHERE job = {{job:String}} {where}
            )
            ARRAY JOIN range(toUInt64(n)) AS i
            WHERE s + i >= {{since_step:Int64}}
            ORDER BY rank, step, start_us DESC LIMIT 1 BY rank, step"""
        columns = [c for c in STEPS.column_names if c != "n_steps"]
        return self._frame(sql, {"job": job, "since_step": since_step, **params}, columns)

    def _select(self, table: Table, job: str, where: str, params: dict[str, Any], order: str) -> pd.DataFrame:
        sql = f"SELECT * FROM {self._t(table)} FINAL WHERE job = {{job:String}} {where} ORDER BY {order}"
        return self._frame(sql, {"job": job, **params}, table.column_names)

    def _query(self, sql: str, params: dict[str, Any] | None = None) -> Any:
        try:
            return self._client.query(sql, parameters=params or {})
        except ClickHouseError as exc:
            raise StoreError(f"query on {self._db} failed: {exc}") from exc

    def _frame(self, sql: str, params: dict[str, Any], columns: Iterable[str]) -> pd.DataFrame:
        try:
            df = self._client.query_df(sql, parameters=params)
        except ClickHouseError as exc:
            raise StoreError(f"query on {self._db} failed: {exc}") from exc
        if df.columns.empty:
            # An empty result comes back from chDB with no columns at all; callers index by name.
            return pd.DataFrame(columns=list(columns))
        return df
