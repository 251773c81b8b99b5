"""The synthetic cluster generator and the diagnosis on it: every fault kind at 2,000 ranks."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from benchmarks.scale.cluster import FAULTS, ClusterSpec, generate, score, summarize
from rankscope.diagnosis import Finding, diagnose
from rankscope.diagnosis.data import FUNCTION_FIELDS, HEARTBEAT_FIELDS, STEP_FIELDS
from rankscope.diagnosis.topology import group as group_topology

RANKS = 2000


@pytest.mark.parametrize("fault", [f for f in FAULTS if f != "none"])
def test_each_fault_is_the_top_finding(fault: str) -> None:
    case = generate(ClusterSpec(ranks=RANKS, fault=fault, seed=1))
    d = diagnose(case.data)
    json.dumps(d.to_dict())  # the JSON contract holds at scale too
    assert d.findings, f"{fault}: no finding"
    top, t = d.findings[0], case.truth
    assert top.cause == t.cause
    assert sorted(top.ranks) == t.ranks
    assert score(d, t)["correct"]
    assert top.confidence >= 0.5
    if fault in ("host", "contention"):
        assert (top.scope, top.hosts) == ("host", [t.where])
    if fault == "nic":
        assert top.scope == "nic" and top.evidence["nic"] == t.where and len(top.ranks) == 2
    if fault == "switch":
        assert top.scope == "switch" and top.evidence["switch"] == t.where and len(top.ranks) == 256
    if fault in ("compute", "dataloader", "hang"):
        assert top.scope == "rank" and len(top.ranks) == 1
    # Nothing else is blamed: the fault is one finding.
    assert len(d.findings) == 1, [f.summary for f in d.findings]


@pytest.mark.parametrize("seed", range(3))
def test_healthy_cluster_has_no_findings(seed: int) -> None:
    case = generate(ClusterSpec(ranks=RANKS, seed=seed))
    assert case.truth.cause is None and case.truth.ranks == []
    assert diagnose(case.data).findings == []


def test_generated_frames_look_like_the_stores() -> None:
    case = generate(ClusterSpec(ranks=RANKS, fault="host", seed=3))
    data = case.data
    assert list(data.steps.columns) == STEP_FIELDS
    assert set(FUNCTION_FIELDS) <= set(data.functions.columns)
    assert list(data.heartbeats.columns) == HEARTBEAT_FIELDS
    assert len(data.steps) == RANKS * 60 and data.steps["rank"].nunique() == RANKS
    assert data.functions.groupby(["rank", "window"]).size().eq(33).all()  # two windows
    # Topology: 8 ranks per host, 2 per NIC, 32 hosts per switch.
    ranks = data.ranks
    assert ranks.groupby("host").size().eq(8).all()
    assert ranks.groupby("nic").size().eq(2).all()
    assert ranks.groupby("switch")["host"].nunique().max() == 32
    # The truth names the host whose 8 ranks are slow, from the onset step on.
    t = case.truth
    assert len(t.ranks) == 8 and set(ranks.loc[ranks["rank"].isin(t.ranks), "host"]) == {t.where}
    own = (data.steps["dur_us"] - data.steps["comm_us"]).to_numpy().reshape(RANKS, 60)
    before = np.median(own[t.ranks, : t.onset_step]) / np.median(own[:, : t.onset_step])
    after = np.median(own[t.ranks, t.onset_step :]) / np.median(own[:, t.onset_step :])
    assert before == pytest.approx(1.0, abs=0.05) and after == pytest.approx(1.3, abs=0.05)


def test_generation_is_deterministic_per_seed() -> None:
    a, b = (generate(ClusterSpec(ranks=RANKS, fault="compute", seed=7)) for _ in range(2))
    pd.testing.assert_frame_equal(a.data.steps, b.data.steps)
    pd.testing.assert_frame_equal(a.data.functions, b.data.functions)
    assert a.truth == b.truth
    assert generate(ClusterSpec(ranks=RANKS, fault="compute", seed=8)).truth.ranks != a.truth.ranks


def test_a_slow_nic_changes_no_ranks_own_time_only_its_transfer() -> None:
    """The case the step rows cannot see: every rank waits alike for the slowest link."""
    case = generate(ClusterSpec(ranks=RANKS, fault="nic", seed=2))
    steps, f = case.data.steps, case.data.functions
    own = (steps["dur_us"] - steps["comm_us"]).groupby(steps["rank"]).median()
    assert own[case.truth.ranks].median() / own.median() == pytest.approx(1.0, abs=0.05)
    send = f[f["name"] == "net_send@world"].set_index("rank")
    per_byte = send["total_us"] / send["nbytes"]
    assert per_byte[case.truth.ranks].min() > 2 * per_byte.median()
    # Without the transfer pattern the fault is invisible: no finding rather than a wrong one.
    blind = replace(case.data, functions=f[f["name"] != "net_send@world"])
    assert diagnose(blind).findings == []


def test_wrapped_collectives_that_include_waiting_are_not_read_as_slow_links() -> None:
    """A rank that arrives early waits longest inside all_reduce: its time per byte is high, its link fine."""
    case = generate(ClusterSpec(ranks=RANKS, seed=4))
    f = case.data.functions.copy()
    early = (f["rank"] == 17) & (f["name"] == "all_reduce@world")
    f.loc[early, ["total_us", "mean_us", "p50_us"]] *= 3
    assert diagnose(replace(case.data, functions=f)).findings == []
    # The same excess in the transfer pattern is a slow link.
    f = case.data.functions.copy()
    f.loc[(f["rank"] == 17) & (f["name"] == "net_send@world"), ["total_us", "mean_us", "p50_us"]] *= 3
    top = diagnose(replace(case.data, functions=f)).findings[0]
    assert (top.cause, top.ranks, top.function) == ("communication", [17], "net_send@world")
    assert top.evidence["ratio"] == pytest.approx(3.0, rel=0.1)


def _single(rank: int, host: str, cause: str = "communication") -> Finding:
    return Finding(
        cause=cause,
        ranks=[rank],
        hosts=[host],
        function="net_send@world",
        confidence=0.9,
        summary="",
        evidence={},
    )


def test_topology_merges_nic_then_host_then_switch() -> None:
    ranks = pd.DataFrame(
        {
            "rank": range(16),
            "host": [f"h{r // 4}" for r in range(16)],
            "nic": [f"h{r // 4}-nic{r % 4 // 2}" for r in range(16)],
            "switch": [f"sw{r // 8}" for r in range(16)],
        }
    )
    # All of switch sw0 (hosts h0, h1) plus one NIC of h2: one switch finding and one NIC finding.
    found = [_single(r, f"h{r // 4}") for r in [*range(8), 8, 9]]
    merged = sorted(group_topology(found, ranks), key=lambda f: f.scope)
    assert [(f.scope, f.ranks) for f in merged] == [("nic", [8, 9]), ("switch", list(range(8)))]
    assert merged[1].hosts == ["h0", "h1"] and sorted(merged[1].evidence["per_rank"]) == list(range(8))
    # A compute culprit pair is not a NIC's fault: only whole hosts merge for compute.
    compute = [_single(r, "h2", "compute") for r in (8, 9)]
    assert [f.scope for f in group_topology(compute, ranks)] == ["rank", "rank"]


def test_summary_counts_misses_and_false_findings() -> None:
    rows = [
        {"ranks": 1000, "fault": "none", "latency_s": 0.1, "correct": False, "findings": 2},
        {"ranks": 1000, "fault": "compute", "latency_s": 0.3, "correct": True, "findings": 1},
        {"ranks": 1000, "fault": "hang", "latency_s": 0.2, "correct": False, "findings": 0},
    ]
    s = summarize(rows)
    assert s["top1_accuracy"] == 0.5 and s["healthy_false_findings"] == 2
    assert s["latency_s"] == {"1000": 0.2} and s["accuracy_by_fault"] == {"compute": 1.0, "hang": 0.0}


def test_spec_refuses_what_it_cannot_generate() -> None:
    with pytest.raises(ValueError, match="fault must be one of"):
        ClusterSpec(fault="gremlins")
    with pytest.raises(ValueError, match="onset_step"):
        ClusterSpec(onset_step=55)
