"""The web pages, as HTML and in a real headless browser."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi.testclient import TestClient

from benchmarks.faults.serve_e2e import Receiver
from benchmarks.procs import free_port
from rankscope.api import Service, create_app
from rankscope.api.auth import Tokens
from rankscope.api.notify import Webhook
from rankscope.api.tickets import TicketSettings, fingerprint
from tests.api.common import READ, WRITE, get, running, service_on


def test_pages_show_the_culprit_and_the_ticket(served: tuple[Service, TestClient]) -> None:
    svc, client = served
    running(svc)
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
    store, svc = service_on(store_dir, spool, webhooks=(Webhook(receiver.url),), tickets=TicketSettings())
    try:
        now = running(svc)
        client = TestClient(create_app(svc, Tokens({READ: "read", WRITE: "write"})))
        assert svc.tickets == {} and get(client, "/api/v1/tickets") == []
        job = next(j for j in get(client, "/api/v1/jobs") if j["job"] == "compute-r2")
        (finding,) = svc.diagnosis_or_empty("compute-r2").findings
        assert job["watching"] == [fingerprint("compute-r2", finding)] and job["open_tickets"] == []
        client.cookies.set("rankscope_token", READ)
        page = client.get("/jobs/compute-r2").text
        assert "Watching, not yet a ticket" in page and "compute on ranks 2" in page
        assert f"of the {TicketSettings().open_after_s:g} s it must hold" in page
        assert receiver.wait_for(1, timeout_s=1.0) == []
        # Held on for open_after_s: the job sent nothing new, its diagnosis stands, it opens.
        svc.cycle(now_us=now + int(TicketSettings().open_after_s * 1e6))
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
    running(svc)
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
