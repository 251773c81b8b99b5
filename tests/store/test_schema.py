"""The store's schema on a real chDB engine: its tables made once, the same on a cluster, an older
schema's store migrated with its rows read as before, another version's refused."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from rankscope.aggregator import STORE_VERSION, SchemaError, Store, StoreError, ensure_schema
from rankscope.aggregator.schema import (
    ARRIVALS_BY_PROCESS_OBJECTS,
    ARRIVALS_BY_PROCESS_TABLE,
    FUNCTIONS,
    LATEST_HEARTBEATS,
    LATEST_HEARTBEATS_OBJECTS,
    TABLES,
    WINDOW_INPUT_OBJECTS,
    cluster_ddl,
)
from tests.store.builders import (
    EXPECTED_COUNTS,
    JOB,
    all_records,
)


def test_schema_creation_twice_is_harmless(store: Store) -> None:
    store.write(all_records())
    ensure_schema(store.client, store.database)
    ensure_schema(store.client, store.database)
    assert store.counts(JOB) == EXPECTED_COUNTS
    tables = store.client.query(
        "SELECT name FROM system.tables WHERE database = {db:String}", parameters={"db": store.database}
    ).result_rows
    assert sorted(name for (name,) in tables) == sorted(
        [*TABLES, *WINDOW_INPUT_OBJECTS, *ARRIVALS_BY_PROCESS_OBJECTS, *LATEST_HEARTBEATS_OBJECTS]
    )


def test_a_store_on_a_cluster_is_sharded_by_job_over_replicated_tables(store: Store) -> None:
    """``--clickhouse-cluster``: each table becomes its shards' replicated table (``<name>_local``,
    the same columns and sort key as on one server) and a ``Distributed`` table of its name over
    them, sharded by the first sort column (a job's rows and a row's copies on one shard, where
    ``FINAL`` collapses them); input tables and views on every node. chDB runs no cluster (no
    Keeper, no remote servers): checked here, every statement parses (``formatQuery``), and the
    queries of the diagnosis and the service read the names the ``Distributed`` tables take."""
    ddl = cluster_ddl("rs", "prod")
    for statement in ddl:
        store.client.query("SELECT formatQuery({q:String})", parameters={"q": statement})
        assert " ON CLUSTER `prod`" in statement, statement
    for table in [*TABLES.values(), ARRIVALS_BY_PROCESS_TABLE, LATEST_HEARTBEATS]:
        (one,) = table.ddl("rs")
        local, shared = table.ddl("rs", "prod")
        assert local in ddl and shared in ddl
        keeper = f"'/clickhouse/tables/{{shard}}/rs/{table.name}_local', '{{replica}}'"
        assert local == one.replace(
            f"`rs`.`{table.name}` (", f"`rs`.`{table.name}_local` ON CLUSTER `prod` ("
        ).replace(f"{table.engine}(", f"Replicated{table.engine}({keeper}" + (", " if table.version else ""))
        comment = one[one.index("COMMENT") :]
        assert shared.endswith(
            f"AS `rs`.`{table.name}_local`\nENGINE = Distributed(`prod`, `rs`, `{table.name}_local`, "
            f"cityHash64(`{table.order_by[0]}`))\n{comment}"
        )
    views = [d for d in ddl if "MATERIALIZED VIEW" in d]
    assert len(views) == 5 and "TO `rs`.`arrivals_by_process_local` " in views[-2]
    assert "FROM `rs`.`arrivals_local` " in views[-2]  # each shard counts the arrivals it stores
    assert "TO `rs`.`latest_heartbeats_local` " in views[-1] and "FROM `rs`.`heartbeats_local`" in views[-1]


def test_schema_of_another_version_is_refused(store: Store) -> None:
    store.client.command("CREATE DATABASE old_schema")
    store.client.command(
        "CREATE TABLE old_schema.steps (job String) ENGINE = MergeTree ORDER BY job "
        "COMMENT 'rankscope schema 0'"
    )
    with pytest.raises(SchemaError, match=r"old_schema.*another schema version.*steps"):
        ensure_schema(store.client, "old_schema")


def test_a_store_of_schema_1_is_migrated_and_its_rows_read_as_before(store: Store) -> None:
    store.write(all_records())
    before = store.steps(JOB)
    ranks = store.ranks(JOB)
    # What schema 1 had: steps without n_steps, wait_us or gc_us, ranks without spine, no latest
    # heartbeats, every table's comment saying so.
    latest = store.heartbeats_latest(JOB)
    store.client.command(f"DROP VIEW {store.database}.{LATEST_HEARTBEATS_OBJECTS[1]}")
    store.client.command(f"DROP TABLE {store.database}.{LATEST_HEARTBEATS_OBJECTS[0]}")
    store.client.command(f"ALTER TABLE {store.database}.steps DROP COLUMN n_steps")
    store.client.command(f"ALTER TABLE {store.database}.steps DROP COLUMN wait_us")
    store.client.command(f"ALTER TABLE {store.database}.steps DROP COLUMN gc_us")
    store.client.command(f"ALTER TABLE {store.database}.ranks DROP COLUMN spine")
    store.client.command(f"ALTER TABLE {store.database}.ranks DROP COLUMN coverage")
    for column in ("gpu_util", "gpu_mem_mb", "samples", "sends", "windows", "window_cost_us", "gpu_xids"):
        store.client.command(f"ALTER TABLE {store.database}.heartbeats DROP COLUMN {column}")
    exits = store.exits(JOB)
    store.client.command(f"ALTER TABLE {store.database}.exits DROP COLUMN gpu")
    for name in TABLES:
        store.client.command(f"ALTER TABLE {store.database}.{name} MODIFY COMMENT 'rankscope schema 1'")
    ensure_schema(store.client, store.database)
    # Exits stored before schema 12 say no GPU fault.
    assert store.exits(JOB).to_dict("records") == exits.assign(gpu=[{}] * len(exits)).to_dict("records")
    pd.testing.assert_frame_equal(store.steps(JOB), before.assign(wait_us=0.0, gc_us=0.0))  # none was known
    assert store.ranks(JOB).assign(spine="spine0", coverage=ranks["coverage"]).to_dict(
        "records"
    ) == ranks.to_dict("records")
    assert (store.ranks(JOB)["coverage"] == "").all(), "ranks stored before the migration say no coverage"
    assert (store.ranks(JOB)["spine"] == "").all(), "ranks stored before the migration name no spine"
    gpu = ["gpu_util", "gpu_mem_mb", "gpu_xids"]
    assert store.heartbeats_latest(JOB).drop(columns=gpu).equals(latest.drop(columns=gpu))
    comments = store.client.query(
        "SELECT DISTINCT comment FROM system.tables WHERE database = {db:String} AND name IN {t:Array(String)}",
        parameters={"db": store.database, "t": list(TABLES)},
    ).result_rows
    assert comments == [(f"rankscope schema {STORE_VERSION}",)]


def test_functions_stored_under_schema_8s_sort_key_are_copied_to_the_new_one(store: Store) -> None:
    """Schema 9 sorts function rows by kind first; a store of schema 8 (window first) has them
    copied, every row kept, and its window summaries still land in the new table."""
    records = all_records()
    db = store.database
    store.client.command(f"DROP VIEW {db}.functions_from_input")
    store.client.command(f"DROP TABLE {db}.functions")
    old = FUNCTIONS.ddl(db)[0].replace("`kind`, `rank`, `window`", "`window`, `rank`, `kind`")
    store.client.command(old)
    ensure_schema(store.client, db)  # the view made again, into the old table
    store.write(records)
    store.client.command(f"ALTER TABLE {db}.functions MODIFY COMMENT 'rankscope schema 8'")
    before = store.functions(JOB)
    assert len(before) > 0
    key = "SELECT sorting_key FROM system.tables WHERE database = {db:String} AND name = 'functions'"
    assert store.client.query(key, parameters={"db": db}).result_rows == [
        ("job, window, rank, kind, name, stack",)
    ]
    ensure_schema(store.client, db)
    assert store.client.query(key, parameters={"db": db}).result_rows == [
        ("job, kind, rank, window, name, stack",)
    ]
    pd.testing.assert_frame_equal(store.functions(JOB), before)
    store.write(records)  # again: the view fills the new table, and FINAL collapses the copies
    pd.testing.assert_frame_equal(store.functions(JOB), before)
    assert store.counts(JOB) == EXPECTED_COUNTS


def test_database_name_must_be_an_identifier(store: Store) -> None:
    with pytest.raises(SchemaError, match="must match"):
        Store(store.client, database="x; DROP DATABASE y")


def test_second_engine_path_in_one_process_is_a_clear_error(store: Store, tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="one data directory per process"):
        Store.embedded(tmp_path / "other")
