"""The store: decoded records in, pandas frames out, over one clickhouse_connect client.

This module opens it and writes; its read side is :class:`aggregator.reads.Reads`, and what it
writes comes checked in a :class:`aggregator.batch.Batch`.

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

Wire values are held to the rules of ``wire.records.decode`` (a JSON integer where an
integer is due, within range, finite floats, valid Unicode…): each is stored exactly as sent or
kept as a dead letter with the reason, never changed. Every row is also checked against its column
type before anything is inserted (see :class:`~aggregator.batch.Batch`): clickhouse_connect would otherwise coerce
``"7"`` into an Int64 silently, or fail the whole insert on one out-of-range integer.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import clickhouse_connect
import pandas as pd
from clickhouse_connect.driver.exceptions import ClickHouseError

from rankscope.wire.errors import StoreError
from rankscope.wire.records import (
    Record,
    RecordError,
)

from .batch import _QUOTES, Batch, _now_us
from .embedded import fd2_captured, open_problem, path_problem
from .reads import Reads, SpoolOffset
from .schema import (
    DEFAULT_DATABASE,
    INPUT_SETTINGS,
    SPOOL_OFFSETS,
    TABLES,
    WINDOW_INPUT_NAME,
    WINDOW_JSON_NAME,
    Table,
    check_identifier,
    ensure_schema,
)

log = logging.getLogger(__name__)


_STORAGE_FAILURES = ("NOT_ENOUGH_SPACE", "No space left on device", "Read-only file system")
"""In a refused insert's message: the store cannot write, whatever the values."""


class Store(Reads):
    """Records and dead letters in ClickHouse tables; reads return pandas DataFrames.

    Queries read with ``FINAL`` (or in a way duplicates cannot change), so rows ingested twice count
    once. Job values travel as bound parameters, never spliced into SQL.
    """

    def __init__(
        self,
        client: Any,
        database: str = DEFAULT_DATABASE,
        reopen: Callable[[], Store] | None = None,
        cluster: str = "",
    ) -> None:
        """Wrap an open clickhouse_connect ``client`` and create the schema if missing; ``reopen``
        opens another Store on the same database (a second connection), where one can be made.
        ``cluster``: the ClickHouse cluster the store spans (see ``schema.Table.ddl``)."""
        self._client = client
        self._db = check_identifier(database)
        self._last_commit_us = 0
        self._closed = False
        self.reopen = reopen
        self.cluster = cluster
        ensure_schema(client, database, cluster)

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
        return cls._owning(client, database, functools.partial(cls.embedded, abspath, database))

    @classmethod
    def server(
        cls,
        host: str = "localhost",
        port: int | None = None,
        username: str = "default",
        password: str = "",
        database: str = DEFAULT_DATABASE,
        secure: bool = False,
        cluster: str = "",
    ) -> Store:
        """Connect to a ClickHouse server over HTTP(S); ``port`` defaults to 8123, or 8443 if
        ``secure``. ``cluster``: a server of that ClickHouse cluster, over which the store is
        sharded by job (``schema.Table.ddl``); an insert returns once the shards hold its rows."""
        try:
            # The database may not exist yet, so the client is not bound to it; tables are qualified.
            client = clickhouse_connect.get_client(
                host=host,
                port=port,
                username=username,
                password=password,
                secure=secure,
                settings={"insert_distributed_sync": 1} if cluster else None,
            )
        except ClickHouseError as exc:
            raise StoreError(f"cannot connect to ClickHouse at {host}:{port} as {username!r}: {exc}") from exc
        reopen = functools.partial(cls.server, host, port, username, password, database, secure, cluster)
        return cls._owning(client, database, reopen, cluster)

    @classmethod
    def _owning(cls, client: Any, database: str, reopen: Callable[[], Store], cluster: str = "") -> Store:
        try:
            return cls(client, database, reopen, cluster)
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
            for ddl in table.ddl(self._db, self.cluster):
                self._client.command(ddl)
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

    # --- helpers --------------------------------------------------------------------------------
