"""The diagnosis as a whole: a healthy job, stragglers rolled up by host, switch and spine, the
findings' contract, what the records do not say, and recorded real runs. Each detector's rules are
tested in ``tests/detectors/``, how a straggler's function is named in ``tests/detectors/straggler/``."""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from rankscope.aggregator import Store, ingest
from rankscope.diagnosis import CAUSES, Finding, JobData, diagnose, read_job
from tests.jobdata import only, synthetic

FIXTURES = Path(__file__).parent / "fixtures"


def test_healthy_synthetic_job_has_no_findings() -> None:
    for seed in range(5):
        assert diagnose(synthetic(seed=seed)).findings == []


def test_host_contention_from_preemption_signals() -> None:
    data = synthetic(slow={1: {"compute_us": 1500, "nivcsw": 40, "cpu": 0.5}})
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks) == ("host_contention", [1])


def test_all_ranks_of_a_host_become_one_host_finding() -> None:
    data = synthetic(slow={2: {"compute_us": 1500}, 3: {"compute_us": 1500}})
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.hosts, f.scope) == ("compute", [2, 3], ["node1"], "host")


def test_stragglers_that_make_up_a_spine_become_one_finding_naming_it() -> None:
    # 16 hosts of one rank, two hosts per leaf switch, two leaves per spine; spine s1's 4 ranks slow.
    data = synthetic(ranks=16, hosts_of=16, slow={r: {"compute_us": 3000} for r in range(4, 8)})
    leaves = data.ranks.assign(switch=[f"sw{r // 2}" for r in range(16)])
    assert [(f.scope, f.ranks) for f in diagnose(replace(data, ranks=leaves)).findings] == [
        ("switch", [4, 5]),
        ("switch", [6, 7]),
    ]
    spines = leaves.assign(spine=[f"s{r // 4}" for r in range(16)])
    f = only(diagnose(replace(data, ranks=spines)).findings)
    assert (f.cause, f.scope, f.ranks, f.evidence["spine"]) == ("compute", "spine", [4, 5, 6, 7], "s1")


def test_findings_validate_their_contract() -> None:
    with pytest.raises(ValueError, match="unknown cause"):
        Finding(cause="gremlins", ranks=[1], hosts=[], function="x", confidence=0.5, summary="")
    with pytest.raises(ValueError, match="confidence"):
        Finding(cause="compute", ranks=[1], hosts=[], function="x", confidence=1.5, summary="")
    assert CAUSES == (
        "compute",
        "communication",
        "dataloader",
        "host_contention",
        "code_path",
        "hang",
        "job_wide",
        "failure",
    )


# --- recorded real runs: 4 gloo ranks, 15 s each (tests/fixtures/record.py) ----------------------

RECORDED = {
    "compute-r2": ("compute", [2]),
    "dataloader-r1": ("dataloader", [1]),
    "code_path-r3": ("code_path", [3]),
    "healthy": None,
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, JobData]]:
    """The recorded spools, ingested through the real store (chDB) and read back (the store open:
    the diagnosis reads the functions of the ranks it names)."""
    root = tmp_path_factory.mktemp("recorded")
    spool = root / "spool"
    for job in RECORDED:
        (spool / job).mkdir(parents=True)
        for gz in (FIXTURES / job).glob("*.jsonl.gz"):
            (spool / job / gz.name.removesuffix(".gz")).write_bytes(gzip.decompress(gz.read_bytes()))
    with Store.embedded(root / "store") as store:
        stats = ingest(spool, store)
        assert stats.dead_letters == 0
        shutil.rmtree(spool)
        yield {job: read_job(store, job) for job in RECORDED}


@pytest.mark.parametrize("job", list(RECORDED))
def test_recorded_runs(recorded: dict[str, JobData], job: str) -> None:
    data = recorded[job]
    assert data.steps["rank"].nunique() == 4 and not data.spans().empty
    d = diagnose(data)
    json.dumps(d.to_dict())  # the JSON contract: serializable as is
    if RECORDED[job] is None:
        assert d.findings == []
        return
    top = d.findings[0]
    assert (top.cause, top.ranks) == RECORDED[job]
    assert top.hosts == ["node1" if top.ranks[0] >= 2 else "node0"]
    assert len(d.findings) == 1


def test_what_some_ranks_hooks_do_not_see_is_said_in_one_line_with_the_ranks() -> None:
    from rankscope.renderers.text import format_diagnosis

    full = "torch.distributed calls (plain, FSDP, FSDP2, pipelining, DTensor): timed; DDP Net on world: timed per backward pass"
    untested = "backend mpi: untested (counts and waits as the CPU sees them)"
    untimed = "DDP Head on 3: not tracked (RuntimeError: no engine)"
    ranks = pd.DataFrame(
        {
            "rank": [0, 1, 2],
            "host": ["h"] * 3,
            "coverage": [full, f"{full}; {untested}", f"{full}; {untimed}; {untested}"],
        }
    )
    d = diagnose(JobData(job="j", ranks=ranks))
    assert d.analyzed["coverage_gaps"] == [f"{untimed} (rank 2)", f"{untested} (ranks 1, 2)"]
    assert d.findings == []
    said = [line for line in format_diagnosis(d).splitlines() if "not seen" in line]
    assert said == [f"  not seen by the hook: {untimed} (rank 2); {untested} (ranks 1, 2)"]
    assert "coverage_gaps" not in diagnose(JobData(job="j", ranks=ranks.assign(coverage=full))).analyzed


def test_records_that_never_reached_the_store_are_said_in_one_line_with_the_ranks(tmp_path: Path) -> None:
    from rankscope.renderers.html import write_report
    from rankscope.renderers.text import format_diagnosis

    missing = pd.DataFrame({"rank": [2, 5], "pid": [40, 41], "made": [1000, 200], "stored": [990, 199]})
    d = diagnose(JobData(job="j", missing=missing))
    assert d.analyzed["records_missing"] == "11 of 1,200 records (ranks 2, 5)"
    said = [line for line in format_diagnosis(d).splitlines() if "never stored" in line]
    assert said == [
        "  never stored (dropped by the hook or lost on the way): 11 of 1,200 records (ranks 2, 5)"
    ]
    page = write_report(tmp_path / "report.html", d, JobData(job="j", missing=missing)).read_text()
    assert "Never stored (dropped by the hook or lost on the way): 11 of 1,200 records (ranks 2, 5)" in page
    assert "records_missing" not in diagnose(JobData(job="j")).analyzed
