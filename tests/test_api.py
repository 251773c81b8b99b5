"""``rankscope serve``: the service's cycle, tickets, webhooks, the API and the pages, on real chDB.

The jobs are the recorded real runs (tests/fixtures): a 4-rank job whose rank 2 computes slower,
and a healthy one. Each test's service reads them from a spool, as ``rankscope serve --spool`` does,
into a database of its own in one embedded store (chDB runs one engine per process).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from itertools import count
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import uvicorn
from fastapi.testclient import TestClient

from aggregator import SchemaError, Store, StoreError, ingest
from api import ServeSettings, Service, create_app, storage
from api.auth import Forbidden, Tokens, Unauthenticated
from api.notify import Webhook
from api.service import VIEWS
from api.tickets import Rules, Ticket, fingerprint, reconcile
from benchmarks.serve_e2e import Receiver
from benchmarks.workload import free_port
from diagnosis import Finding, diagnose, read_job
from diagnosis.ettr import measure, read_run
from rankscope.cli import main
from wire.errors import NotFoundError, RankscopeError, UsageError
from wire.records import Exit, RankInfo, StepBatch, StepRow

FIXTURES = Path(__file__).parent / "fixtures"
JOBS = ("compute-r2", "healthy")
READ, WRITE = "r" * 20, "w" * 20
_databases = count()


@pytest.fixture(scope="module")
def spool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spool")
    for job in JOBS:
        (root / job).mkdir()
        for gz in (FIXTURES / job).glob("*.jsonl.gz"):
            (root / job / gz.name.removesuffix(".gz")).write_bytes(gzip.decompress(gz.read_bytes()))
    return root


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


def _service(store_dir: Path, spool: Path, **settings: Any) -> tuple[Store, Service]:
    """A service on a database of its own, which already holds the spool (so the test sets the clock)."""
    store = Store.embedded(store_dir, database=f"serve{next(_databases)}")
    ingest(spool, store)
    settings.setdefault("ended_after_s", 3600.0)  # the two recorded jobs ran a minute apart
    # A recorded job is diagnosed once (it does not grow): its tickets open at that diagnosis. The
    # pending rule (Rules.open_after_s) has its own tests.
    settings.setdefault("rules", Rules(open_after_s=0))
    return store, Service(store, ServeSettings(spool=str(spool), **settings))


def _last_us(svc: Service) -> int:
    return int(svc.store.jobs()["last_us"].max())


@pytest.fixture
def served(store_dir: Path, spool: Path, receiver: Receiver) -> Iterator[tuple[Service, TestClient]]:
    store, svc = _service(store_dir, spool, webhooks=[Webhook(receiver.url)])
    yield svc, TestClient(create_app(svc, Tokens({READ: "read", WRITE: "write"})))
    svc.stop()
    store.close()


def _running(svc: Service) -> int:
    """Cycle at a time when the jobs still run: one second after the last record of the latest job."""
    now = _last_us(svc) + 1_000_000
    svc.cycle(now_us=now)
    return now


def _get(client: TestClient, path: str, token: str = READ) -> Any:
    r = client.get(path, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, (path, r.status_code, r.text)
    return r.json()


def test_a_running_replica_that_dies_has_its_jobs_taken_within_two_of_the_survivors_cycles(
    store_dir: Path, spool: Path
) -> None:
    """Replicas run by ``start()`` note themselves alive every half interval, for an interval: one
    that stops (as a dead one would) is gone within an interval, and the survivor owns its jobs by
    its second cycle after."""
    store, a = _service(store_dir, spool, interval_s=0.5, replica="a")
    assert store.reopen is not None
    jobs = sorted(store.jobs()["job"])
    # A name that takes one of the two jobs from "a" (the jobs go by hashing, see Service.owns).
    name = next(n for n in (f"b{i}" for i in range(100)) if sum(a.owns(j, among=["a", n]) for j in jobs) == 1)
    b = Service(store.reopen(), ServeSettings(interval_s=0.5, replica=name, ended_after_s=3600.0))
    try:
        for svc in (a, b):
            svc.start()
        deadline = time.monotonic() + 30
        while sorted(a.replicas) != ["a", name] or sorted(b.replicas) != ["a", name]:
            assert time.monotonic() < deadline, (a.replicas, b.replicas)
            time.sleep(0.1)
        assert [a.owns(j) for j in jobs] != [b.owns(j) for j in jobs] and any(b.owns(j) for j in jobs)
        b.stop()  # its cycles and its notes stop
        died = a.stats.cycles
        while not all(a.owns(j) for j in jobs):
            assert time.monotonic() < deadline + 30
            time.sleep(0.05)
        assert a.replicas == ["a"] and a.stats.cycles - died <= 2, a.stats.cycles - died
    finally:
        a.stop()
        b.stop()
        b.store.close()
        store.close()


# --- the cycle and the tickets it keeps --------------------------------------------------------


def test_the_slow_rank_gets_one_ticket_and_the_healthy_job_none(
    served: tuple[Service, TestClient], receiver: Receiver
) -> None:
    svc, client = served
    _running(svc)
    tickets = _get(client, "/api/v1/tickets")
    assert [(t["job"], t["cause"], t["ranks"], t["state"]) for t in tickets] == [
        ("compute-r2", "compute", [2], "open")
    ]
    t = tickets[0]
    assert t["culprit"] == "ranks 2" and t["hosts"] == ["node1"] and t["lost_rank_s"] > 0
    assert t["events"][0]["state"] == "open" and "compute" in t["events"][0]["reason"]
    assert _get(client, "/api/v1/tickets?job=healthy") == []
    firing = receiver.wait_for(1)[0]
    assert firing["status"] == "firing" and firing["version"] == "4"
    alert = firing["alerts"][0]
    assert alert["labels"]["job"] == "compute-r2" and alert["labels"]["culprit"] == "ranks 2"
    assert alert["endsAt"] == "0001-01-01T00:00:00Z" and alert["generatorURL"].endswith(f"/tickets/{t['id']}")


def test_a_cycle_without_new_records_changes_nothing(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    now = _running(svc)
    before = _get(client, "/api/v1/tickets")
    history = _get(client, "/api/v1/jobs/compute-r2/diagnoses")
    svc.cycle(now_us=now + 1_000_000)
    assert _get(client, "/api/v1/tickets") == before
    assert len(_get(client, "/api/v1/jobs/compute-r2/diagnoses")) == len(history) == 1


def test_an_ended_job_resolves_its_ticket_and_the_webhook_hears_both(
    served: tuple[Service, TestClient], receiver: Receiver
) -> None:
    svc, client = served
    now = _running(svc)
    svc.cycle(now_us=now + 3601_000_000)  # nothing for longer than ended_after_s: ended
    (t,) = _get(client, "/api/v1/tickets?job=compute-r2")
    assert t["state"] == "resolved" and t["events"][-1]["reason"] == "the job ended"
    assert _get(client, "/api/v1/jobs/compute-r2")["state"] == "ended"
    bodies = receiver.wait_for(2)
    assert [b["status"] for b in bodies] == ["firing", "resolved"]
    assert bodies[1]["alerts"][0]["endsAt"] != "0001-01-01T00:00:00Z"
    deliveries = _get(client, f"/api/v1/tickets/{t['id']}")["deliveries"]
    assert [(d["status"], d["ok"]) for d in deliveries] == [("firing", 1), ("resolved", 1)]


def test_a_rank_that_raised_opens_a_critical_ticket_at_once_and_the_webhook_hears_it(
    served: tuple[Service, TestClient], receiver: Receiver
) -> None:
    """A job's rank 1 raises what PyTorch raises when its GPU fails; its peers' collectives raise
    after it and torchrun stops the rest: the service's next cycle opens a critical ticket on
    rank 1 (no waiting: a failure is urgent) and the webhook fires."""
    svc, client = served
    job, now = "gpu-fault", _last_us(svc)
    rows = tuple(
        StepRow(s, now - 2_000_000 + s * 10_000, 10_000, 0, 2_000, 1, 500, 8_000, 0, 1) for s in range(50)
    )
    host = {r: f"node{r // 2}" for r in range(4)}
    said = {1: ("exception", "RuntimeError", "CUDA error: an illegal memory access was encountered")}
    said |= {r: ("exception", "RuntimeError", "Connection closed by peer") for r in (0, 2)}
    said[3] = ("signal", "", "")
    svc.store.write(
        [RankInfo(job=job, rank=r, host=host[r], time_us=now - 3_000_000, local_rank=r, world_size=4) for r in range(4)]
        + [StepBatch(job=job, rank=r, host=host[r], time_us=now - 1_000_000, rows=rows) for r in range(4)]
        + [
            Exit(job=job, rank=r, host=host[r], time_us=now + (0 if r == 1 else 200_000 + r), how=how, step=50,
                 error=error, message=message, frame="train.py(80): train_step @95" if error else "",
                 signal=15 if how == "signal" else 0)
            for r, (how, error, message) in said.items()
        ]
    )  # fmt: skip
    svc.cycle(now_us=now + 1_000_000)
    (t,) = _get(client, f"/api/v1/tickets?job={job}")
    assert (t["cause"], t["culprit"], t["hosts"], t["severity"]) == (
        "failure",
        "ranks 1",
        ["node0"],
        "critical",
    )
    # The recorded job's straggler ticket opens in the same cycle: two bodies, in either order.
    (firing,) = [b for b in receiver.wait_for(2) if b["alerts"][0]["labels"]["job"] == job]
    labels = firing["alerts"][0]["labels"]
    assert firing["status"] == "firing" and (labels["alertname"], labels["culprit"], labels["severity"]) == (
        "RankscopeFailure",
        "ranks 1",
        "critical",
    )


def test_a_fault_that_stopped_resolves_its_ticket_while_the_job_runs(
    served: tuple[Service, TestClient],
) -> None:
    svc, client = served
    now = _running(svc)
    (t,) = _get(client, "/api/v1/tickets")
    # The job goes on healthy: its recent records (here: its last 0.5 s) show no straggler.
    svc.settings.recent_s = 0.5
    svc.jobs["compute-r2"].data_last_us = -1  # as if new records had come
    svc.cycle(now_us=now + 30_000_000)
    assert _get(client, f"/api/v1/tickets/{t['id']}")["state"] == "open"  # absent 30 s: not yet
    svc.jobs["compute-r2"].data_last_us = -1
    svc.cycle(now_us=now + 61_000_000)
    got = _get(client, f"/api/v1/tickets/{t['id']}")
    assert got["state"] == "resolved" and got["events"][-1]["reason"] == "healthy for 60 s"
    assert _get(client, "/api/v1/jobs/compute-r2")["state"] == "running"


def test_a_job_id_with_slashes_has_its_routes_and_page(served: tuple[Service, TestClient]) -> None:
    """torchrun rendezvous ids and team/run names hold '/': every job route must still reach them."""
    svc, client = served
    job, now = "team/llama/run-7", _last_us(svc)
    rows = tuple(
        StepRow(s, now - 1_000_000 + s * 10_000, 10_000, 0, 2_000, 1, 500, 8_000, 0, 1) for s in range(50)
    )
    svc.store.write([StepBatch(job=job, rank=r, host="h", time_us=now, rows=rows) for r in range(4)])
    svc.cycle(now_us=now + 1_000_000)
    auth = {"Authorization": f"Bearer {READ}"}
    quoted = quote(job, safe="")
    for path in (
        "",
        "/diagnosis",
        "/diagnoses",
        "/heatmap",
        "/steps",
        "/windows",
        "/reliability",
        "/efficiency",
    ):
        for name in (job, quoted):
            r = client.get(f"/api/v1/jobs/{name}{path}", headers=auth)
            assert r.status_code == 200, (name, path, r.text)
    assert client.get(f"/api/v1/jobs/{job}", headers=auth).json()["job"] == job
    assert client.get(f"/api/v1/jobs/{job}/diagnosis", headers=auth).json()["job"] == job
    assert client.get(f"/jobs/{quoted}", cookies={"rankscope_token": READ}).status_code == 200


def test_recent_reads_hold_only_the_recent_steps_and_windows(served: tuple[Service, TestClient]) -> None:
    svc, _ = served
    full = read_job(svc.store, "compute-r2")
    since = int(full.steps["start_us"].quantile(0.5)) if "start_us" in full.steps else 0
    recent = read_job(svc.store, "compute-r2", since_us=since)
    later = full.steps[full.steps["start_us"] >= since]
    assert 0 < len(later) <= len(recent.steps) < len(full.steps)
    # Rows are blocks of steps (profiler_hook.blocks): the one under way at ``since`` comes whole.
    assert (recent.steps["start_us"] >= since - 4_000_000).all()
    windows = svc.store.windows("compute-r2")
    kept = set(windows.loc[windows["time_us"] >= since, "window"])
    assert set(recent.spans()["window"]) == kept and len(kept) < full.spans()["window"].nunique()
    profiled = recent.functions_of(recent.spans()["rank"].unique())
    assert set(profiled["window"]) == kept
    assert len(recent.ranks) == len(full.ranks) == 4


def test_a_restarted_service_keeps_its_tickets_and_opens_none_twice(
    served: tuple[Service, TestClient], store_dir: Path, spool: Path
) -> None:
    svc, _ = served
    now = _running(svc)
    before = {t.id: t.to_dict() for t in svc.tickets.values()}
    with Store.embedded(store_dir, database=svc.store.database) as store:
        again = Service(store, svc.settings)
        again.cycle(now_us=now + 1_000_000)
    assert {t.id: t.to_dict() for t in again.tickets.values()} == before


def test_a_dead_webhook_is_retried_with_backoff_and_every_attempt_kept(store_dir: Path, spool: Path) -> None:
    flaky = Receiver(codes=(500, 503))
    store, svc = _service(store_dir, spool, webhooks=[Webhook(flaky.url)])
    svc.notifier.backoff_s = 0.05
    try:
        _running(svc)
        assert flaky.wait_for(1)
        (t,) = svc.tickets.values()
        deadline = time.monotonic() + 5
        while len(svc.deliveries(t.id)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        attempts = [(d["attempt"], d["ok"], d["error"]) for d in svc.deliveries(t.id)]
        assert attempts == [(1, 0, "HTTPError: HTTP Error 500: Internal Server Error"),
                            (2, 0, "HTTPError: HTTP Error 503: Service Unavailable"), (3, 1, "")]  # fmt: skip
    finally:
        svc.stop()
        store.close()
        flaky.server.shutdown()


# --- the API -------------------------------------------------------------------------------------


def test_jobs_list_and_one_job(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    _running(svc)
    jobs = {j["job"]: j for j in _get(client, "/api/v1/jobs")}
    assert set(jobs) == set(JOBS)
    slow = jobs["compute-r2"]
    assert slow["state"] == "slow" and slow["ranks"] == 4 and slow["findings"] == 1
    assert slow["open_tickets"] and slow["steps_per_s"] > 0 and slow["step"] > 0
    assert jobs["healthy"]["state"] == "running" and jobs["healthy"]["open_tickets"] == []
    assert [j["job"] for j in _get(client, "/api/v1/jobs?state=slow")] == ["compute-r2"]
    assert _get(client, "/api/v1/jobs/healthy")["findings"] == 0


def test_the_diagnosis_is_what_rankscope_diagnose_prints(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    _running(svc)
    got = _get(client, "/api/v1/jobs/compute-r2/diagnosis")
    want = diagnose(read_job(svc.store, "compute-r2")).to_dict()
    for d in (got, want):
        d["analyzed"].pop("seconds")
    assert got == want


def test_replicas_share_the_jobs_keep_one_ticket_and_take_over_a_dead_ones_jobs(
    served: tuple[Service, TestClient],
) -> None:
    """Two ``serve`` replicas on one database (a ClickHouse server in production; here one chDB
    store, which two connections share in one process): each job is diagnosed by one of them, the
    other shows its diagnosis and tickets; one ticket between them, and a person's acknowledgement
    through either holds in later diagnoses. A replica that stops cycling (dead) is gone once its
    lease (two cycles' time) runs out: the other takes its jobs at its next cycle, tickets and all."""
    svc, client = served
    assert svc.store.reopen is not None
    other_store = svc.store.reopen()
    try:
        now = _running(svc)  # alone so far: it diagnoses both jobs
        (tid,) = (t.id for t in svc.tickets.values() if t.job == "compute-r2")
        svc.settings.lease_s = 10.0  # by default also twice the last cycle's time: here, the clock's
        other = Service(other_store, ServeSettings(ended_after_s=3600.0, replica="other", lease_s=10.0))
        other.cycle(now_us=now + 100_000)
        svc.cycle(now_us=now + 200_000)
        assert sorted(svc.replicas) == sorted(other.replicas) == sorted([svc.settings.replica, "other"])
        jobs = sorted(svc.jobs)
        assert jobs == ["compute-r2", "healthy"] and sorted(other.jobs) == jobs
        assert all(svc.owns(j) != other.owns(j) for j in jobs), "each job has one replica"
        owner, follower = (svc, other) if svc.owns("compute-r2") else (other, svc)
        for s in (svc, other):  # the follower shows what the owner found
            assert [t.id for t in s.tickets.values() if t.job == "compute-r2"] == [tid]
            assert s.diagnosis("compute-r2") == owner.diagnosis("compute-r2")
            assert s.diagnosis("compute-r2").findings
        assert [d["id"] for d in storage.load_tickets(svc.store, "compute-r2")] == [tid]
        r = client.post(
            f"/api/v1/tickets/{tid}/acknowledge",
            json={"reason": "on it"},
            headers={"Authorization": f"Bearer {WRITE}"},
        )
        assert r.status_code == 200
        owner.jobs["compute-r2"].data_last_us = -1  # new records: its replica diagnoses again
        t = now + 1_000_000
        owner.cycle(now_us=t)
        assert owner.tickets[tid].state == "acknowledged"
        # The owner dies (cycles no more). Its lease holds 10 s after its last cycle began.
        held = follower.jobs["compute-r2"].diagnosed_us
        follower.jobs["compute-r2"].data_last_us = -1
        follower.cycle(now_us=t + 5_000_000)
        assert not follower.owns("compute-r2")
        assert follower.jobs["compute-r2"].diagnosed_us == owner.jobs["compute-r2"].diagnosed_us != held
        follower.jobs["compute-r2"].data_last_us = -1
        follower.cycle(now_us=t + 10_500_000)
        assert follower.replicas == [follower.settings.replica] and follower.owns("compute-r2")
        assert follower.jobs["compute-r2"].diagnosed_us == t + 10_500_000  # diagnosed by the survivor
        assert [(x.id, x.state) for x in follower.tickets.values() if x.job == "compute-r2"] == [
            (tid, "acknowledged")
        ]
        (stored,) = storage.load_tickets(svc.store, "compute-r2")
        assert stored["state"] == "acknowledged" and stored["events"][-1]["reason"] != "opened"
    finally:
        other_store.close()


def test_the_pictures_are_drawn_once_a_diagnosis_by_the_cycle_while_someone_watches(
    served: tuple[Service, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    svc, client = served
    drawn: dict[str, list[Any]] = {name: [] for name in VIEWS}  # name -> the data each drawing read
    for name, draw in list(VIEWS.items()):
        monkeypatch.setitem(
            VIEWS, name, lambda s, job, data, _d=draw, _n=name: drawn[_n].append(data) or _d(s, job, data)
        )
    now = _running(svc)
    svc.cycle(now_us=now)  # nobody has asked for the job's pictures: none drawn
    assert svc.stats.last_views_s == 0 and not any(drawn.values())
    page = client.get("/jobs/compute-r2", headers={"Authorization": f"Bearer {READ}"}).text
    pictures = svc.view("compute-r2", "pictures")
    assert pictures in page and svc.view("compute-r2", "pictures") is pictures
    (data,) = drawn["pictures"]  # drawn once, from the data the diagnosis read
    assert data is svc.job_data("compute-r2")
    before = {name: len(d) for name, d in drawn.items()}
    svc.jobs["compute-r2"].data_last_us = -1  # as if new records had come
    svc.cycle(now_us=now + 1_000_000)
    again = svc.job_data("compute-r2")
    assert all(len(d) == before[n] + 1 and d[-1] is again for n, d in drawn.items()), drawn  # all drawn anew
    assert svc.view("compute-r2", "pictures") is not pictures
    assert svc.stats.last_views_s > 0


def test_a_restarted_service_draws_a_view_from_one_read(
    served: tuple[Service, TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before its first diagnosis of a job (here: resumed after a restart) the service reads the
    job's data for a view once, and the views that build on another draw from that same read."""
    svc, _ = served
    _running(svc)
    again = Service(svc.store, ServeSettings(ended_after_s=3600.0))
    assert again.jobs["compute-r2"].recent is None  # resumed: not diagnosed by this service yet
    reads: list[int] = []
    real = svc.store.steps
    monkeypatch.setattr(svc.store, "steps", lambda *a, **k: (reads.append(1), real(*a, **k))[1])
    heat = again.view("compute-r2", "heatmap")
    assert heat["ranks"] == [0, 1, 2, 3] and len(reads) == 1


def test_the_data_behind_the_pictures(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    _running(svc)
    heat = _get(client, "/api/v1/jobs/compute-r2/heatmap")
    assert heat["ranks"] == [0, 1, 2, 3] and heat["functions"]
    assert all(len(f["ms_per_step"]) == 4 for f in heat["functions"])
    steps = _get(client, "/api/v1/jobs/compute-r2/steps?points=20")["ranks"]
    assert set(steps) == {"0", "1", "2", "3"}
    assert all(len(r["step"]) == len(r["step_ms"]) == len(r["own_ms"]) <= 22 for r in steps.values())
    assert _get(client, "/api/v1/jobs/compute-r2/steps?ranks=2&ranks=9")["ranks"].keys() == {"2"}
    assert _get(client, "/api/v1/jobs/compute-r2/steps")["ranks_total"] == 4
    windows = _get(client, "/api/v1/jobs/compute-r2/windows")
    assert {w["rank"] for w in windows} == {0, 1, 2, 3}
    reliability = _get(client, "/api/v1/jobs/compute-r2/reliability")
    assert reliability == json.loads(json.dumps(measure(read_run(svc.store, "compute-r2")).to_dict()))
    assert 0 < reliability["ettr"] <= 1 and len(reliability["attempts"]) == 1
    eff = _get(client, "/api/v1/jobs/compute-r2/efficiency")
    assert [r["rank"] for r in eff["ranks"]] == [0, 1, 2, 3] and eff["shares"]["compute"] is not None
    slow = max(eff["ranks"], key=lambda r: r["own"])
    assert slow["rank"] == 2, "the slow device's rank spends the most of its step on its own work"


def test_ticket_filters_and_actions_with_scopes(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    _running(svc)
    (t,) = _get(client, "/api/v1/tickets?state=active&cause=compute")
    assert (
        _get(client, "/api/v1/tickets?cause=hang") == []
        and _get(client, "/api/v1/tickets?state=resolved") == []
    )
    url = f"/api/v1/tickets/{t['id']}/acknowledge"
    assert client.post(url).status_code == 401
    assert client.post(url, headers={"Authorization": f"Bearer {READ}"}).status_code == 403
    assert (
        client.get("/api/v1/tickets", headers={"Authorization": "Bearer wrong-token-123456"}).status_code
        == 401
    )
    r = client.post(url, json={"reason": "on it"}, headers={"Authorization": f"Bearer {WRITE}"})
    assert r.status_code == 200 and r.json()["state"] == "acknowledged"
    assert r.json()["events"][-1]["reason"] == "on it"
    r = client.post(f"/api/v1/tickets/{t['id']}/silence", headers={"Authorization": f"Bearer {WRITE}"})
    assert r.json()["silenced"] is True
    assert _get(client, f"/api/v1/tickets/{t['id']}")["state"] == "acknowledged"


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/api/v1/jobs/nope", 404),
        ("/api/v1/jobs/nope/diagnosis", 404),
        ("/api/v1/tickets/nope", 404),
        ("/api/v1/jobs?state=bogus", 422),
        ("/api/v1/jobs/compute-r2/steps?points=0", 422),
        ("/api/v1/tickets?cause=bogus", 422),
        ("/tickets/nope", 404),
    ],
)
def test_errors_are_one_line_with_their_status(
    served: tuple[Service, TestClient], path: str, status: int
) -> None:
    svc, client = served
    _running(svc)
    r = client.get(path, headers={"Authorization": f"Bearer {READ}"})
    assert r.status_code == status and "detail" in r.json()


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (UsageError, 400),
        (Unauthenticated, 401),
        (Forbidden, 403),
        (NotFoundError, 404),
        (StoreError, 503),
        (SchemaError, 503),
        (RankscopeError, 503),
    ],
)
def test_each_kind_of_error_has_its_status_from_one_table(
    served: tuple[Service, TestClient], error: type[RankscopeError], status: int
) -> None:
    """Whatever route raises it, a kind of the error tree gets the status ``api.app.STATUS`` gives it,
    with its message on one line (ClickHouse's stack trace cut off)."""
    svc, _ = served
    app = create_app(svc)

    @app.get("/raise")
    def raise_it() -> None:
        raise error("what went wrong,\n Stack trace: (frames)")

    r = TestClient(app).get("/raise")
    assert (r.status_code, r.json()) == (status, {"detail": "what went wrong"})
    assert (r.headers.get("www-authenticate") == "Bearer") == (status == 401)


def test_a_store_that_cannot_be_read_is_503_with_the_reason(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    now = _running(svc)
    svc.store.client.command(f"DROP TABLE {svc.store.database}.steps")
    # (The heatmap and the step charts show what the last diagnosis read, from memory; the
    # reliability reads the job's whole run from the store.)
    r = client.get("/api/v1/jobs/compute-r2/reliability", headers={"Authorization": f"Bearer {READ}"})
    assert r.status_code == 503 and "steps" in r.json()["detail"] and "\n" not in r.json()["detail"]
    svc.cycle(now_us=now + 1_000_000)
    health = client.get("/healthz")
    assert health.status_code == 503 and health.json()["problem"]


def test_a_stopped_kafka_consumer_keeps_healthz_failing_after_good_cycles(
    served: tuple[Service, TestClient],
) -> None:
    svc, client = served
    now = _running(svc)
    svc.stats.kafka_problem = "Kafka consumer stopped: KafkaError: gone"  # as Service._consume sets it
    svc.cycle(now_us=now + 1_000_000)  # the spool and the store are fine
    health = client.get("/healthz")
    assert health.status_code == 503 and health.json()["problem"] == svc.stats.kafka_problem


def test_health_metrics_and_openapi(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    _running(svc)
    assert client.get("/healthz").json()["status"] == "ok"
    text = client.get("/metrics").text
    assert 'rankscope_serve_tickets{state="open"} 1.0' in text and "rankscope_serve_jobs_watched 2.0" in text
    paths = client.get("/openapi.json").json()["paths"]
    for p in ("/api/v1/jobs", "/api/v1/jobs/{job}", "/api/v1/jobs/{job}/diagnosis", "/api/v1/tickets",
              "/api/v1/tickets/{ticket_id}"):  # fmt: skip
        assert p in paths


def test_pages_show_the_culprit_and_the_ticket(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    _running(svc)
    (t,) = svc.tickets.values()
    client.cookies.set("rankscope_token", READ)
    jobs = client.get("/").text
    assert "compute-r2" in jobs and "healthy" in jobs and t.id in jobs
    page = client.get("/jobs/compute-r2").text
    assert "rank 2" in page and "compute" in page and t.id in page
    assert "<h2>Reliability</h2>" in page and "ETTR" in page and "no restarts seen" in page
    assert "<h2>Where the time goes</h2>" in page
    ticket = client.get(f"/tickets/{t.id}").text
    assert "Timeline" in ticket and "ranks 2" in ticket and "compute-r2" in ticket
    client.cookies.clear()
    assert client.get("/").status_code == 401


def test_a_finding_not_yet_held_is_watched_on_the_job_page_and_pages_no_one(
    store_dir: Path, spool: Path, receiver: Receiver
) -> None:
    """At the defaults a user gets, the slow rank's first diagnosis opens no ticket and sends no
    webhook; the job page and the API say it is watched."""
    store, svc = _service(store_dir, spool, webhooks=[Webhook(receiver.url)], rules=Rules())
    try:
        now = _running(svc)
        client = TestClient(create_app(svc, Tokens({READ: "read", WRITE: "write"})))
        assert svc.tickets == {} and _get(client, "/api/v1/tickets") == []
        job = next(j for j in _get(client, "/api/v1/jobs") if j["job"] == "compute-r2")
        (finding,) = svc.diagnosis_or_empty("compute-r2").findings
        assert job["watching"] == [fingerprint("compute-r2", finding)] and job["open_tickets"] == []
        client.cookies.set("rankscope_token", READ)
        page = client.get("/jobs/compute-r2").text
        assert "Watching, not yet a ticket" in page and "compute on ranks 2" in page
        assert f"of the {Rules().open_after_s:g} s it must hold" in page
        assert receiver.wait_for(1, timeout_s=1.0) == []
        # Held on for open_after_s: the job sent nothing new, its diagnosis stands, it opens.
        svc.cycle(now_us=now + int(Rules().open_after_s * 1e6))
        assert [(t.job, t.cause, t.ranks) for t in svc.tickets.values()] == [("compute-r2", "compute", [2])]
        assert receiver.wait_for(1)[0]["alerts"][0]["status"] == "firing"
    finally:
        svc.stop()
        store.close()


def _chromium(*args: str, profile: Path) -> str:
    """Headless Chromium, as SERVICES.md starts it; its stdout."""
    exe = shutil.which("chromium")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: ./dev test installs it")
        pytest.skip("chromium is not installed (./dev test installs it)")
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", f"--user-data-dir={profile}"]  # fmt: skip
    out = subprocess.run([exe, *flags, *args], capture_output=True, text=True, timeout=120, check=True)
    return out.stdout


def test_a_browser_shows_the_culprit_and_the_ticket(
    served: tuple[Service, TestClient], tmp_path: Path
) -> None:
    """The pages as a person sees them: served by uvicorn, loaded by a real headless Chromium."""
    svc, _ = served
    _running(svc)
    (t,) = svc.tickets.values()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(svc), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port}"
        jobs = _chromium("--dump-dom", f"{base}/", profile=tmp_path / "p1")
        assert "compute-r2" in jobs and "healthy" in jobs and t.id in jobs
        job = _chromium("--dump-dom", f"{base}/jobs/compute-r2", profile=tmp_path / "p2")
        assert '<span class="cause">compute</span>' in job and "rank 2 (node1)" in job and t.id in job
        assert "Where each rank spends its time" in job and "<polyline" in job
        ticket = _chromium("--dump-dom", f"{base}/tickets/{t.id}", profile=tmp_path / "p3")
        assert "Timeline" in ticket and "ranks 2" in ticket
        shot = tmp_path / "job.png"
        _chromium(f"--screenshot={shot}", "--window-size=1300,1500", f"{base}/jobs/compute-r2",
                  profile=tmp_path / "p4")  # fmt: skip
        assert shot.stat().st_size > 20_000
        if os.environ.get("RANKSCOPE_SCREENSHOT"):  # how the README's picture is made
            shutil.copy(shot, os.environ["RANKSCOPE_SCREENSHOT"])
    finally:
        server.should_exit = True
        thread.join(10)


# --- ticket rules, pure ----------------------------------------------------------------------------


def _finding(
    cause: str = "compute", ranks: tuple[int, ...] = (2,), scope: str = "rank", **ev: Any
) -> Finding:
    return Finding(
        cause=cause, ranks=list(ranks), hosts=["h1"], function="f", confidence=0.9, summary="s",
        evidence={"rank_value_ms": 15.0, "peer_median_ms": 10.0, "held_steps": 100, **ev}, scope=scope,
    )  # fmt: skip


def test_a_fault_that_returns_after_resolving_is_a_new_linked_occurrence() -> None:
    tickets: dict[str, Ticket] = {}
    rules, s = Rules(resolve_after_s=30), 1_000_000
    assert [c.kind for c in reconcile(tickets, "j", [_finding()], 0, 8, rules)] == ["opened"]
    assert [c.kind for c in reconcile(tickets, "j", [_finding()], 10 * s, 8, rules)] == ["updated"]
    assert reconcile(tickets, "j", [], 20 * s, 8, rules) == []  # absent 10 s: not yet
    assert [c.kind for c in reconcile(tickets, "j", [], 41 * s, 8, rules)] == ["resolved"]
    (again,) = reconcile(tickets, "j", [_finding()], 50 * s, 8, rules)
    fp = fingerprint("j", _finding())
    assert again.kind == "opened" and again.ticket.id == f"{fp}-2" and again.ticket.previous == f"{fp}-1"
    assert "returned" in again.ticket.events[0].reason
    assert tickets[f"{fp}-1"].events[-1].reason == "healthy for 30 s"


def test_a_slowdown_opens_its_ticket_once_it_held_and_one_that_comes_and_goes_opens_none() -> None:
    """Prometheus's ``for``: a slowdown is watched until every diagnosis for ``open_after_s`` had
    it; one missing diagnosis starts it over. A hang opens its ticket at once."""
    tickets: dict[str, Ticket] = {}
    pending: dict[str, int] = {}
    rules, s = Rules(open_after_s=15), 1_000_000

    def cycle(at_s: float, *findings: Finding) -> list[str]:
        return [
            c.kind for c in reconcile(tickets, "j", list(findings), int(at_s * s), 8, rules, pending=pending)
        ]

    assert cycle(0, _finding()) == [] and pending == {fingerprint("j", _finding()): 0}
    assert cycle(10, _finding()) == []
    assert cycle(12) == [] and pending == {}, "gone before it held: watched no longer"
    assert cycle(14, _finding()) == [] and cycle(24, _finding()) == []
    assert cycle(29, _finding()) == ["opened"] and pending == {}
    assert tickets[f"{fingerprint('j', _finding())}-1"].opened_us == 29 * s
    assert cycle(34, _finding()) == ["updated"]
    hang = _finding(cause="hang", stalled_for_s=40)
    assert cycle(39, hang) == ["opened"]
    assert cycle(40, _finding(ranks=(5,))) == [] and len(pending) == 1
    ended = reconcile(tickets, "j", [], 41 * s, 8, rules, ended=True, pending=pending)
    assert {c.kind for c in ended} == {"resolved"} and pending == {}, "an ended job watches nothing"


def test_a_job_wide_slowdown_pages_only_once_it_held_for_minutes() -> None:
    """A job-wide finding names no culprit, and a shared machine slows a healthy job's ranks alike
    for tens of seconds (the dp x pp soak's false ticket held 40 s): it is watched, not ticketed,
    until it held ``open_after_job_wide_s``; a rank's slowdown beside it opens as before."""
    tickets: dict[str, Ticket] = {}
    pending: dict[str, int] = {}
    rules, s = Rules(), 1_000_000
    wide = _finding(cause="job_wide", ranks=(0, 1, 2, 3), scope="job")

    def cycle(at_s: float, *findings: Finding) -> list[str]:
        return [
            c.kind for c in reconcile(tickets, "j", list(findings), int(at_s * s), 8, rules, pending=pending)
        ]

    assert [cycle(t, wide) for t in range(0, 45, 5)] == [[]] * 9, "40 s: watched"
    assert cycle(50) == [] and pending == {}, "gone before it held"
    assert cycle(60, wide, _finding()) == [] and cycle(80, wide, _finding()) == ["opened"]
    assert cycle(355, wide, _finding()) == ["updated"]
    assert cycle(360, wide, _finding()) == ["opened", "updated"], "held 300 s: ticketed"
    assert {t.cause for t in tickets.values()} == {"job_wide", "compute"}


def test_a_failure_opens_a_critical_ticket_at_once_and_says_what_came_after_it() -> None:
    """A crash pages at once. A restart that worked resolves its ticket saying so, but a hardware
    class's stays open for someone to check the host; a job that ended after it keeps it open.
    Each attempt's failure is its own ticket."""
    s = 1_000_000

    def crash(klass: str) -> Finding:
        return _finding(cause="failure", **{"class": klass, "attempt": 0})

    for klass, restarted in (("code", "resolved"), ("gpu_hardware", "open")):
        tickets: dict[str, Ticket] = {}
        (c,) = reconcile(tickets, "j", [crash(klass)], 0, 8, pending={})
        assert (c.kind, c.ticket.severity) == ("opened", "critical")
        (c,) = reconcile(tickets, "j", [], 5 * s, 8, pending={})  # ranks started again: no finding
        assert c.ticket.state == restarted
        assert c.ticket.events[-1].reason.startswith("attempt 0 ended and the job started again")
        assert reconcile(tickets, "j", [], 10 * s, 8, pending={}) == [], "said once"
    # The diagnosis of a restarted job goes on saying why the attempt before died: the same.
    for klass, restarted in (("code", "resolved"), ("gpu_hardware", "open")):
        tickets = {}
        reconcile(tickets, "j", [crash(klass)], 0, 8, pending={})
        went_on = _finding(cause="failure", **{"class": klass, "attempt": 0, "started_again": True})
        reconcile(tickets, "j", [went_on], 5 * s, 8, pending={})
        (t,) = tickets.values()
        assert t.state == restarted
        assert t.events[-1].reason.startswith("attempt 0 ended and the job started again")
        later = reconcile(tickets, "j", [went_on], 10 * s, 8, pending={})
        assert len(tickets) == 1 and all(c.kind == "updated" for c in later), "said once, never reopened"
        assert reconcile(tickets, "j", [], 70 * s, 8, ended=True) == [], "the job's end is no news of it"
    # A service that first reads the job after its restart: the ticket opens and says so at once.
    tickets = {}
    went_on = _finding(cause="failure", **{"class": "code", "attempt": 0, "started_again": True})
    assert [c.kind for c in reconcile(tickets, "j", [went_on], 0, 8, pending={})] == ["opened", "resolved"]
    # Another attempt's failure of the same rank is another ticket.
    again = _finding(cause="failure", **{"class": "code", "attempt": 1})
    assert [c.kind for c in reconcile(tickets, "j", [went_on, again], 5 * s, 8, pending={})] == ["opened"]
    tickets = {}
    reconcile(tickets, "j", [crash("code")], 0, 8)
    (c,) = reconcile(tickets, "j", [], 70 * s, 8, ended=True)
    assert (c.ticket.state, c.ticket.events[-1].reason) == ("open", "the job ended after attempt 0 failed")
    assert reconcile(tickets, "j", [], 75 * s, 8, ended=True) == []
    assert not c.ticket.waits_for_end, "the service leaves it to a person"


def test_a_host_ticket_absorbs_the_rank_tickets_it_explains() -> None:
    tickets: dict[str, Ticket] = {}
    reconcile(tickets, "j", [_finding(ranks=(8,)), _finding(ranks=(3,))], 0, 16)
    host = _finding(ranks=tuple(range(8, 16)), scope="host", host="node1")
    changes = reconcile(tickets, "j", [host, _finding(ranks=(3,))], 1, 16)
    kinds = {(c.ticket.culprit, c.kind) for c in changes}
    assert kinds == {("host node1", "opened"), ("ranks 8", "resolved"), ("ranks 3", "updated")}
    assert "absorbed by" in next(t for t in tickets.values() if t.culprit == "ranks 8").events[-1].reason


def test_severity_is_the_time_the_waiting_ranks_lost() -> None:
    tickets: dict[str, Ticket] = {}
    (c,) = reconcile(tickets, "j", [_finding()], 0, 8)
    assert c.ticket.lost_rank_s == pytest.approx(5e-3 * 100 * 7) and c.ticket.severity == "minor"
    (c,) = reconcile(tickets, "j", [_finding(held_steps=2e5)], 1, 8)
    assert c.ticket.severity == "critical"  # 5 ms x 200,000 steps x 7 ranks > 1 rank-hour
    hang = _finding(cause="hang", stalled_for_s=40)
    assert reconcile({}, "j", [hang], 0, 8)[0].ticket.severity == "critical"


def test_ticket_ids_depend_on_the_findings_alone() -> None:
    a: dict[str, Ticket] = {}
    b: dict[str, Ticket] = {}
    reconcile(a, "j", [_finding()], 5, 8)
    reconcile(b, "j", [_finding()], 9, 8)
    assert list(a) == list(b)  # two services diagnosing one job name its ticket alike


# --- the command ---------------------------------------------------------------------------------


def test_serve_refuses_an_open_address_without_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--store", str(tmp_path / "s"), "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--insecure" in err and not (tmp_path / "s").exists()


def test_tokens_must_be_long_and_scoped(tmp_path: Path) -> None:
    (tmp_path / "t").write_text(f"# ops\n{WRITE} write\n{READ} read\n")
    assert Tokens.load(str(tmp_path / "t"), env="").scope_of(WRITE) == "write"
    with pytest.raises(UsageError, match="16"):
        Tokens.load(None, env="short:read")
    with pytest.raises(UsageError, match="scope"):
        Tokens.load(None, env=f"{READ}:admin")
