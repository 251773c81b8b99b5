"""The read model: a store's tables as pandas frames, for the diagnosis, the CLI and the API.

:class:`Reads` is the read side of :class:`aggregator.Store` (which adds the connection and the
write side). Queries read with ``FINAL`` (or in a way duplicates cannot change), so rows ingested
twice count once; job values travel as bound parameters, never spliced into SQL.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
from clickhouse_connect.driver.exceptions import ClickHouseError

from rankscope.wire.errors import StoreError

from .schema import (
    ARRIVALS_BY_PROCESS_TABLE,
    ATTEMPTS,
    CHECKPOINTS,
    DEAD_LETTERS,
    EXITS,
    FUNCTIONS,
    HEARTBEATS,
    JOB_TABLES,
    LATEST_HEARTBEATS,
    RANKS,
    SPOOL_OFFSETS,
    STEPS,
    TABLES,
    WINDOWS,
    Table,
)

log = logging.getLogger(__name__)


STEP_COLUMNS = [c for c in STEPS.column_names if c not in ("job", "host", "n_steps")]
"""The columns of :meth:`Reads.steps`."""
_TOTALS = ("dur_us", "data_us", "comm_us", "n_coll", "cpu_us", "nivcsw", "wait_us", "gc_us")
"""A stored row's sums over its ``n_steps`` steps (``first_coll_us`` is its mean already)."""
_ALWAYS = ("rank", "step", "start_us")
"""The columns :meth:`Reads.steps` reads whatever it is asked: where and when a row is."""
WIDTH = "width"
"""The column of :meth:`Reads.steps` read by buckets of steps: how many (the diagnosis's name for
it is ``diagnosis.grid.WIDTH``)."""


class SpoolOffset(NamedTuple):
    """How far one spool file has been ingested (see ``aggregator.schema.SPOOL_OFFSETS``)."""

    path: str
    """The file's path relative to its spool root when the offset was committed (for people)."""
    offset: int
    """Bytes ingested."""
    in_line: bool = False
    """The offset lies inside an oversized line already dead-lettered: skip to its newline."""


