"""``rankscope demo``: train a real 4-rank job with one injected fault, then find it.

``demo_job.py`` (a small GPT trained with DDP, the hook attached as the README shows) under
``torchrun`` -> spool files -> ingest into embedded ClickHouse (chDB) -> diagnosis -> printed
findings, ``diagnosis.json`` and ``report.html`` in the output directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

FAULTS = {"none": "none", "compute": "slow_backward", "dataloader": "slow_data", "code_path": "metrics_block"}
"""The faults ``rankscope demo`` offers, and the script's fault each one is (``demo_job.py``)."""
ONSET_S = 5.0
"""Seconds into training at which the fault starts: the rank is its peers' equal before."""


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
    from rankscope.aggregator import Store, ingest
    from rankscope.diagnosis import diagnose, read_job
    from rankscope.renderers.html import write_report
    from rankscope.renderers.text import print_diagnosis

    if not 0 <= rank < world_size:
        raise SystemExit(f"--rank must be between 0 and {world_size - 1}, got {rank}")
    out = Path(out).resolve()
    spool, store_dir, logs = out / "spool", out / "store", out / "logs"
    job = f"demo-{fault}-{time.strftime('%Y%m%d-%H%M%S')}"
    where = "" if fault == "none" else f" on rank {rank} from {ONSET_S:.0f} s"
    print(
        f"[1/4] training job {job}: {world_size} ranks (torchrun, gloo, CPU) for ~{seconds:.0f} s, "
        f"fault: {fault}{where}"
    )
    t0 = time.perf_counter()
    ckpt = out / "checkpoints" / job  # the script's, not a temporary one a killed rank would leave
    done = _train(job, spool, logs, ckpt, world_size, seconds, FAULTS[fault], rank, factor)
    shutil.rmtree(ckpt, ignore_errors=True)
    print(f"      {done} in {time.perf_counter() - t0:.0f} s; logs in {logs}")

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


def _train(
    job: str,
    spool: Path,
    logs: Path,
    ckpt: Path,
    world_size: int,
    seconds: float,
    fault: str,
    rank: int,
    factor: float,
) -> str:
    """Run ``demo_job.py`` under torchrun, as a user runs a script; its last line (steps, time)."""
    logs.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={world_size}",
        f"--master-port={port}",
        str(Path(__file__).with_name("demo_job.py")),
        *("--seconds", str(seconds), "--job", job, "--spool-dir", str(spool)),
        *("--fault", fault, "--fault-rank", str(rank), "--onset-s", str(ONSET_S)),
        *("--fault-factor", str(factor), "--ckpt-dir", str(ckpt)),
    ]
    # One thread per rank, as torchrun sets it where it starts more than one rank on a machine.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = logs / "torchrun.log"
    with open(log, "w") as fh:
        ran = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, check=False)
    text = log.read_text()
    if ran.returncode != 0:
        raise SystemExit(
            f"the demo's training job failed (exit {ran.returncode}); its log, {log}:\n{text[-3000:]}"
        )
    found = re.findall(r"^done: (\d+ steps)", text, re.M)
    return found[-1] if found else "trained"
