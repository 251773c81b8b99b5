"""``straggler`` on hand-built jobs: the rank that holds the job back, by its own time or by its
threads' wait for a CPU, and never a rank that only waits for it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from diagnosis import JobData, stragglers
from diagnosis.detectors import straggler
from tests.jobdata import functions_frame, only, sched_windows, synthetic

SETTINGS = straggler.Settings()


def test_compute_straggler_is_named_not_the_ranks_that_wait_for_it() -> None:
    data = synthetic(slow={5: {"compute_us": 1500}})
    ops = [("op", "aten::addmm", 15, 10_000.0), ("op", "aten::relu", 10, 2_000.0)]
    slow_ops = [("op", "aten::addmm", 15, 20_000.0), ("op", "aten::relu", 10, 2_100.0)]
    data = replace(data, functions=functions_frame({r: slow_ops if r == 5 else ops for r in range(8)}))
    f = only(straggler.find(data, SETTINGS))
    assert (f.cause, f.ranks, f.hosts, f.function) == ("compute", [5], ["node2"], "aten::addmm")
    # The wait inversion: the culprit waits least in the collective.
    assert f.evidence["collective_wait_ms"] < f.evidence["peer_collective_wait_ms"]
    assert f.evidence["ratio"] > 1.2
    assert f.evidence["operator_ratio"] == pytest.approx(2.0)
    assert 0.5 < f.confidence <= 1


def test_threads_that_queue_on_a_rank_the_job_does_not_wait_for_are_no_finding() -> None:
    """Every rank waits for rank 1's slower device; rank 5's threads queue 4 ms a step for a CPU
    (shared cores), but it waits in the collectives as long as the others: it holds no one back."""
    data = synthetic(slow={1: {"compute_us": 1500}})
    f = only(straggler.find(replace(data, functions=sched_windows({5: 4.0})), SETTINGS))
    assert (f.cause, f.ranks) == ("compute", [1])
    # With no straggler to wait for, the same queueing is what the job waits for.
    f = only(straggler.find(replace(synthetic(), functions=sched_windows({5: 4.0})), SETTINGS))
    assert (f.cause, f.ranks) == ("host_contention", [5])


def test_a_rank_that_waits_longer_than_its_peers_is_not_their_straggler() -> None:
    """Rank 5's own time reads 1.3x its peers', but it also waits longer in the collectives than
    they do (part of its wait counted as its own work): the job does not wait for it."""
    data = synthetic(slow={5: {"compute_us": 1500}})
    st = data.steps.copy()
    mine = st["rank"] == 5
    longer = st.loc[~mine, "comm_us"].max() + 500 - st.loc[mine, "comm_us"]
    st.loc[mine, "comm_us"] += longer
    st.loc[mine, "dur_us"] += longer  # its own time unchanged
    assert 5 in {r.rank for r in stragglers.find(st)}  # its own time alone would name it
    assert straggler.find(replace(data, steps=st), SETTINGS) == []


def test_the_ranks_that_wait_for_a_contended_host_are_no_straggler_of_their_own() -> None:
    """Hogs on node1's core: its ranks' threads queue for a CPU, and every rank waits for them.
    node0's ranks arrive first and wait in the collectives longest, though part of their wait
    shows as own time (1.5 ms a step more than node1's): no compute finding beside node1's."""
    data = synthetic(ranks=4, hosts_of=2)
    st = data.steps.copy()
    late = st["step"] >= 50
    hogged, waiting = late & st["rank"].isin([2, 3]), late & st["rank"].isin([0, 1])
    st.loc[late, "dur_us"] += 3000
    st.loc[hogged, "wait_us"] += 2000
    st.loc[hogged, "comm_us"] += 1000
    st.loc[waiting, "comm_us"] += 1500
    waits = sched_windows({2: 3.4, 3: 3.2}, base_ms=1.4, ranks=4)
    data = replace(data, steps=st, functions=waits)
    assert {r.rank for r in stragglers.find(st)} == {0, 1}  # their own time alone would name them
    found = straggler.find(data, SETTINGS)
    assert [(f.cause, f.ranks, f.hosts) for f in found] == [
        ("host_contention", [r], ["node1"]) for r in (2, 3)
    ]
    # Ranks that wait the least hold the job back, whoever else queues: node0's, now arriving last.
    st.loc[waiting, "comm_us"] -= 2500
    assert [f.ranks for f in straggler.find(replace(data, steps=st), SETTINGS)] == [[0], [1]]


def _in_buckets(data: JobData, width: int) -> JobData:
    """``data`` with its steps as a store reads a large job's: per rank and bucket of ``width``
    steps, their means (``Reads.steps(width=)``)."""
    s = data.steps
    b = s.assign(step=s["step"] // width * width)
    means = {c: "min" if c == "start_us" else "mean" for c in s.columns if c not in ("rank", "step")}
    out = b.groupby(["rank", "step"], as_index=False).agg(means)
    return replace(data, steps=out.assign(**{stragglers.WIDTH: width}))


@pytest.mark.parametrize(
    ("slow", "steps", "cause"),
    [
        ({6: {"compute_us": 1500}}, 300, "compute"),
        ({5: {"data_us": 3000}}, 300, "dataloader"),
        ({2: {"compute_us": 1500, "from": 700}}, 1400, "compute"),  # the change-point rule's
        ({3: {"compute_us": 6000, "on": 40, "off": 80}}, 1200, "compute"),  # in bursts
    ],
)
def test_a_large_jobs_steps_read_in_buckets_name_the_same_straggler(
    slow: dict[int, dict[str, float]], steps: int, cause: str
) -> None:
    """Read in buckets of 4 or 8 steps, the rank, the cause and how long it held are those of
    the steps read one by one (blocks of steps, as the hooks ship them, are as wide)."""
    data = synthetic(16, steps, slow=slow, hosts_of=2)
    f = only(straggler.find(data, SETTINGS))
    assert (f.cause, f.ranks) == (cause, list(slow))
    for width in (4, 8):
        g = only(straggler.find(_in_buckets(data, width), SETTINGS))
        assert (g.cause, g.ranks) == (f.cause, f.ranks), width
        assert g.evidence["ratio"] == pytest.approx(f.evidence["ratio"], rel=0.05), width
        assert abs(g.evidence["held_since_step"] - f.evidence["held_since_step"]) <= steps // 10, width
