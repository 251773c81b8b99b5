"""The product end to end, as a user runs it: `rankscope demo`, then `rankscope ingest/diagnose`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def rankscope(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rankscope.cli", *args],
        capture_output=True,
        text=True,
        check=check,
        timeout=600,
    )


def _machine_slowed(out: Path) -> bool:
    """The demo's steps took ``WORK_SLOWED`` x the CPU time by its end (``benchmarks.machine``:
    the demo has no harness watching the machine, only its own steps)."""
    from benchmarks import machine
    from rankscope.aggregator import Store
    from rankscope.diagnosis import read_job

    with Store.embedded(out / "store") as store:
        steps = read_job(store, store.jobs()["job"].iloc[0]).steps
    return machine.slowed({"work": machine.work(steps)})


@pytest.mark.slow
def test_the_demo_names_its_default_fault_and_the_store_answers_the_other_commands_alike(
    tmp_path: Path,
) -> None:
    """The demo as the README runs it: its default fault, a slower device on rank 2. Its other
    faults run on the same workload in the CI fault suite (tests/faults/test_scenarios.py: a healthy job, a
    data loader's, a hang) or as recorded runs (tests/test_diagnosis.py: its code path), not twice."""
    out = tmp_path / "demo"
    run = rankscope("demo", "--out", str(out))  # its default 60 s: a 25-s run may hold no window
    assert "[4/4] wrote" in run.stdout, run.stdout + run.stderr
    result = json.loads((out / "diagnosis.json").read_text())
    assert result["job"].startswith("demo-compute-")
    found = result["findings"]
    assert found and (found[0]["cause"], found[0]["ranks"]) == ("compute", [2]), run.stdout
    assert {"cause", "ranks", "hosts", "function", "confidence", "evidence"} <= set(found[0])
    assert 0 < found[0]["confidence"] <= 1 and "rank 2" in run.stdout
    # Beyond the fault, a finding is a false extra one, unless the machine itself slowed down, as
    # the fault suite judges it (a healthy demo's steps took up to 1.25x the CPU time by its end on a
    # shared 2-core runner). False extras are a rate, which the fault suite measures over its runs
    # and probes (3 at the end of ~150 kept runs): one run cannot assert it is 0 without failing at
    # that rate. On 4 ranks sharing 2 cores, a healthy rank's CPU time per step can wander 5-8% from
    # its peers' for seconds (the demo's run of 2026-11-29: rank 3, 1.07x since step 295, at 0.32).
    # What one run can assert: the fault comes first, surer than anything else found.
    extra = [f for f in found[1:] if f["cause"] != "job_wide" or not _machine_slowed(out)]
    assert len(extra) <= 1 and all(f["confidence"] < found[0]["confidence"] for f in extra), run.stdout
    assert (out / "report.html").stat().st_size > 5000

    # The same store through the other commands: diagnose gives the same JSON, and re-ingesting
    # the same spool adds nothing.
    again = json.loads(rankscope("diagnose", "--store", str(out / "store"), "--json").stdout)
    assert again["findings"] == result["findings"]
    assert again["job"] == result["job"]
    ing = rankscope("ingest", "--spool", str(out / "spool"), "--store", str(out / "store"))
    assert ing.stdout.startswith("ingested 0 records"), ing.stdout
    text = rankscope("diagnose", "--store", str(out / "store")).stdout
    assert text.startswith(f"rankscope diagnosis of job {result['job']}")


def test_cli_errors_say_what_to_do(tmp_path: Path) -> None:
    r = rankscope("diagnose", "--store", str(tmp_path / "nope"), check=False)
    assert r.returncode == 2 and "run `rankscope ingest` first" in r.stderr
    r = rankscope("ingest", "--spool", str(tmp_path / "nope"), "--store", str(tmp_path / "s"), check=False)
    assert r.returncode == 2 and "does not exist" in r.stderr
    r = rankscope("demo", "--fault", "meteor", check=False)
    assert r.returncode == 2 and "invalid choice" in r.stderr
    r = rankscope("demo", "--rank", "7", "--out", str(tmp_path / "d"), check=False)
    assert r.returncode != 0 and "--rank must be between 0 and 3" in r.stderr
