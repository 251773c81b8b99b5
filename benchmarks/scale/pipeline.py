"""One job of 1,000 to 100,000 ranks through the whole pipeline, measured per size.

    python -m benchmarks.scale.pipeline [--ranks 1000,10000,100000] [--minutes 10] [--functions 300] [--repeat N]
                               [--json PATH]

Each size runs in a process of its own (its peak memory is its own). The records ``--ranks`` hooks
at their defaults ship over ``--minutes``: a ``rank`` record each, a step record every 2 s (one
block of 100 ms steps), a heartbeat every 5 s, a profiling window every 30 s of ``--functions``
patterns (its threads' run-queue wait and operators); rank ``ranks // 3`` works 1.5x as long per
step over the second half (``serve_scale.rank_records``). They are written to a spool as the
hooks write it (untimed), then:

- ``ingest``: the aggregator's spool path (``rankscope ingest``) into an embedded chDB store: records/s;
- the store's size on disk (its tables' parts in use);
- ``diagnose``: the job read and diagnosed as ``rankscope diagnose`` does, the read included
  (``read_s``: the read alone);
- ``cycle``: ``rankscope serve``'s cycles as the job runs: the first on all but its last 40 s,
  then one after each 10 s more (spooled untimed, ingested timed): ``cycle_steady_s`` their median;
- the process's peak resident memory, and whether the top finding names the slow rank;
- with ``--repeat N``: the job's stored records then copied ``N - 1`` times more in SQL, each copy
  ``--minutes`` later (steps, heartbeats, windows and their functions; merged, as a store at rest
  is), and read and diagnosed again (``repeated_*``): a job ``N`` times as long, where generating
  and ingesting it whole would not fit (100,000 ranks x 10 minutes: ~54 GB of spool, ~2.5 hours
  here). Its ingest is the first ``--minutes``' only; its peak memory (``repeated_peak_rss_gb``)
  is the process's from the copies' end on, not the copying's.

A size that fails (out of memory, a limit) is reported with its error, the next one still runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.scale.serve import STEP_US, rank_records
from rankscope.profiler_hook.config import Identity
from rankscope.profiler_hook.sinks import SpoolSink
from rankscope.wire.records import RankInfo, encode

JOB = "scale"
GROWTH = 100
"""Steps a running job gains between two serve cycles: 10 s (two of serve's default interval; a
multiple of the hooks' 2 s blocks and 5 s heartbeats)."""
CYCLES = 4
"""Serve cycles after the first, each with the job ``GROWTH`` steps on."""


def _spool(root: Path, seqs: list[int], s0: int, steps: int, total: int, functions: int, t0: int) -> int:
    """Every rank's records of steps ``s0 .. s0 + steps`` (of a job of ``total`` steps) appended to
    its spool file, as its hook writes them: a ``rank`` record first, numbered by its process from
    ``seqs[rank]`` on, as its shipper numbers them (``seqs`` is moved on); how many."""
    n, ranks = 0, len(seqs)
    for r in range(ranks):
        ident = Identity(rank=r, local_rank=r % 8, world_size=ranks, host=f"node{r // 8}", pid=1000 + r)
        recs = rank_records(JOB, r, ranks, t0, s0, steps, total // 2, functions, batch_rows=1)
        if seqs[r] == 0:
            info = RankInfo(job=JOB, rank=r, host=ident.host, time_us=t0, local_rank=r % 8, world_size=ranks)
            recs.insert(0, info)
        sink = SpoolSink(root, JOB, ident)
        for seq, rec in enumerate(recs, seqs[r]):
            sink.send(*encode(dataclasses.replace(rec, pid=ident.pid, seq=seq)))
        sink.close()
        seqs[r] += len(recs)
        n += len(recs)
    return n


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _step_rows(store: Any) -> int:
    sql = f"SELECT count() FROM `{store.database}`.steps FINAL WHERE job = {{job:String}}"
    return int(store.client.query(sql, parameters={"job": JOB}).result_rows[0][0])


def _repeat(store: Any, steps: int, copies: int) -> None:
    """The job's steps, heartbeats, windows and functions copied ``copies - 1`` times more, each
    copy ``steps`` steps (of ``STEP_US``) and as many windows later, then merged."""
    from rankscope.aggregator.schema import FUNCTIONS, HEARTBEATS, LATEST_HEARTBEATS, STEPS, WINDOWS

    c, db = store.client, store.database
    q = {"job": JOB}
    windows = c.query(f"SELECT max(window) + 1 FROM `{db}`.windows WHERE job = {{job:String}}", parameters=q)
    later = {"step": steps, "step_lo": steps, "step_hi": steps, "start_us": steps * STEP_US}
    later.update(time_us=steps * STEP_US, window=int(windows.result_rows[0][0]))
    for t in (STEPS, HEARTBEATS, WINDOWS, FUNCTIONS):
        first = "step_lo" if "step_lo" in t.column_names else "step"
        for k in range(1, copies):
            cols = ", ".join(f"`{n}` + {k * later[n]}" if n in later else f"`{n}`" for n in t.column_names)
            c.command(
                f"INSERT INTO `{db}`.`{t.name}` SELECT {cols} FROM `{db}`.`{t.name}` "
                f"WHERE job = {{job:String}} AND {first} < {steps}",
                parameters=q,
            )
    for t in (STEPS, HEARTBEATS, WINDOWS, FUNCTIONS, LATEST_HEARTBEATS):  # the last: kept by a view
        c.command(f"OPTIMIZE TABLE `{db}`.`{t.name}` FINAL")


def _diagnosed(store: Any, ranks: int, out: dict[str, Any], prefix: str = "") -> None:
    """The job read and diagnosed as ``rankscope diagnose`` does: ``read_s``, ``diagnose_s``
    (read included), ``top_finding``, ``straggler_named``, each under ``prefix``."""
    from rankscope.diagnosis import diagnose, read_job

    t = time.perf_counter()
    data = read_job(store, JOB)
    out[f"{prefix}read_s"] = round(time.perf_counter() - t, 2)
    found = diagnose(data).findings
    out[f"{prefix}diagnose_s"] = round(time.perf_counter() - t, 2)
    out[f"{prefix}top_finding"] = f"{found[0].cause} @ ranks {found[0].ranks}" if found else ""
    out[f"{prefix}straggler_named"] = bool(found) and found[0].ranks == [ranks // 3]


def one(ranks: int, minutes: float, functions: int, repeat: int = 1) -> dict[str, Any]:
    """One size, in this process."""
    from rankscope.aggregator import Store, ingest
    from rankscope.api import ServeSettings, Service

    steps = int(minutes * 60e6 / STEP_US) // GROWTH * GROWTH
    t0 = time.time_ns() // 1000 - steps * STEP_US
    out: dict[str, Any] = {"ranks": ranks, "minutes": minutes, "functions": functions}
    with tempfile.TemporaryDirectory() as tmp:
        spool, store_dir = Path(tmp) / "spool", Path(tmp) / "store"
        seqs, records, spool_s, ingest_s = [0] * ranks, 0, 0.0, 0.0
        out["cycle_s"] = []
        with Store.embedded(store_dir) as store:
            svc = Service(store, ServeSettings())
            # The job's records but its last cycles', then a cycle's more before each later cycle.
            head = steps - CYCLES * GROWTH
            for s0, n in ((0, head), *((s, GROWTH) for s in range(head, steps, GROWTH))):
                t = time.perf_counter()
                records += _spool(spool, seqs, s0, n, steps, functions, t0)
                spool_s += time.perf_counter() - t
                stats = ingest(spool, store)
                ingest_s += stats.seconds
                out["dead_letters"] = out.get("dead_letters", 0) + stats.dead_letters
                t = time.perf_counter()
                svc.cycle(now_us=t0 + (s0 + n) * STEP_US + 1_000_000)
                out["cycle_s"].append(round(time.perf_counter() - t, 2))
            out["step_rows"] = _step_rows(store)
            out["records"], out["spool_s"], out["spool_mb"] = (
                records,
                round(spool_s, 1),
                round(_du(spool) / 1e6, 3),
            )
            out["ingest_s"], out["records_per_s"] = round(ingest_s, 1), round(records / ingest_s)
            out["cycle_problem"] = svc.stats.cycle_problem
            out["cycle_steady_s"] = sorted(out["cycle_s"][1:])[CYCLES // 2]
            gaps = store.missing(JOB)
            out["records_missing"] = int((gaps["made"] - gaps["stored"]).sum())
            _diagnosed(store, ranks, out)
            # The parts in use: merged-away parts stay on disk for minutes before they are removed.
            held = store.client.query(
                "SELECT sum(bytes_on_disk) FROM system.parts WHERE active AND database = {db:String}",
                parameters={"db": store.database},
            ).result_rows[0][0]
            out["store_mb"] = round(int(held) / 1e6, 3)
            out["peak_rss_gb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2)
            if repeat > 1:
                t = time.perf_counter()
                _repeat(store, steps, repeat)
                out["repeated_step_rows"] = _step_rows(store)
                out["repeated_minutes"], out["repeat_s"] = minutes * repeat, round(time.perf_counter() - t, 1)
                # The copying's peak (chDB's, in this process) is not the diagnosis's: measured from here.
                fresh = _reset_peak_rss()
                _diagnosed(store, ranks, out, "repeated_")
                out["repeated_peak_rss_gb"] = _peak_rss_gb() if fresh else None
    return out


def _reset_peak_rss() -> bool:
    """Start this process's peak resident memory anew from what it holds now (Linux: ``clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_gb() -> float:
    """This process's peak resident memory since it started or since :func:`_reset_peak_rss`."""
    status = Path("/proc/self/status").read_text()
    return round(int(status.split("VmHWM:")[1].split()[0]) / 1e6, 2)  # kB


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="1000,10000,100000", help="job sizes, comma-separated")
    p.add_argument("--minutes", type=float, default=10.0, help="minutes of records per job")
    p.add_argument("--functions", type=int, default=300, help="function patterns per window")
    p.add_argument(
        "--repeat", type=int, default=1, help="diagnose again with the records copied to N x --minutes"
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a size, in this process
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(one(int(a.ranks), a.minutes, a.functions, a.repeat)))
        return []
    results = []
    for ranks in (int(r) for r in a.ranks.split(",")):
        cmd = [sys.executable, "-m", "benchmarks.scale.pipeline", "--one", "--ranks", str(ranks)]
        cmd += ["--minutes", str(a.minutes), "--functions", str(a.functions), "--repeat", str(a.repeat)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode == 0:
            results.append(json.loads(run.stdout.strip().splitlines()[-1]))
        else:  # killed for memory shows as -9
            why = (
                run.stderr.strip().splitlines()[-1] if run.stderr.strip() else f"exit status {run.returncode}"
            )
            results.append({"ranks": ranks, "minutes": a.minutes, "functions": a.functions, "error": why})
        print(_row(results[-1]), flush=True)
    print(_table(results))
    if a.json:
        Path(a.json).write_text(json.dumps({"sizes": results}, indent=2) + "\n")
    return results


COLUMNS = (
    ("ranks", "ranks"),
    ("records", "records"),
    ("records_per_s", "ingest rec/s"),
    ("store_mb", "store MB"),
    ("diagnose_s", "diagnose s (read incl.)"),
    ("read_s", "of which read s"),
    ("cycle_s", "serve cycles s"),
    ("cycle_steady_s", "steady cycle s"),
    ("peak_rss_gb", "peak RSS GB"),
    ("top_finding", "top finding"),
    ("straggler_named", "straggler named"),
    ("repeated_minutes", "repeated to min"),
    ("repeated_diagnose_s", "then diagnose s"),
    ("repeated_read_s", "of which read s"),
    ("repeated_peak_rss_gb", "its peak RSS GB"),
    ("repeated_straggler_named", "then named"),
)


def _row(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{r['ranks']} ranks: failed: {r['error']}"
    return ", ".join(f"{label} {r[key]}" for key, label in COLUMNS if key in r)


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(label for _, label in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        cells = [str(r.get(key, "")) for key, _ in COLUMNS]
        if "error" in r:
            cells[-1] = f"failed: {r['error']}"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
