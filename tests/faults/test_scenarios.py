"""The suite's scenarios: every file loads and the CI suite is small, a bad scenario or fault setting
is refused with its field; and the reduced suite on real jobs (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.faults.catalogue import Fault
from benchmarks.faults.scenarios import ScenarioError, load, load_all

CLEAR_CUT = ("compute", "dataloader", "hang-collective")
"""Fault kinds the diagnosis localizes today; the CI run asserts on these and reports the rest."""


def test_every_scenario_file_loads_and_the_ci_suite_is_small() -> None:
    full = load_all("full")
    assert len(full) >= 15
    kinds = {s.fault.kind for s in full}
    assert kinds >= {
        "none",
        "compute",
        "dataloader",
        "host",
        "nic",
        "switch",
        "hang",
        "code_path",
        "job_wide",
    }
    ci = load_all("ci")
    assert 3 <= len(ci) <= 6 and any(s.truth.healthy for s in ci)
    # The validation split: its own scenarios, healthy ones among them, none of the tuning set's.
    held_out = load_all("validation")
    assert (
        held_out and {s.split for s in held_out} == {"validation"} and {s.split for s in full} == {"tuning"}
    )
    assert any(s.truth.healthy for s in held_out) and not {s.name for s in held_out} & {s.name for s in full}
    # The soak suite: healthy jobs of many minutes, in none of the others.
    soak = load_all("soak")
    assert soak and all(s.split == "soak" and s.truth.healthy and s.seconds >= 600 for s in soak)
    assert not {s.name for s in soak} & {s.name for s in full + held_out}


def test_a_bad_scenario_is_refused_with_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "world_size: 4\nfault: {kind: compute, rank: 9, onset_s: 5}\nexpect: {cause: compute, ranks: [9]}\n"
    )
    with pytest.raises(ScenarioError, match="outside"):
        load(bad)
    bad.write_text("fault: {kind: nic, rank: 1}\nexpect: {cause: communication, ranks: [1]}\n")
    with pytest.raises(ScenarioError, match="rate_mbit"):
        load(bad)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reduced_suite_on_real_jobs(tmp_path: Path) -> None:
    from benchmarks.faults.suite import report, run_suite

    out = run_suite(load_all("ci"), tmp_path)
    print(report(out["scenarios"]))
    ran = [r for r in out["scenarios"] if "skipped" not in r]
    assert ran, out["skipped"]
    for r in ran:
        assert not r["error"], (r["name"], r["error"])
        assert not r["cleanup_errors"], (r["name"], r["cleanup_errors"])
        s = r["score"]
        if s["healthy"]:
            # Findings are explained (not false) when the harness measured the machine itself slow down.
            assert s["false_findings"] == 0, (r["name"], r["machine"], [d["summary"] for d in s["detail"]])
            # ...and at every probe as ``rankscope serve`` diagnoses it, nobody would be paged.
            a = r["alarms"]
            assert a["false_tickets"] == 0 or a["excused"], (r["name"], r["machine"], r["probes"])
        elif r["kind"] in CLEAR_CUT:
            # The whole diagnosis, evidence and all, so that a wrong answer in CI can be understood.
            assert s["top_correct"], (r["name"], r["ground_truth"], json.dumps(r["diagnosis"], indent=1))
            assert r["delays"]["localize_s"] is not None, r["name"]
    totals = out["totals"]
    assert totals["healthy_false_findings"] == 0
    assert set(totals) >= {"top1_accuracy", "precision", "recall", "healthy_false_findings"}
    # The kept runs scored again (--rescore) give the same scores and delays as when they ran.
    again = run_suite(load_all("ci"), tmp_path, rescore=True)
    assert [
        (r["name"], r["score"], r["delays"], r["alarms"]) for r in again["scenarios"] if "skipped" not in r
    ] == [(r["name"], r["score"], r["delays"], r["alarms"]) for r in ran]


def test_fault_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        Fault(kind="cosmic-ray")
