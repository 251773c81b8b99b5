"""What the service's tests share: the recorded real runs (tests/fixtures), a service on a
database of its own in one embedded store (chDB runs one engine per process), reads through the API."""

from __future__ import annotations

from itertools import count
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from rankscope.aggregator import Store, ingest
from rankscope.api import ServeSettings, Service
from rankscope.api.tickets import TicketSettings

FIXTURES = Path(__file__).parents[1] / "fixtures"
JOBS = ("compute-r2", "healthy")
READ, WRITE = "r" * 20, "w" * 20
_databases = count()


def service_on(store_dir: Path, spool: Path, **settings: Any) -> tuple[Store, Service]:
    """A service on a database of its own, which already holds the spool (so the test sets the clock)."""
    store = Store.embedded(store_dir, database=f"serve{next(_databases)}")
    ingest(spool, store)
    settings.setdefault("ended_after_s", 3600.0)  # the two recorded jobs ran a minute apart
    # A recorded job is diagnosed once (it does not grow): its tickets open at that diagnosis. The
    # pending rule (TicketSettings.open_after_s) has its own tests.
    settings.setdefault("tickets", TicketSettings(open_after_s=0))
    return store, Service(store, ServeSettings(spool=str(spool), **settings))


def last_us(svc: Service) -> int:
    return int(svc.store.jobs()["last_us"].max())


def running(svc: Service) -> int:
    """Cycle at a time when the jobs still run: one second after the last record of the latest job."""
    now = last_us(svc) + 1_000_000
    svc.cycle(now_us=now)
    return now


def get(client: TestClient, path: str, token: str = READ) -> Any:
    r = client.get(path, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, (path, r.status_code, r.text)
    return r.json()
