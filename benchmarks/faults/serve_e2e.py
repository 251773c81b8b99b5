"""``rankscope serve`` end to end: from a fault's onset to a ticket, to a webhook, to its resolution.

    python -m benchmarks.faults.serve_e2e [--scenarios compute-2x-r2,...] [--json PATH]

Starts ``rankscope serve`` (its defaults; a local webhook receiver) on an empty store, watching one
spool. Runs fault-suite scenarios one after another as real multi-rank jobs writing to that spool,
with the hook's defaults. Polls the API every 0.5 s. Per scenario it reports the ticket that opened
(cause and culprit against the ground truth), the seconds from the fault's onset to the ticket and
to the webhook's firing delivery, and whether the ticket resolved once the job ended; a ticket
that opens again while its fault lasts (``-2``) is a flap, one on a healthy job, before a fault's
onset or on a rank that is no culprit pages someone for nothing: reported per healthy job-hour.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from benchmarks.faults.catalogue import JobSpec
from benchmarks.procs import free_port
from rankscope.diagnosis import Finding

from .scenarios import load_all
from .scoring import false_ticket
from .suite import HOOK, START_S, run_job

DEFAULT = (
    "healthy-4r,healthy-8r,lm-healthy-4r,pp-healthy-4r,compute-2x-r2,dataloader-15ms-r1,"
    "callback-15ms-r2,hang-collective-r1"
)


class Receiver:
    """A local webhook receiver: answers each POST with the next of ``codes`` (then 200), keeps the
    arrival time and body of each it accepted (``got``)."""

    def __init__(self, codes: tuple[int, ...] = ()) -> None:
        self.got: list[tuple[float, dict[str, Any]]] = []
        self.codes = list(codes)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                code = outer.codes.pop(0) if outer.codes else 200
                if code == 200:
                    outer.got.append((time.time(), body))
                self.send_response(code)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [b for _, b in self.got]

    def wait_for(self, n: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """The bodies once ``n`` have come, or those that came within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while len(self.got) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.bodies


class Poller(threading.Thread):
    """Polls ``/api/v1/tickets``; keeps when each ticket was first seen and first seen resolved."""

    def __init__(self, base: str) -> None:
        super().__init__(daemon=True)
        self.base, self.stop_ = base, threading.Event()
        self.seen: dict[str, dict[str, Any]] = {}

    def run(self) -> None:
        while not self.stop_.wait(0.5):
            try:
                with urllib.request.urlopen(f"{self.base}/api/v1/tickets", timeout=5) as r:
                    tickets = json.loads(r.read())
            except Exception:
                continue
            now = time.time()
            for t in tickets:
                s = self.seen.setdefault(t["id"], {"ticket": t, "opened_at": now, "resolved_at": None})
                s["ticket"] = t
                if t["state"] == "resolved" and s["resolved_at"] is None:
                    s["resolved_at"] = now


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default=DEFAULT, help="fault-suite scenario names, comma-separated")
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    names = a.scenarios.split(",")
    scenarios = [sc for suite in ("full", "validation") for sc in load_all(suite, names) if sc.name in names]
    results = []
    with tempfile.TemporaryDirectory(prefix="rankscope-serve-e2e-") as tmp:
        spool, port, receiver = Path(tmp, "spool"), free_port(), Receiver()
        spool.mkdir()
        serve = subprocess.Popen(
            [sys.executable, "-m", "rankscope.cli", "serve", "--store", f"{tmp}/store", "--spool", str(spool),
             "--port", str(port), "--webhook", receiver.url],
            stdout=subprocess.DEVNULL, stderr=open(f"{tmp}/serve.log", "w"),  # noqa: SIM115 (lives with serve)
        )  # fmt: skip
        poller = Poller(f"http://127.0.0.1:{port}")
        poller.start()
        try:
            for sc in scenarios:
                job = f"e2e-{sc.name}-{time.strftime('%H%M%S')}"
                markers = Path(tmp, sc.name, "markers")
                markers.mkdir(parents=True)
                spec = JobSpec(
                    job=job, world_size=sc.world_size, hosts=sc.hosts, switches=sc.switches, port=free_port(),
                    seconds=sc.seconds, fault=sc.fault, loop=sc.loop, attach=sc.attach, rank0_duties=sc.rank0_duties,
                    hook={**HOOK, **sc.hook, "spool_dir": str(spool)}, log_dir=f"{tmp}/{sc.name}/logs",
                    progress=False, marker_dir=str(markers),
                    timeout_s=sc.seconds + START_S + max(sc.observe_s, 60.0),
                )  # fmt: skip
                t0 = time.time()
                onset, error, _ = run_job(sc, spec, markers)
                results.append(
                    {"scenario": sc, "job": job, "onset": onset, "error": error, "ran_s": time.time() - t0}
                )
            deadline = time.time() + 150  # serve's defaults: a job silent 60 s has ended; its tickets resolve
            while time.time() < deadline and any(s["resolved_at"] is None for s in poller.seen.values()):
                time.sleep(1)
        finally:
            poller.stop_.set()
            serve.terminate()
            serve.wait(30)
            receiver.server.shutdown()
    rows = [_row(r, poller, receiver) for r in results]
    _print(rows)
    faulty = [r for r in rows if r["expected"] != "none"]
    summary = {
        "benchmark": "serve_e2e",
        "rows": rows,
        "median_open_s": _median([r["open_s"] for r in faulty if not r["hang"]]),
        "median_webhook_s": _median([r["webhook_s"] for r in faulty if not r["hang"]]),
        "hang_open_s": _median([r["open_s"] for r in faulty if r["hang"]]),
        "healthy_tickets": sum(r["tickets"] for r in rows if r["expected"] == "none"),
        "healthy_job_hours": round(sum(r["ran_s"] for r in rows if r["expected"] == "none") / 3600, 3),
        "false_tickets": sum(r["false"] for r in rows),
        "flaps": sum(r["flaps"] for r in rows),
    }
    hours = summary["healthy_job_hours"]
    summary["healthy_tickets_per_job_hour"] = round(summary["healthy_tickets"] / hours, 2) if hours else None
    print(f"\nmedian onset->ticket {summary['median_open_s']} s, onset->webhook {summary['median_webhook_s']} s "
          f"(hangs: {summary['hang_open_s']} s); tickets on healthy runs: {summary['healthy_tickets']} in "
          f"{hours} job-hours; false tickets {summary['false_tickets']}, flaps {summary['flaps']}")  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=2, default=str))
    return summary


