"""The service's own tables in the store: tickets (with their timelines), diagnoses, webhook deliveries.

They live beside the records, in the same database, as ReplacingMergeTrees keyed by identity:
a ticket is one row per id (the latest ``updated_us`` wins), so two services writing the same
deterministic ticket id (see :mod:`api.tickets`) leave one ticket.
"""

from __future__ import annotations

import json
from typing import Any

from rankscope.aggregator import Store
from rankscope.aggregator.schema import Table

TICKETS = Table(
    "tickets",
    (
        ("id", "String"),
        ("job", "String"),
        ("state", "LowCardinality(String)"),
        ("cause", "LowCardinality(String)"),
        ("updated_us", "Int64"),
        ("doc", "String"),
    ),
    order_by=("id",),
    version="updated_us",
)
DIAGNOSES = Table(
    "diagnoses",
    (("job", "String"), ("time_us", "Int64"), ("findings", "UInt32"), ("doc", "String")),
    order_by=("job", "time_us"),
)
DELIVERIES = Table(
    "deliveries",
    (
        ("ticket", "String"),
        ("time_us", "Int64"),
        ("url", "String"),
        ("status", "LowCardinality(String)"),
        ("attempt", "UInt32"),
        ("ok", "UInt8"),
        ("error", "String"),
    ),
    order_by=("ticket", "time_us", "url", "attempt"),
)
REPLICAS = Table(
    "serve_replicas",
    (("replica", "String"), ("seen_us", "Int64"), ("until_us", "Int64")),
    order_by=("replica",),
    version="seen_us",
)
"""Each ``serve`` replica's last cycle, and until when it holds its jobs without another: the live
ones share the jobs (``Service.owns``)."""
TABLES = (TICKETS, DIAGNOSES, DELIVERIES, REPLICAS)


def create_tables(store: Store) -> None:
    for table in TABLES:
        store.create(table)


def save_tickets(store: Store, tickets: list[dict[str, Any]]) -> None:
    rows = [(t["id"], t["job"], t["state"], t["cause"], t["updated_us"], json.dumps(t)) for t in tickets]
    store.insert(TICKETS, rows)


def load_tickets(store: Store, job: str | None = None) -> list[dict[str, Any]]:
    """Every ticket (of ``job`` only, if given), as its latest row says."""
    where, params = ("job = {job:String}", {"job": job}) if job is not None else ("", {})
    return [json.loads(doc) for doc in store.select(TICKETS, where, params)["doc"]]


def save_diagnosis(store: Store, job: str, time_us: int, diagnosis: dict[str, Any]) -> None:
    store.insert(DIAGNOSES, [(job, time_us, len(diagnosis["findings"]), json.dumps(diagnosis))])


def diagnoses(store: Store, job: str, limit: int) -> list[dict[str, Any]]:
    """The job's last ``limit`` diagnoses, newest first, each ``{"time_us", "diagnosis"}``."""
    df = store.select(
        DIAGNOSES, "job = {job:String} ORDER BY time_us DESC LIMIT {n:UInt32}", {"job": job, "n": limit}
    )
    return [
        {"time_us": int(t), "diagnosis": json.loads(d)} for t, d in zip(df["time_us"], df["doc"], strict=True)
    ]


def save_delivery(
    store: Store, ticket: str, time_us: int, url: str, status: str, attempt: int, error: str
) -> None:
    store.insert(DELIVERIES, [(ticket, time_us, url, status, attempt, int(not error), error)])


def deliveries(store: Store, ticket: str) -> list[dict[str, Any]]:
    df = store.select(DELIVERIES, "ticket = {t:String} ORDER BY time_us", {"t": ticket})
    return [
        {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()} for row in df.to_dict("records")
    ]


def beat(store: Store, replica: str, now_us: int, until_us: int) -> None:
    store.insert(REPLICAS, [(replica, now_us, until_us)])


def live_replicas(store: Store, now_us: int) -> list[str]:
    """The replicas whose lease runs at ``now_us``."""
    df = store.select(REPLICAS, "until_us >= {t:Int64}", {"t": now_us})
    return sorted(df["replica"])
