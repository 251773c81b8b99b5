"""The product end to end, as a user runs it: `rankscope demo`, then `rankscope ingest/diagnose`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CASES = [
    ("compute", 2, "compute"),
    ("code_path", 3, "code_path"),
    ("none", 0, None),
]
"""The demo's faults run as a user runs them; its dataloader fault, the same workload's, is the CI
fault suite's ``dataloader-15ms-r1`` (tests/test_faults.py), not run twice."""


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
    from aggregator import Store
    from benchmarks import machine
    from diagnosis import read_job

    with Store.embedded(out / "store") as store:
        steps = read_job(store, store.jobs()["job"].iloc[0]).steps
    return machine.slowed({"work": machine.work(steps)})


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "rank", "cause"), CASES)
def test_demo_names_the_injected_fault(tmp_path: Path, fault: str, rank: int, cause: str | None) -> None:
    out = tmp_path / "demo"
    run = rankscope("demo", "--fault", fault, "--rank", str(rank), "--seconds", "25", "--out", str(out))
    assert "[4/4] wrote" in run.stdout, run.stdout + run.stderr
    result = json.loads((out / "diagnosis.json").read_text())
    assert result["job"].startswith(f"demo-{fault}-")
    # Beyond the fault, a finding is false unless the machine itself slowed down, as the fault
    # suite judges it: on a shared 2-core runner, a healthy demo's same steps took up to 1.25x the
    # CPU time by its end, and all its ranks really did slow down together.
    found = result["findings"]
    extra = found if cause is None else found[1:]
    assert [f for f in extra if f["cause"] != "job_wide" or not _machine_slowed(out)] == [], run.stdout
    if not found:
        assert "no findings" in run.stdout
    if cause is not None:
        top = found[0]
        assert (top["cause"], top["ranks"]) == (cause, [rank]), run.stdout
        assert {"cause", "ranks", "hosts", "function", "confidence", "evidence"} <= set(top)
        assert 0 < top["confidence"] <= 1
        assert f"rank {rank}" in run.stdout
    assert (out / "report.html").stat().st_size > 5000
    if fault != "compute":
        return  # the other commands, once: each starts a Python process (~2-4 s here)

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
