"""The diagnosis API on a running service: jobs, diagnoses, pictures, tickets, errors, health."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rankscope.aggregator import SchemaError, StoreError
from rankscope.api import ServeSettings, Service, create_app, storage
from rankscope.api.service import VIEWS
from rankscope.diagnosis import diagnose, read_job
from rankscope.diagnosis.ettr import measure, read_run
from rankscope.wire.errors import Forbidden, NotFoundError, RankscopeError, Unauthenticated, UsageError
from tests.api.common import JOBS, READ, WRITE, get, running


def test_jobs_list_and_one_job(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    running(svc)
    jobs = {j["job"]: j for j in get(client, "/api/v1/jobs")}
    assert set(jobs) == set(JOBS)
    slow = jobs["compute-r2"]
    assert slow["state"] == "slow" and slow["ranks"] == 4 and slow["findings"] == 1
    assert slow["open_tickets"] and slow["steps_per_s"] > 0 and slow["step"] > 0
    assert jobs["healthy"]["state"] == "running" and jobs["healthy"]["open_tickets"] == []
    assert [j["job"] for j in get(client, "/api/v1/jobs?state=slow")] == ["compute-r2"]
    assert get(client, "/api/v1/jobs/healthy")["findings"] == 0


def test_the_diagnosis_is_what_rankscope_diagnose_prints(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    running(svc)
    got = get(client, "/api/v1/jobs/compute-r2/diagnosis")
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
        now = running(svc)  # alone so far: it diagnoses both jobs
        (tid,) = (t.id for t in svc.tickets.values() if t.job == "compute-r2")
        svc.settings = replace(
            svc.settings, lease_s=10.0
        )  # by default also twice the last cycle's time: here, the clock's
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
    now = running(svc)
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
    running(svc)
    again = Service(svc.store, ServeSettings(ended_after_s=3600.0))
    assert again.jobs["compute-r2"].recent is None  # resumed: not diagnosed by this service yet
    reads: list[int] = []
    real = svc.store.steps
    monkeypatch.setattr(svc.store, "steps", lambda *a, **k: (reads.append(1), real(*a, **k))[1])
    heat = again.view("compute-r2", "heatmap")
    assert heat["ranks"] == [0, 1, 2, 3] and len(reads) == 1


def test_the_data_behind_the_pictures(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    running(svc)
    heat = get(client, "/api/v1/jobs/compute-r2/heatmap")
    assert heat["ranks"] == [0, 1, 2, 3] and heat["functions"]
    assert all(len(f["ms_per_step"]) == 4 for f in heat["functions"])
    steps = get(client, "/api/v1/jobs/compute-r2/steps?points=20")["ranks"]
    assert set(steps) == {"0", "1", "2", "3"}
    assert all(len(r["step"]) == len(r["step_ms"]) == len(r["own_ms"]) <= 22 for r in steps.values())
    assert get(client, "/api/v1/jobs/compute-r2/steps?ranks=2&ranks=9")["ranks"].keys() == {"2"}
    assert get(client, "/api/v1/jobs/compute-r2/steps")["ranks_total"] == 4
    windows = get(client, "/api/v1/jobs/compute-r2/windows")
    assert {w["rank"] for w in windows} == {0, 1, 2, 3}
    reliability = get(client, "/api/v1/jobs/compute-r2/reliability")
    assert reliability == json.loads(json.dumps(measure(read_run(svc.store, "compute-r2")).to_dict()))
    assert 0 < reliability["ettr"] <= 1 and len(reliability["attempts"]) == 1
    eff = get(client, "/api/v1/jobs/compute-r2/efficiency")
    assert [r["rank"] for r in eff["ranks"]] == [0, 1, 2, 3] and eff["shares"]["compute"] is not None
    slow = max(eff["ranks"], key=lambda r: r["own"])
    assert slow["rank"] == 2, "the slow device's rank spends the most of its step on its own work"


def test_ticket_filters_and_actions_with_scopes(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    running(svc)
    (t,) = get(client, "/api/v1/tickets?state=active&cause=compute")
    assert (
        get(client, "/api/v1/tickets?cause=hang") == []
        and get(client, "/api/v1/tickets?state=resolved") == []
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
    assert get(client, f"/api/v1/tickets/{t['id']}")["state"] == "acknowledged"


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
    running(svc)
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
    now = running(svc)
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
    now = running(svc)
    svc.stats.kafka_problem = "Kafka consumer stopped: KafkaError: gone"  # as Service._consume sets it
    svc.cycle(now_us=now + 1_000_000)  # the spool and the store are fine
    health = client.get("/healthz")
    assert health.status_code == 503 and health.json()["problem"] == svc.stats.kafka_problem


def test_health_metrics_and_openapi(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    running(svc)
    assert client.get("/healthz").json()["status"] == "ok"
    text = client.get("/metrics").text
    assert 'rankscope_serve_tickets{state="open"} 1.0' in text and "rankscope_serve_jobs_watched 2.0" in text
    paths = client.get("/openapi.json").json()["paths"]
    for p in ("/api/v1/jobs", "/api/v1/jobs/{job}", "/api/v1/jobs/{job}/diagnosis", "/api/v1/tickets",
              "/api/v1/tickets/{ticket_id}"):  # fmt: skip
        assert p in paths