class Reads:
    """The read side of a store: needs ``_client`` and ``_db`` (set by :class:`aggregator.Store`)."""

    _client: Any
    _db: str

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
        """The ``rank`` records of ``job``, one row per rank (its latest start). ``mesh`` is read
        apart, of the ranks that have one: a map column would take the rows off the Arrow path
        (at 100,000 ranks several times slower), and most jobs have no mesh."""
        names = [c for c in RANKS.column_names if c != "mesh"]
        ranks = self._select(RANKS, job, "", {}, "rank", columns=names)
        meshes = self._select(RANKS, job, "AND notEmpty(mesh)", {}, "rank", columns=["rank", "mesh"])
        by_rank = dict(zip(meshes["rank"].astype(int), meshes["mesh"], strict=True))
        return ranks.assign(
            mesh=[by_rank.get(int(r), {}) for r in ranks["rank"]] if by_rank else [{}] * len(ranks)
        )

    def steps(
        self,
        job: str,
        since_step: int | None = None,
        since_us: int | None = None,
        rank: int | None = None,
        after_us: Sequence[int] | None = None,
        width: int = 1,
        columns: Sequence[str] | None = None,
    ) -> pd.DataFrame:
        """One row per step of ``job`` (only steps ``>= since_step``, those of rows that ended
        after ``since_us``, and those of ``rank``, if given), ordered by rank and step: the stored
        rows of ``n_steps`` steps each read back as that many steps with the row's mean values
        (durations and counts as floats). Without the ``job`` and ``host`` columns: strings
        cost more to read than all the numbers (``ranks`` has each rank's host).

        ``width`` > 1: one row per rank and bucket of that many steps (``step`` a multiple of it),
        with the means per step of the stored rows that begin in it, summed up by ClickHouse, and
        a column ``width`` (``diagnosis.grid.WIDTH``), in no order (the diagnosis places
        each by rank and step; ClickHouse sorts them slower than it sums them up): what the
        diagnosis of a job too large to hold step by step reads. A rank's rows of two attempts
        over the same steps (a restart from a checkpoint) both count in their bucket's means.

        ``after_us[r]``: of rank ``r`` only the rows that start after it (all rows of the ranks
        past the list's end): given the start of the last step a reader holds of each rank, what
        the store gained since, as a rank's rows follow one another in time (a restarted rank's
        too). Integers throughout: a block's last step, read back, ends a fraction of a
        microsecond off its row's end, but starts at or after the row's start.

        ``columns``: only these of ``STEP_COLUMNS`` (``rank``, ``step`` and ``start_us`` always),
        each one fewer for ClickHouse to sum up in every bucket and to hand over."""
        keep = [c for c in STEP_COLUMNS if columns is None or c in columns or c in _ALWAYS]
        where, params = "", dict[str, Any]()
        if rank is not None:
            where, params = "AND rank = {rank:Int32}", {"rank": rank}
        if after_us is not None:
            # Past the array's end arrayElement gives 0: every row (ends are epoch microseconds).
            where = f"{where} AND start_us > arrayElement({{after_us:Array(Int64)}}, rank + 1)"
            params["after_us"] = [int(x) for x in after_us]
        if since_step is not None:
            where, params = (
                f"{where} AND step + n_steps > {{since_step:Int64}}",
                {**params, "since_step": since_step},
            )
        if since_us is not None:
            where, params = (
                f"{where} AND start_us + dur_us > {{since_us:Int64}}",
                {**params, "since_us": since_us},
            )
        if width > 1:
            return self._buckets(job, where, params, width, keep)
        return self._steps(job, where, params, since_step if since_step is not None else -(1 << 63), keep)

    def last_step(self, job: str) -> int | None:
        """The last step any rank of ``job`` stored (None: none yet)."""
        # max() does not change with duplicate rows: no FINAL.
        sql = f"SELECT max(step + n_steps - 1), count() FROM {self._t(STEPS)} WHERE job = {{job:String}}"
        last, n = self._query(sql, {"job": job}).result_rows[0]
        return int(last) if n else None

    def steps_per_row(self, job: str) -> float:
        """The mean steps a stored row of ``job`` holds (a hook ships a block of them every ~2 s;
        1.0 where none is stored)."""
        # A mean does not change with duplicate rows: no FINAL.
        sql = f"SELECT avg(n_steps), count() FROM {self._t(STEPS)} WHERE job = {{job:String}} AND n_steps > 0"
        mean, n = self._query(sql, {"job": job}).result_rows[0]
        return float(mean) if n else 1.0

    def attempts(self, job: str) -> pd.DataFrame:
        """Every start of every rank of ``job`` (``ATTEMPTS``), ordered by rank and time."""
        return self._select(ATTEMPTS, job, "", {}, "rank, time_us")

    def checkpoints(self, job: str) -> pd.DataFrame:
        """One row per checkpoint of ``job`` (over its ranks): ``kind, step, attempt, start_us``
        (the first rank's), ``end_us`` (the last rank's), ``dur_us`` (the longest), ``ranks``."""
        sql = f"""
            SELECT kind, step, attempt, min(start_us) AS first, max(start_us + dur_us) AS last,
                   max(dur_us) AS longest, uniqExact(rank) AS ranks
            FROM {self._t(CHECKPOINTS)} FINAL WHERE job = {{job:String}}
            GROUP BY kind, step, attempt ORDER BY first"""
        names = {
            "first": "start_us",
            "last": "end_us",
            "longest": "dur_us",
        }  # an alias may not shadow a column
        return self._frame(sql, {"job": job}, ("kind", "step", "attempt", *names, "ranks")).rename(
            columns=names
        )

    def exits(self, job: str) -> pd.DataFrame:
        """One row per process of ``job`` that said how it ended (``wire.records.Exit``), by time."""
        return self._select(EXITS, job, "", {}, "time_us")

    def progress(self, job: str, rank: int) -> pd.DataFrame:
        """``time_us, step, progress_age_s`` of every heartbeat of one rank of ``job``, by time."""
        sql = (
            f"SELECT DISTINCT time_us, step, progress_age_s FROM {self._t(HEARTBEATS)} "
            "WHERE job = {job:String} AND rank = {rank:Int32} ORDER BY time_us"
        )
        return self._frame(sql, {"job": job, "rank": rank}, ("time_us", "step", "progress_age_s"))

    def windows(
        self, job: str, since_us: int | None = None, columns: Sequence[str] | None = None
    ) -> pd.DataFrame:
        """Window summaries of ``job`` (without functions; those taken from ``since_us`` on, if
        given; only ``columns``, if given), ordered by window and rank."""
        where, params = (
            ("", {}) if since_us is None else ("AND time_us >= {since_us:Int64}", {"since_us": since_us})
        )
        return self._select(WINDOWS, job, where, params, "window, rank", columns)

    def functions(
        self,
        job: str,
        windows: list[int] | None = None,
        since_us: int | None = None,
        from_window: Sequence[int] | None = None,
        ranks: Sequence[int] | None = None,
        patterns: Sequence[tuple[str, str]] | None = None,
        columns: Sequence[str] | None = None,
    ) -> pd.DataFrame:
        """Function patterns of ``job``: of the given ``windows`` only if not None, of the windows
        taken from ``since_us`` on if given, of rank ``r``'s windows numbered ``from_window[r]``
        or later if given (every window of the ranks past the list's end), of ``ranks`` only if
        given, and only those of a ``(kind, name prefix)`` of ``patterns`` if given; only
        ``columns``, if given."""
        where, params = "", dict[str, Any]()
        if windows is not None:
            where, params = "AND window IN {windows:Array(Int64)}", {"windows": list(windows)}
        if from_window is not None:
            # Past the array's end arrayElement gives 0: every window (they are numbered from 0).
            where += " AND window >= arrayElement({from_window:Array(Int64)}, rank + 1)"
            params["from_window"] = [int(x) for x in from_window]
        if since_us is not None:
            where += (
                f" AND window IN (SELECT window FROM {self._t(WINDOWS)} "
                "WHERE job = {job:String} AND time_us >= {since_us:Int64})"
            )
            params["since_us"] = since_us
        if ranks is not None:
            where += " AND rank IN {ranks:Array(Int32)}"
            params["ranks"] = [int(r) for r in ranks]
        if patterns is not None:
            # The sort key starts with the kind: each kind's rows are read, no other.
            either = [
                f"(kind = {{k{i}:String}} AND startsWith(name, {{p{i}:String}}))"
                for i in range(len(patterns))
            ]
            where += f" AND ({' OR '.join(either) or '0'})"
            for i, (kind, prefix) in enumerate(patterns):
                params[f"k{i}"], params[f"p{i}"] = kind, prefix
        return self._select(FUNCTIONS, job, where, params, "window, rank, kind, name, stack", columns)

    def heartbeats_latest(self, job: str, columns: Sequence[str] | None = None) -> pd.DataFrame:
        """The latest heartbeat of each rank of ``job``, ordered by rank, without its stack samples
        and link sends (:meth:`stack_samples` and :meth:`link_sends` sum them up over heartbeats);
        only ``columns``, if given (strings cost more to read than numbers)."""
        names = list(LATEST_HEARTBEATS.column_names)
        names = names if columns is None else [c for c in names if c in columns]
        return self._select(LATEST_HEARTBEATS, job, "", {}, "rank", names)

    def stack_samples(self, job: str, since_us: int | None = None) -> pd.DataFrame:
        """Per rank of ``job`` and function of its code, the stack samples its heartbeats carry
        (from ``since_us`` on, if given): ``rank, function, samples``, by rank and function."""
        sql = (
            f"SELECT rank, fn, sum(n) AS total FROM (SELECT rank, any(samples) AS s FROM {self._t(HEARTBEATS)} "
            "WHERE job = {job:String} AND time_us >= {since:Int64} AND notEmpty(samples) GROUP BY rank, time_us) "
            "ARRAY JOIN mapKeys(s) AS fn, mapValues(s) AS n GROUP BY rank, fn ORDER BY rank, fn"
        )
        df = self._frame(sql, {"job": job, "since": since_us or 0}, ("rank", "fn", "total"))
        return df.rename(columns={"fn": "function", "total": "samples"})  # an alias may not shadow a column

    def link_sends(self, job: str, since_us: int | None = None) -> pd.DataFrame:
        """Per heartbeat of ``job`` (from ``since_us`` on, if given) and network link of its rank, the
        sends since the rank's previous heartbeat: ``rank, time_us, link, nbytes, send_us``."""
        sql = (
            "SELECT rank, time_us, link, tupleElement(v, 1) AS b, tupleElement(v, 2) AS u FROM (SELECT rank, "
            f"time_us, any(sends) AS s FROM {self._t(HEARTBEATS)} WHERE job = {{job:String}} "
            "AND time_us >= {since:Int64} AND notEmpty(sends) GROUP BY rank, time_us) "
            "ARRAY JOIN mapKeys(s) AS link, mapValues(s) AS v ORDER BY time_us, rank, link"
        )
        df = self._frame(sql, {"job": job, "since": since_us or 0}, ("rank", "time_us", "link", "b", "u"))
        return df.rename(columns={"b": "nbytes", "u": "send_us"})  # an alias may not shadow a column

    def gpu_usage(self, job: str, since_us: int | None = None) -> pd.DataFrame:
        """Per rank of ``job`` with NVML samples in its heartbeats (from ``since_us`` on, if given):
        ``rank, gpu_util`` (the mean) ``, gpu_mem_mb`` (the largest), ``samples``."""
        sql = (
            "SELECT rank, avg(gpu_util) AS util, max(gpu_mem_mb) AS mem, count() AS samples "
            f"FROM (SELECT DISTINCT rank, time_us, gpu_util, gpu_mem_mb FROM {self._t(HEARTBEATS)} "
            "WHERE job = {job:String} AND gpu_util >= 0 AND time_us >= {since:Int64}) GROUP BY rank ORDER BY rank"
        )
        df = self._frame(sql, {"job": job, "since": since_us or 0}, ("rank", "util", "mem", "samples"))
        return df.rename(
            columns={"util": "gpu_util", "mem": "gpu_mem_mb"}
        )  # an alias may not shadow a column

    def window_costs(self, job: str) -> pd.DataFrame:
        """Per rank of ``job``, what its profiling windows cost as its heartbeats last said: ``rank,
        windows`` (taken and measured) ``, window_cost_us`` (their cost in all) ``, time_us`` (its
        last heartbeat's)."""
        sql = (
            "SELECT rank, max(windows) AS n, max(window_cost_us) AS cost, max(time_us) AS last "
            f"FROM {self._t(HEARTBEATS)} WHERE job = {{job:String}} GROUP BY rank ORDER BY rank"
        )
        df = self._frame(sql, {"job": job}, ("rank", "n", "cost", "last"))
        return df.rename(columns={"n": "windows", "cost": "window_cost_us", "last": "time_us"})

    def dead_letters(self, limit: int = 1000) -> pd.DataFrame:
        """Up to ``limit`` dead letters, ordered by source and position (raw values can be 1 MB each)."""
        # Positions are strings (a byte offset, a Kafka offset…): shorter first sorts numbers numerically.
        sql = (
            f"SELECT * FROM {self._t(DEAD_LETTERS)} FINAL "
            "ORDER BY source, length(position), position LIMIT {limit:UInt64}"
        )
        return self._frame(sql, {"limit": limit}, DEAD_LETTERS.column_names)

    def missing(self, job: str) -> pd.DataFrame:
        """Per rank and process of ``job`` whose records did not all arrive: ``rank, pid, made``
        (the numbers it gave out, up to the last one stored) and ``stored``. A gap is a record lost
        on the way (dropped by the hook, lost by the transport, dead-lettered); records lost after
        a process's last stored one cannot be seen."""
        sql = f"""
            SELECT rank, pid, maxMerge(last) + 1 AS made, groupBitmapMerge(seqs) AS stored
            FROM {self._t(ARRIVALS_BY_PROCESS_TABLE)} WHERE job = {{job:String}}
            GROUP BY rank, pid HAVING stored < made ORDER BY rank, pid"""
        return self._frame(sql, {"job": job}, ("rank", "pid", "made", "stored"))

    def counts(self, job: str) -> dict[str, int]:
        """Rows per table for ``job`` (after FINAL), e.g. ``{"steps": 1200, "ranks": 8, ...}``."""
        sql = " UNION ALL ".join(
            f"SELECT '{name}', count() FROM {self._t(TABLES[name])} FINAL WHERE job = {{job:String}}"
            for name in JOB_TABLES
        )
        counts = dict.fromkeys(JOB_TABLES, 0)
        counts.update({name: int(n) for name, n in self._query(sql, {"job": job}).result_rows})
        return counts

    def _steps(
        self, job: str, where: str, params: dict[str, Any], since_step: int, columns: list[str]
    ) -> pd.DataFrame:
        """The step rows that match ``where``, one row per step of ``columns`` (see :meth:`steps`)."""
        # The stored rows (one per block of steps) come out of ClickHouse and are spread over their
        # steps here: at 1,000 ranks of 100 ms steps, 10 minutes hold 300,000 rows but 6 million
        # steps, which ClickHouse would sort and hand over column by column (6 s; numpy: 0.6 s).
        read = [*dict.fromkeys([*columns, "dur_us", "n_steps"])]  # dur_us: where each step starts
        sql = f"""
            SELECT {", ".join(read)}
            FROM {self._t(STEPS)} FINAL WHERE job = {{job:String}} {where}
            ORDER BY rank, step, start_us"""
        rows = self._frame(sql, {**params, "job": job}, read)
        n = rows["n_steps"].to_numpy(dtype=np.int64).clip(min=0)
        i = np.arange(int(n.sum()), dtype=np.int64) - np.repeat(np.cumsum(n) - n, n)

        def spread(column: str) -> np.ndarray:
            return np.repeat(rows[column].to_numpy(), n)

        per = np.repeat(n, n)  # >= 1: a row of 0 steps spreads over none
        out = {"rank": spread("rank"), "step": spread("step") + i}
        out["start_us"] = spread("start_us") + spread("dur_us") * i // per
        for column in columns:
            if column in _TOTALS:
                out[column] = spread(column) / per  # the block's totals, as a mean per step
            elif column not in out:
                out[column] = spread(column)
        steps = pd.DataFrame(out, columns=columns)
        steps = steps[steps["step"].to_numpy() >= since_step] if since_step > -(1 << 63) else steps
        rank, step = steps["rank"].to_numpy(), steps["step"].to_numpy()
        if ((rank[1:] == rank[:-1]) & (step[1:] <= step[:-1])).any():
            # A rank restarted from a checkpoint may have rows of other lengths over the same
            # steps: the later run (larger start) counts, as ReplacingMergeTree keeps it for rows
            # of one step.
            steps = steps.sort_values(["rank", "step", "start_us"], ascending=[True, True, False])
            steps = steps.drop_duplicates(["rank", "step"])
        return steps.reset_index(drop=True)

    def _buckets(
        self, job: str, where: str, params: dict[str, Any], width: int, columns: list[str]
    ) -> pd.DataFrame:
        """The step rows that match ``where`` summed up per rank and bucket of ``width`` steps: their
        means per step as 32-bit floats (7 digits; half the bytes to hand over)."""
        means = [c for c in columns if c in _TOTALS]
        # Aliases may not shadow a column: ``m_<column>``, renamed after. A row's first collective
        # is its steps' mean (-1: none entered one): the bucket's is the rows' mean, of those with one.
        first = (
            ", if(countIf(first_coll_us >= 0) = 0, -1, avgIf(first_coll_us, first_coll_us >= 0)) AS m_first_coll_us"
            if "first_coll_us" in columns
            else ""
        )
        sql = f"""
            SELECT rank, intDiv(step, {{width:Int64}}) * {{width:Int64}} AS bucket, min(start_us) AS start
                   {"".join(f", toFloat32(sum({c}) / sum(n_steps)) AS m_{c}" for c in means)} {first}
            FROM {self._t(STEPS)} FINAL WHERE job = {{job:String}} AND n_steps > 0 {where}
            GROUP BY rank, bucket"""
        means += ["first_coll_us"] if first else []
        names = ["rank", "bucket", "start", *(f"m_{c}" for c in means)]
        rows = self._frame(sql, {**params, "job": job, "width": width}, names, arrow=True)
        rows = rows.rename(columns={"bucket": "step", "start": "start_us", **{f"m_{c}": c for c in means}})
        return rows.reindex(columns=columns).assign(**{WIDTH: width})

    def _select(
        self,
        table: Table,
        job: str,
        where: str,
        params: dict[str, Any],
        order: str,
        columns: Sequence[str] | None = None,
    ) -> pd.DataFrame:
        names = table.column_names if columns is None else list(columns)
        sql = (
            f"SELECT {', '.join(f'`{c}`' for c in names)} FROM {self._t(table)} FINAL "
            f"WHERE job = {{job:String}} {where} ORDER BY {order}"
        )
        # Through Arrow, but where a map would come back as a list of pairs, not a dict.
        arrow = not any(t.startswith("Map(") for c, t in table.columns if c in names)
        return self._frame(sql, {"job": job, **params}, names, arrow=arrow)

    def _t(self, table: Table) -> str:
        return f"`{self._db}`.`{table.name}`"

    def _query(self, sql: str, params: dict[str, Any] | None = None) -> Any:
        try:
            return self._client.query(sql, parameters=params or {})
        except ClickHouseError as exc:
            raise StoreError(f"query on {self._db} failed: {exc}") from exc

    def _frame(
        self, sql: str, params: dict[str, Any], columns: Iterable[str], arrow: bool = False
    ) -> pd.DataFrame:
        """The rows of ``sql``; ``arrow``: through Arrow, faster than the Native reader for many rows
        (docs/benchmarks.md has the figures), but maps come back as lists of pairs."""
        try:
            if arrow:
                df = self._client.query_arrow(sql, parameters=params).to_pandas()
            else:
                df = self._client.query_df(sql, parameters=params)
        except ClickHouseError as exc:
            raise StoreError(f"query on {self._db} failed: {exc}") from exc
        if df.columns.empty:
            # An empty result comes back from chDB with no columns at all; callers index by name.
            return pd.DataFrame(columns=list(columns))
        return df
