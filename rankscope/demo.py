"""``rankscope demo``: train a real 4-rank job with one injected fault, then find it.

hook (in every rank) -> spool files -> ingest into embedded ClickHouse (chDB) -> diagnosis ->
printed findings, ``diagnosis.json`` and ``report.html`` in the output directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

FAULTS = ("none", "compute", "dataloader", "code_path")
"""The faults ``rankscope demo`` offers (the CLI lists them without importing the workload)."""


def run_demo(
    *,
    fault: str = "compute",
    rank: int = 2,
    out: str | Path = "rankscope-demo",
    seconds: float = 60.0,
    world_size: int = 4,
    factor: float = 2.0,
) -> dict:
    """Run the demo; returns the diagnosis as a dict (the shape of ``rankscope diagnose --json``)."""
    from aggregator import Store, ingest
    from diagnosis import diagnose, read_job
    from renderers.html import write_report
    from renderers.text import print_diagnosis

    from .workload import Fault, JobSpec, free_port, launch

    if not 0 <= rank < world_size:
        raise SystemExit(f"--rank must be between 0 and {world_size - 1}, got {rank}")
    out = Path(out).resolve()
    spool, store_dir, logs = out / "spool", out / "store", out / "logs"
    job = f"demo-{fault}-{time.strftime('%Y%m%d-%H%M%S')}"
    where = "" if fault == "none" else f" on rank {rank}"
    print(
        f"[1/4] training job {job}: {world_size} ranks (gloo, CPU) for ~{seconds:.0f} s, fault: {fault}{where}"
    )
    t0 = time.perf_counter()
    spec = JobSpec(
        job=job,
        world_size=world_size,
        port=free_port(),
        seconds=seconds,
        fault=Fault(kind=fault, rank=rank, factor=factor),
        hook={"spool_dir": str(spool)},  # the hook's defaults, as a user gets them
        log_dir=str(logs),
    )
    stats = launch(spec)
    sent = sum(s.get("sent", 0) for s in stats)
    dropped = sum(s.get("dropped", 0) for s in stats)
    print(
        f"      {stats[0]['steps']} steps in {time.perf_counter() - t0:.0f} s; hook shipped {sent} records, dropped {dropped}"
    )

    print(f"[2/4] ingesting {spool} into embedded ClickHouse at {store_dir}")
    with Store.embedded(store_dir) as store:
        st = ingest(spool, store)
        print(f"      {st.records} records from {st.files} files, {st.dead_letters} dead letters")
        print("[3/4] diagnosing")
        data = read_job(store, job)
        diagnosis = diagnose(data)  # the store open: it reads the functions of the ranks it names
        result = diagnosis.to_dict()
        print_diagnosis(diagnosis)
        (out / "diagnosis.json").write_text(json.dumps(result, indent=2))
        report = write_report(out / "report.html", diagnosis, data)
    print(f"[4/4] wrote {out / 'diagnosis.json'} and {report}")
    print(
        f"      more of this job: rankscope efficiency --store {store_dir}  (or reliability, diagnose --json)"
    )
    return result