def _median(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return round(statistics.median(got), 1) if got else None


def _row(r: dict[str, Any], poller: Poller, receiver: Receiver) -> dict[str, Any]:
    sc, job, onset = r["scenario"], r["job"], r["onset"]
    truth = sc.truth
    mine = sorted(
        (s for s in poller.seen.values() if s["ticket"]["job"] == job), key=lambda s: s["opened_at"]
    )
    first = mine[0] if mine else None
    t0 = onset["time"] if onset else None
    fired = [t for t, b in receiver.got if b.get("status") == "firing" and b["commonLabels"]["job"] == job]
    expected = f"{truth.cause} {list(truth.ranks)}" if truth.cause else "none"
    got = f"{first['ticket']['cause']} {first['ticket']['ranks']}" if first else "none"

    def false(s: dict[str, Any]) -> bool:
        t = s["ticket"]
        finding = Finding(**{k: t[k] for k in Finding.__dataclass_fields__})
        return false_ticket(truth, s["opened_at"] - t0 if t0 is not None else math.inf, finding)

    return {
        "scenario": sc.name,
        "kind": truth.kind,
        "hang": truth.cause == "hang",
        "expected": expected,
        "ticket": got,
        "right": got == expected if truth.cause else not mine,
        "tickets": len(mine),
        "open_s": round(first["opened_at"] - t0, 1) if first and t0 else None,
        "webhook_s": round(fired[0] - t0, 1) if fired and t0 else None,
        "resolved": all(s["resolved_at"] is not None for s in mine) if mine else None,
        "false": sum(false(s) for s in mine),
        "flaps": sum(s["ticket"]["occurrence"] > 1 and not false(s) for s in mine),
        "ran_s": round(r["ran_s"], 1),
        "error": r["error"],
    }


def _print(rows: list[dict[str, Any]]) -> None:
    cols = [
        "scenario",
        "expected",
        "ticket",
        "right",
        "tickets",
        "false",
        "flaps",
        "open_s",
        "webhook_s",
        "resolved",
        "ran_s",
    ]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
