"""``rankscope serve``'s cycle on real chDB: the tickets it opens, updates and resolves, the
webhooks it calls, replicas sharing the jobs."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

from fastapi.testclient import TestClient

from benchmarks.faults.serve_e2e import Receiver
from rankscope.aggregator import Store
from rankscope.api import ServeSettings, Service
from rankscope.api.notify import Webhook
from rankscope.diagnosis import read_job
from rankscope.wire.records import Exit, RankInfo, StepBatch, StepRow
from tests.api.common import READ, get, last_us, running, service_on


def test_a_running_replica_that_dies_has_its_jobs_taken_within_two_of_the_survivors_cycles(
    store_dir: Path, spool: Path
) -> None:
    """Replicas run by ``start()`` note themselves alive every half interval, for an interval: one
    that stops (as a dead one would) is gone within an interval, and the survivor owns its jobs by
    its second cycle after."""
    store, a = service_on(store_dir, spool, interval_s=0.5, replica="a")
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


def test_the_slow_rank_gets_one_ticket_and_the_healthy_job_none(
    served: tuple[Service, TestClient], receiver: Receiver
) -> None:
    svc, client = served
    running(svc)
    tickets = get(client, "/api/v1/tickets")
    assert [(t["job"], t["cause"], t["ranks"], t["state"]) for t in tickets] == [
        ("compute-r2", "compute", [2], "open")
    ]
    t = tickets[0]
    assert t["culprit"] == "ranks 2" and t["hosts"] == ["node1"] and t["lost_rank_s"] > 0
    assert t["events"][0]["state"] == "open" and "compute" in t["events"][0]["reason"]
    assert get(client, "/api/v1/tickets?job=healthy") == []
    firing = receiver.wait_for(1)[0]
    assert firing["status"] == "firing" and firing["version"] == "4"
    alert = firing["alerts"][0]
    assert alert["labels"]["job"] == "compute-r2" and alert["labels"]["culprit"] == "ranks 2"
    assert alert["endsAt"] == "0001-01-01T00:00:00Z" and alert["generatorURL"].endswith(f"/tickets/{t['id']}")


def test_a_cycle_without_new_records_changes_nothing(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    now = running(svc)
    before = get(client, "/api/v1/tickets")
    history = get(client, "/api/v1/jobs/compute-r2/diagnoses")
    svc.cycle(now_us=now + 1_000_000)
    assert get(client, "/api/v1/tickets") == before
    assert len(get(client, "/api/v1/jobs/compute-r2/diagnoses")) == len(history) == 1


def test_an_ended_job_resolves_its_ticket_and_the_webhook_hears_both(
    served: tuple[Service, TestClient], receiver: Receiver
) -> None:
    svc, client = served
    now = running(svc)
    svc.cycle(now_us=now + 3601_000_000)  # nothing for longer than ended_after_s: ended
    (t,) = get(client, "/api/v1/tickets?job=compute-r2")
    assert t["state"] == "resolved" and t["events"][-1]["reason"] == "the job ended"
    assert get(client, "/api/v1/jobs/compute-r2")["state"] == "ended"
    bodies = receiver.wait_for(2)
    assert [b["status"] for b in bodies] == ["firing", "resolved"]
    assert bodies[1]["alerts"][0]["endsAt"] != "0001-01-01T00:00:00Z"
    deliveries = get(client, f"/api/v1/tickets/{t['id']}")["deliveries"]
    assert [(d["status"], d["ok"]) for d in deliveries] == [("firing", 1), ("resolved", 1)]


def test_a_rank_that_raised_opens_a_critical_ticket_at_once_and_the_webhook_hears_it(
    served: tuple[Service, TestClient], receiver: Receiver
) -> None:
    """A job's rank 1 raises what PyTorch raises when its GPU fails; its peers' collectives raise
    after it and torchrun stops the rest: the service's next cycle opens a critical ticket on
    rank 1 (no waiting: a failure is urgent) and the webhook fires."""
    svc, client = served
    job, now = "gpu-fault", last_us(svc)
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
    (t,) = get(client, f"/api/v1/tickets?job={job}")
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
    now = running(svc)
    (t,) = get(client, "/api/v1/tickets")
    # The job goes on healthy: its recent records (here: its last 0.5 s) show no straggler.
    svc.settings = replace(svc.settings, recent_s=0.5)
    svc.jobs["compute-r2"].data_last_us = -1  # as if new records had come
    svc.cycle(now_us=now + 30_000_000)
    assert get(client, f"/api/v1/tickets/{t['id']}")["state"] == "open"  # absent 30 s: not yet
    svc.jobs["compute-r2"].data_last_us = -1
    svc.cycle(now_us=now + 61_000_000)
    got = get(client, f"/api/v1/tickets/{t['id']}")
    assert got["state"] == "resolved" and got["events"][-1]["reason"] == "healthy for 60 s"
    assert get(client, "/api/v1/jobs/compute-r2")["state"] == "running"


def test_a_job_id_with_slashes_has_its_routes_and_page(served: tuple[Service, TestClient]) -> None:
    """torchrun rendezvous ids and team/run names hold '/': every job route must still reach them."""
    svc, client = served
    job, now = "team/llama/run-7", last_us(svc)
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
    now = running(svc)
    before = {t.id: t.to_dict() for t in svc.tickets.values()}
    with Store.embedded(store_dir, database=svc.store.database) as store:
        again = Service(store, svc.settings)
        again.cycle(now_us=now + 1_000_000)
    assert {t.id: t.to_dict() for t in again.tickets.values()} == before


def test_a_dead_webhook_is_retried_with_backoff_and_every_attempt_kept(store_dir: Path, spool: Path) -> None:
    flaky = Receiver(codes=(500, 503))
    store, svc = service_on(store_dir, spool, webhooks=(Webhook(flaky.url),))
    svc.notifier.backoff_s = 0.05
    try:
        running(svc)
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
