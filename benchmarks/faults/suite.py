"""The fault suite: inject real faults into real multi-rank jobs and score the diagnosis.

    python -m benchmarks.faults [--suite full|ci|validation|soak] [--only NAME ...] [--json PATH] [--keep DIR]
    python -m benchmarks.faults --rescore DIR [--only NAME ...] [--json PATH]   # kept runs, scored again

For each scenario in ``benchmarks/faults/scenarios/`` (see :mod:`benchmarks.faults.scenarios`) it trains the
CPU/gloo workload of ``rankscope demo`` with the hook writing to a spool, injects the fault from
its onset on, ingests the spool into one embedded ClickHouse store (one job id per scenario), and
runs ``diagnosis.diagnose`` as a user would. The final diagnosis is scored against the scenario's
ground truth, and so is the same data cut every ``--probe-s`` seconds from the run's start, as
``rankscope serve`` diagnoses a running job: a finding at any probe of a healthy run, or before a
fault's onset, is a false alarm; after the onset the probes give the detection delay (first
finding), the localization delay (first correct top finding) and the time from which the top
finding stays correct to the end.

Network faults need root, ``ip`` and ``tc``; without them those scenarios are skipped, with the
reason printed. Every namespace, link and hog process the suite makes is removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pandas as pd

from benchmarks.faults.catalogue import JobSpec, first_onset
from benchmarks.faults.launch import RunningJob
from benchmarks.procs import free_port
from rankscope.aggregator import Store, ingest
from rankscope.api.tickets import Ticket, TicketSettings, fingerprint, reconcile
from rankscope.diagnosis import Finding, diagnose, read_job

from .. import machine
from . import scoring, torchrun_job
from .injectors import CpuHog, Fabric, Unavailable, hog_core
from .scenarios import SUITES, Scenario, load_all
from .timeline import Timeline

HOOK: dict = {}
"""Hook settings the suite runs with: none, the defaults a user gets (scenarios may add their own)."""
PROBE_S = 2.0
START_S = 120.0
"""Allowance for spawning the ranks and importing torch on a loaded 2-core machine."""


class _OnsetWatch(threading.Thread):
    """Waits for the first onset marker a faulty rank writes; then switches the external fault on."""

    def __init__(self, marker_dir: Path, injector: Any) -> None:
        super().__init__(daemon=True, name="onset-watch")
        self.marker_dir, self.injector = marker_dir, injector
        self.onset: dict[str, Any] | None = None
        self.error = ""
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(0.05):
            self.onset = first_onset(self.marker_dir)
            if self.onset is None:
                continue
            if self.injector is not None:
                try:
                    self.injector.start()
                except Exception as exc:  # reported with the scenario; the job still runs
                    self.error = f"could not start the fault: {exc}"
            return

    def stop(self) -> None:
        self._stop.set()


def run_job(sc: Scenario, spec: JobSpec, markers: Path) -> tuple[dict[str, Any] | None, str, list[str]]:
    """Run the job with its external fault; returns (onset marker, error, cleanup errors)."""
    if sc.script and not sc.network:  # a user-style script under torchrun; it injects its fault itself
        return torchrun_job.run(sc, spec, markers, START_S)
    injector: Fabric | CpuHog | None = None
    kind = sc.fault.kind
    if sc.network:
        injector = Fabric(spec, kind, sc.faulty_ranks, sc.rate_mbit)
    elif kind == "host":
        injector = CpuHog(hog_core(), sc.hogs, max_s=sc.seconds + START_S)
    watch = _OnsetWatch(markers, injector)
    job: RunningJob | None = None
    onset: dict[str, Any] | None = None
    error = ""
    try:
        if isinstance(injector, Fabric):
            spec = replace(spec, **injector.setup())
        elif isinstance(injector, CpuHog):
            spec = replace(spec, **injector.setup(sc.fault.rank, spec))
        if sc.script:  # its torchrun agents on the fabric: the script marks the onset, the watch slows it
            watch.start()
            onset, error, _ = torchrun_job.run(sc, spec, markers, START_S)
        else:
            job = RunningJob(spec)
            watch.start()
            deadline = time.monotonic() + sc.seconds + START_S
            while True:
                stats = job.wait(1.0)
                if stats is not None:
                    break
                if sc.observe_s and watch.onset and time.time() >= watch.onset["time"] + sc.observe_s:
                    break  # a hung job: stop it once it has been watched long enough
                if time.monotonic() >= deadline:
                    error = f"job still running {sc.seconds + START_S:.0f} s after start: stopped"
                    break
    except Unavailable:
        raise
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        watch.stop()
        if job is not None:
            job.stop()
        cleanup = injector.cleanup() if injector is not None else []
    return onset or watch.onset, error or watch.error, cleanup


def run_scenario(sc: Scenario, store: Store, workdir: Path, probe_s: float = PROBE_S) -> dict[str, Any]:
    """Run one scenario end to end; returns its record for the report (``skipped`` set if it could not run)."""
    job = f"faults-{sc.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir = workdir / sc.name
    spool, markers, logs = run_dir / "spool", run_dir / "markers", run_dir / "logs"
    markers.mkdir(parents=True, exist_ok=True)
    spec = JobSpec(
        job=job,
        world_size=sc.world_size,
        hosts=sc.hosts,
        switches=sc.switches,
        port=free_port(),
        seconds=sc.seconds,
        fault=sc.fault,
        loop=sc.loop,
        attach=sc.attach,
        rank0_duties=sc.rank0_duties,
        hook={**HOOK, **sc.hook, "spool_dir": str(spool)},
        log_dir=str(logs),
        progress=False,
        marker_dir=str(markers),
        timeout_s=sc.seconds + START_S + max(sc.observe_s, 60.0),
    )
    base: dict[str, Any] = {"name": sc.name, "kind": sc.kind, "about": sc.about, "job": job}
    t0 = time.perf_counter()
    speed = machine.MachineWatch()
    speed.start()
    try:
        onset, error, cleanup = run_job(sc, spec, markers)
    except Unavailable as exc:
        return {**base, "skipped": str(exc)}
    finally:
        speed.stop()
        speed.save(run_dir / "machine.json")
    run_s = time.perf_counter() - t0
    ingest(spool, store)
    return {
        **base,
        **evaluate(sc, store, job, spool / job, onset, probe_s, run_dir / "machine.json"),
        "run_s": round(run_s, 1),
        "error": error,
        "cleanup_errors": cleanup,
    }


def evaluate(
    sc: Scenario,
    store: Store,
    job: str,
    spool_job_dir: Path,
    onset: dict[str, Any] | None,
    probe_s: float,
    machine_json: Path,
) -> dict[str, Any]:
    """Score a stored run of ``sc``: its final diagnosis, and diagnoses of the data cut every ``probe_s``
    (``machine_json``: the harness's samples of the machine's own speed, ``MachineWatch``)."""
    data = read_job(store, job)
    final = diagnose(data)
    timeline = Timeline.load(store, job, spool_job_dir)
    sent = timeline.steps["avail_us"] / 1e6 if not timeline.steps.empty else None
    speed = (
        machine.load(machine_json, sent.min(), sent.max(), machine.work(data.steps))
        if sent is not None
        else None
    )
    slowed = machine.slowed(speed)
    s = scoring.score(sc.truth, final, name=sc.name, machine_slowed=slowed)
    probes = _probes(timeline, onset, probe_s)
    return {
        "ground_truth": scoring.expected(sc.truth),
        "score": s.to_dict(),
        "delays": scoring.delays(sc.truth, probes).to_dict(),
        "alarms": scoring.alarms(
            sc.truth, probes, machine_slowed=slowed, opened=_tickets(job, probes, sc.world_size)
        ).to_dict(),
        "onset": onset,
        "steps": int(timeline.steps["step"].max()) + 1 if not timeline.steps.empty else 0,
        "probes": [
            {
                "after_s": p.after_s,
                "after_steps": p.after_steps,
                "findings": [
                    {"finding": scoring.describe(f), "confidence": f.confidence} for f in p.diagnosis.findings
                ],
            }
            for p in probes
        ],
        "windows": windows(data, spool_job_dir.parents[1] / "logs"),
        "machine": speed,
        "diagnosis": final.to_dict(),
    }


def windows(data: Any, logs: Path) -> dict[str, int]:
    """The profiling windows the job planned (any rank stored one, or logged it skipped), how
    many its ranks stored (the fewest of any rank) and how many a rank skipped (its log says so)."""
    skipped: set[int] = set()
    for log in logs.glob("*.log"):
        skipped |= {
            int(n) for n in re.findall(r"rankscope: .*window (\d+) skipped", log.read_text(errors="replace"))
        }
    f = data.spans()
    stored = f.groupby("rank")["window"].nunique() if not f.empty else pd.Series(dtype=int)
    ranks = data.ranks["rank"] if not data.ranks.empty else stored.index
    return {
        "planned": len(set(f["window"].unique() if not f.empty else ()) | skipped),
        "stored_min": int(stored.reindex(ranks, fill_value=0).min()) if len(ranks) else 0,
        "skipped": len(skipped),
    }


def _probes(timeline: Timeline, onset: dict[str, Any] | None, every_s: float) -> list[scoring.Probe]:
    """Diagnoses of the data cut every ``every_s`` seconds from the run's first step to its end,
    as ``rankscope serve`` diagnoses a running job; timed from the onset (a healthy run's: its start)."""
    if timeline.steps.empty:
        return []
    start_us, end = int(timeline.steps["avail_us"].min()), timeline.end_us
    t0_us, step0 = (int(onset["time"] * 1e6), int(onset["step"])) if onset else (start_us, 0)
    out = []
    t = start_us + int(every_s * 1e6)
    while t <= end + every_s * 1e6:
        out.append(
            scoring.Probe(
                after_s=round((t - t0_us) / 1e6, 1),
                after_steps=timeline.last_step(t) - step0,
                diagnosis=diagnose(timeline.at(t)),
            )
        )
        t += int(every_s * 1e6)
    return out


def _tickets(job: str, probes: list[scoring.Probe], world_size: int) -> list[tuple[float, Finding]]:
    """The tickets ``rankscope serve``'s rules (its defaults) open over the probes, one diagnosis a
    cycle: when each opened (seconds after onset) and on which finding."""
    tickets: dict[str, Ticket] = {}
    pending: dict[str, int] = {}
    opened = []
    for p in probes:
        now_us = int(p.after_s * 1e6)
        for c in reconcile(
            tickets, job, p.diagnosis.findings, now_us, world_size, TicketSettings(), pending=pending
        ):
            if c.kind == "opened":
                f = next(f for f in p.diagnosis.findings if fingerprint(job, f) == c.ticket.fingerprint)
                opened.append((p.after_s, f))
    return opened


def _fmt_delay(s: float | None, steps: int | None) -> str:
    return "—" if s is None else f"{s:.0f} s ({steps})"


def report(results: list[dict[str, Any]]) -> str:
    """The markdown tables: one row per scenario, then one per fault kind."""
    lines = [
        "| scenario | ground truth | top finding at the end | function named | conf | top ok | detect (steps) | localize (steps) | right from (steps) | false alarms: probes | tickets: false / all | findings | false extra: end / probes | windows stored/planned |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "skipped" in r:
            lines.append(f"| {r['name']} | skipped: {r['skipped']} |" + " |" * 12)
            continue
        s, d = r["score"], r["delays"]
        ok = (
            "healthy"
            if s["healthy"] and not s["false_findings"]
            else ("yes" if s["top_correct"] else "**no**")
        )
        extra = ""
        if s.get("explained"):
            extra = f"; job_wide explained: the machine itself ran {r['machine']['slowdown']:.2f}x slower"
        if s.get("both_found") is False:
            ok += " (one of two)"
        fn = _short(s.get("function", "")) + {True: " ✓", False: " ✗"}.get(s.get("function_ok"), "")
        lines.append(
            f"| {r['name']} | {r['ground_truth']} | {s['top'] or '—'} | {fn or '—'} | {s['confidence']:.2f} | {ok} | "
            f"{_fmt_delay(d['detect_s'], d['detect_steps'])} | "
            f"{_fmt_delay(d['localize_s'], d['localize_steps'])} | "
            f"{_fmt_delay(d.get('stable_s'), d.get('stable_steps'))}{_fmt_flaps(d)} | {_fmt_alarms(r)} | {_fmt_tickets(r)} | "
            f"{s['findings']}{extra} | {s.get('companions', '—')} / {r.get('alarms', {}).get('extra', '—')} | "
            f"{_fmt_windows(r)} |"
        )
    lines += [
        "",
        "| fault kind | runs | top correct | ranks right | function right | false findings | false extra | median detect s | median localize s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, k in _by_kind(results).items():
        named = f"{k['function_ok']}/{k['function_expected']}" if k["function_expected"] else "—"
        lines.append(
            f"| {kind} | {k['runs']} | {k['top_correct']} | {k['top_located']} | {named} | {k['false_findings']} | "
            f"{k['companions']} | "
            f"{k['median_detect_s'] if k['median_detect_s'] is not None else '—'} | "
            f"{k['median_localize_s'] if k['median_localize_s'] is not None else '—'} |"
        )
    return "\n".join(lines)


def _fmt_flaps(d: dict[str, Any]) -> str:
    return f", lost {d['flaps']}x before" if d.get("flaps") else ""


def _fmt_alarms(r: dict[str, Any]) -> str:
    """``false/watched`` probes (a healthy run's all, a fault run's before onset), the first one's time."""
    a = r.get("alarms")  # absent from reports written before every probe was scored
    if not a or not a["probes"]:
        return "—"
    out = f"{a['false']}/{a['probes']}"
    if a["false"]:
        out += f" (from {a['first_s']:g} s, conf ≤ {a['top_confidence']:.2f}{'; machine slowed' if a['excused'] else ''})"
    return out


def _fmt_tickets(r: dict[str, Any]) -> str:
    a = r.get("alarms")
    if not a or "tickets" not in a:
        return "—"
    return f"{a['false_tickets']} / {a['tickets']}" + (
        f" ({a['reopened']} reopened)" if a["reopened"] else ""
    )


def _fmt_windows(r: dict[str, Any]) -> str:
    w = r.get("windows")  # absent from reports written before it was measured
    return f"{w['stored_min']}/{w['planned']}" if w else "—"


def _short(function: str, width: int = 48) -> str:
    """A function name for a table cell: the end of it, pipes escaped."""
    f = function.replace("|", "\\|")
    return f if len(f) <= width else "…" + f[-width + 1 :]


def _scored(results: list[dict[str, Any]]) -> tuple[list[scoring.Score], list[scoring.Delays]]:
    ran = [r for r in results if "skipped" not in r]
    scores = [scoring.Score(**r["score"]) for r in ran]
    delays = [scoring.Delays(**r["delays"]) for r in ran]
    return scores, delays


def _alarms(results: list[dict[str, Any]]) -> list[scoring.Alarms]:
    return [scoring.Alarms(**r["alarms"]) for r in results if "skipped" not in r]


def _by_kind(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return scoring.by_kind(*_scored(results))


def rescore_scenario(sc: Scenario, store: Store, workdir: Path, probe_s: float = PROBE_S) -> dict[str, Any]:
    """Score the latest run of ``sc`` kept in ``workdir`` (``--keep``) again, with the current diagnosis."""
    run_dir = workdir / sc.name
    prefix = f"faults-{sc.name}-"
    jobs = sorted(j for j in store.jobs()["job"] if j.startswith(prefix) and j[len(prefix) :][:1].isdigit())
    base: dict[str, Any] = {"name": sc.name, "kind": sc.kind, "about": sc.about}
    if not jobs or not run_dir.is_dir():
        return {**base, "skipped": f"no kept run of it in {workdir}"}
    job = jobs[-1]
    onset = first_onset(run_dir / "markers")
    result = evaluate(sc, store, job, run_dir / "spool" / job, onset, probe_s, run_dir / "machine.json")
    return {**base, "job": job, **result, "run_s": None, "error": "", "cleanup_errors": []}


def run_suite(
    scenarios: list[Scenario], workdir: Path, probe_s: float = PROBE_S, rescore: bool = False
) -> dict[str, Any]:
    """Run the scenarios one after another against one embedded store; returns the JSON report.

    With ``rescore``, run nothing: score the runs kept in ``workdir`` again (to measure a change to
    the diagnosis on the same recorded jobs, in seconds instead of the suite's 20 minutes).
    """
    results = []
    t0 = time.perf_counter()
    with Store.embedded(workdir / "store") as store:
        for i, sc in enumerate(scenarios, 1):
            print(f"[{i}/{len(scenarios)}] {sc.name}: {sc.about}", flush=True)
            run = rescore_scenario if rescore else run_scenario
            r = run(sc, store, workdir, probe_s)
            results.append(r)
            if "skipped" in r:
                print(f"      skipped: {r['skipped']}", flush=True)
            else:
                s = r["score"]
                took = "" if r["run_s"] is None else f" in {r['run_s']} s"
                print(
                    f"      {r['steps']} steps{took}; expected {r['ground_truth']}; "
                    f"top: {s['top'] or 'no finding'}; localized after {r['delays']['localize_s']} s, "
                    f"for good after {r['delays']['stable_s']} s; false alarms at {_fmt_alarms(r)} probes; "
                    f"windows stored {r['windows']['stored_min']} of {r['windows']['planned']} planned"
                    + (f"; machine {r['machine']['slowdown']:.2f}x slower" if r.get("machine") else "")
                    + (f"; ERROR {r['error']}" if r["error"] else ""),
                    flush=True,
                )
    scores, delays = _scored(results)
    return {
        "suite_seconds": round(time.perf_counter() - t0, 1),
        "split": "+".join(sorted({sc.split for sc in scenarios})),
        "cpus": len(os.sched_getaffinity(0)),
        "hook": HOOK,
        "probe_s": probe_s,
        "totals": scoring.totals(scores, delays, _alarms(results)),
        "by_kind": scoring.by_kind(scores, delays),
        "skipped": {r["name"]: r["skipped"] for r in results if "skipped" in r},
        "scenarios": results,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--suite",
        choices=SUITES,
        default="full",
        help="full: the tuning set; ci: its reduced part; validation: the scenarios no threshold was set "
        "on; soak: healthy jobs of many minutes",
    )
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        help="run only the scenarios whose name contains this (repeatable)",
    )
    ap.add_argument("--json", default="", help="write the report as JSON here")
    ap.add_argument("--keep", default="", help="keep spools, logs and the store in this directory")
    ap.add_argument("--probe-s", type=float, default=PROBE_S, help="seconds between probe diagnoses")
    ap.add_argument(
        "--rescore",
        default="",
        metavar="DIR",
        help="run no job: score again the runs an earlier --keep DIR kept, with the current diagnosis",
    )
    args = ap.parse_args(argv)
    scenarios = load_all(args.suite, args.only)
    if not scenarios:
        raise SystemExit(f"no scenario in suite {args.suite!r} matches --only {args.only!r}")
    if args.rescore:
        out = run_suite(scenarios, Path(args.rescore).resolve(), args.probe_s, rescore=True)
    else:
        with tempfile.TemporaryDirectory(prefix="rankscope-faults-") as tmp:
            workdir = Path(args.keep).resolve() if args.keep else Path(tmp)
            out = run_suite(scenarios, workdir, args.probe_s)
    print()
    print(report(out["scenarios"]))
    print()
    print(json.dumps(out["totals"]))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0
