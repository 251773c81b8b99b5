"""Host contention on hand-built jobs: a rank whose threads wait for a CPU is named though it works no
longer, the ranks that wait for it are not, and chance queueing in a window or two is no finding."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd

from rankscope.diagnosis import diagnose
from rankscope.diagnosis.detectors import straggler
from rankscope.diagnosis.detectors.straggler import contention
from rankscope.diagnosis.detectors.straggler.peers import slower_than_peers
from tests.jobdata import only, sched_windows, synthetic

SETTINGS = straggler.Settings()


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
    assert 5 in {r.rank for r in slower_than_peers(st)}  # its own time alone would name it
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
    assert {r.rank for r in slower_than_peers(st)} == {0, 1}  # their own time alone would name them
    found = straggler.find(data, SETTINGS)
    assert [(f.cause, f.ranks, f.hosts) for f in found] == [
        ("host_contention", [r], ["node1"]) for r in (2, 3)
    ]
    # Ranks that wait the least hold the job back, whoever else queues: node0's, now arriving last.
    st.loc[waiting, "comm_us"] -= 2500
    assert [f.ranks for f in straggler.find(replace(data, steps=st), SETTINGS)] == [[0], [1]]


def test_a_rank_whose_threads_queue_for_the_cpu_is_named_though_it_works_no_longer() -> None:
    data = synthetic()  # no rank works longer: the contended rank's collective threads fall behind
    f = only(diagnose(replace(data, functions=sched_windows({3: 4.0}))).findings)
    assert (f.cause, f.ranks, f.hosts, f.function) == (
        "host_contention",
        [3],
        ["node1"],
        "(threads waiting for a CPU)",
    )
    assert f.evidence["cpu_wait_ms_per_step"] == 4.0 and f.evidence["windows_flagged"] == "4/4"
    # A wait that stands out (3x) but is a small part of a ~5.3 ms step cannot hold the job back.
    assert diagnose(replace(data, functions=sched_windows({3: 0.6}, base_ms=0.2))).findings == []
    # A straggler whose extra own time is CPU wait, not CPU work, is contended, not a slow device.
    waits = sched_windows({5: 3.0})
    f = only(
        diagnose(replace(synthetic(slow={5: {"compute_us": 1500, "cpu": 0.5}}), functions=waits)).findings
    )
    assert (f.cause, f.ranks) == ("host_contention", [5])
    # With the extra time spent computing, the wait is its threads queueing behind its own work.
    f = only(diagnose(replace(synthetic(slow={5: {"compute_us": 1500}}), functions=waits)).findings)
    assert (f.cause, f.ranks) == ("compute", [5])
    # A rank whose threads wait 4 ms a step for a CPU and that works a little longer too (1.14x: a
    # hogged host slows its work as well) is contended: the surer of its two accounts.
    mild = synthetic(slow={3: {"compute_us": 700}})
    assert [st.rank for st in slower_than_peers(mild.steps)] == [3]
    f = only(diagnose(replace(mild, functions=sched_windows({3: 4.0}))).findings)
    assert (f.cause, f.ranks) == ("host_contention", [3])
    # A rank whose reads sleep 10 ms a batch uses the CPU for a third of its own time, and on
    # shared cores its threads may queue longer in some windows: it waits for data, not for a CPU.
    reads = synthetic(slow={5: {"data_us": 10_000}})
    f = only(diagnose(replace(reads, functions=sched_windows({5: 9.0}))).findings)
    assert (f.cause, f.ranks) == ("dataloader", [5])


def test_a_rank_that_sleeps_in_its_own_code_is_that_code_path_though_its_threads_queue_too() -> None:
    """Rank 5 sleeps 3 ms a step in a metrics upload only it makes: it uses the CPU for half its own
    time, and its threads queue 2 ms a step longer than its peers' (the others run meanwhile). The
    upload holds more of its excess than the queueing: a code path. Rank 0's threads queue 3 ms
    longer too, but rank 0 waits in the collectives as long as the others: nobody waits for it."""
    data = synthetic(slow={5: {"compute_us": 3000, "cpu": 0.5}})
    up = "train.py(40): upload_metrics"
    upload = pd.DataFrame(
        [
            {"rank": 5, "window": w, "step_lo": 50 + 50 * w, "step_hi": 60 + 50 * w, "kind": "python"}
            | {"name": up, "stack": "train.py(80): train_step", "count": 10, "total_us": 30_000.0}
            | {"mean_us": 3000.0, "p50_us": 3000.0, "max_us": 3000.0}
            for w in range(4)
        ]
    )
    # Its threads' wait, summed over them, can exceed the time the upload holds (a code path
    # that works, on shared cores, queues its threads): here ~4 ms a step beyond its peers', the
    # upload 3. An upload that holds half the excess or more is the account.
    for waits in ({5: 3.0}, {5: 3.0, 0: 4.0}, {5: 5.0}):
        functions = pd.concat([sched_windows(waits), upload], ignore_index=True)
        f = only(diagnose(replace(data, functions=functions)).findings)
        assert (f.cause, f.ranks, f.function) == ("code_path", [5], up)
    # Without the upload in its windows, the queueing is the account of its excess.
    f = only(diagnose(replace(data, functions=sched_windows({5: 3.0}))).findings)
    assert (f.cause, f.ranks) == ("host_contention", [5])


def test_both_ranks_of_a_contended_host_of_two_are_named_though_they_lift_the_median() -> None:
    """Two of four ranks contended (one host of two): the median of all four sits between them and
    the others, so one of them stands out by less than ``min_ratio``; measured against the ranks
    not found, both do, and they make up the host."""
    data = synthetic(ranks=4, hosts_of=2)
    waits = sched_windows({0: 3.2, 1: 3.4}, base_ms=1.4, ranks=4)
    f = only(diagnose(replace(data, functions=waits)).findings)
    assert (f.cause, f.ranks, f.hosts) == ("host_contention", [0, 1], ["node0"])
    # One contended rank of four: the others are not measured against each other and named.
    f = only(diagnose(replace(data, functions=sched_windows({1: 3.4}, base_ms=1.4, ranks=4))).findings)
    assert (f.cause, f.ranks) == ("host_contention", [1])


def _waits(per_window: list[list[float]]) -> pd.DataFrame:
    """``cpu_wait@sched`` rows: each window's wait per step (ms) of ranks 0, 1, ..."""
    rows = sched_windows({}, ranks=len(per_window[0]), windows=len(per_window))
    return rows.assign(total_us=[10_000 * ms for w in per_window for ms in w])


def test_a_healthy_rank_whose_threads_queue_longest_in_two_windows_running_is_chance_not_contention() -> None:
    """Four ranks on two shared cores: every rank's threads wait most of a step for a CPU, each
    rank's 0.2-5x the others' from one window to the next. A 20-minute healthy job's rank 3 waited
    1.77x and 1.52x the median in two windows running, at 108 s (a 1 in 28 chance among four
    ranks): named contended, and a ticket opened. Against the other ranks' windows, it is chance."""
    data = synthetic(ranks=4, hosts_of=2)
    soak = [
        [63.9, 49.8, 41.3, 26.5],
        [25.9, 43.7, 41.0, 40.3],
        [23.8, 74.1, 53.1, 112.3],
        [27.6, 44.8, 8.5, 55.0],
    ]
    assert straggler.find(replace(data, functions=_waits(soak)), SETTINGS) == []
    # Its threads queueing 2-3x the others' in each of six windows is no chance.
    rng = np.random.default_rng(0)
    hogged = [[*rng.uniform(20, 60, 3), 150.0] for _ in range(6)]
    f = only(straggler.find(replace(data, functions=_waits(hogged)), SETTINGS))
    assert (f.cause, f.ranks) == ("host_contention", [3])


def test_a_host_whose_training_threads_queue_for_a_cpu_at_every_step_is_found_before_any_window() -> None:
    """Hogs on node1's cores from step 100: its ranks' training threads wait 3 ms a step for a
    CPU where node0's wait 1 (every step says so, always on: no window needed), and node0's
    ranks wait for them in the collectives. Healthy ranks' waits swing 1.5x from chunk to chunk:
    no finding."""
    data = synthetic(ranks=4, hosts_of=2, steps=900)
    st = data.steps.copy()
    rng = np.random.default_rng(1)
    st["wait_us"] = 1000 * rng.lognormal(0, 0.3, len(st)) * np.where(st["step"] % 300 < 150, 1.0, 1.5)
    assert straggler.find(replace(data, steps=st), SETTINGS) == []
    hogged = (st["step"] >= 100) & st["rank"].isin([2, 3])
    st.loc[hogged, "wait_us"] *= 3
    st.loc[hogged, "dur_us"] += 2000
    st.loc[(st["step"] >= 100) & ~st["rank"].isin([2, 3]), "comm_us"] += 2000
    st.loc[(st["step"] >= 100) & ~st["rank"].isin([2, 3]), "dur_us"] += 2000
    found = straggler.find(replace(data, steps=st), SETTINGS)
    assert [(f.cause, f.ranks, f.hosts, f.evidence["chunks_flagged"]) for f in found] == [
        ("host_contention", [r], ["node1"], "6/6") for r in (2, 3)
    ]
    assert "training thread waits" in found[0].summary
    # A job of many hosts measures each rank against the job's median: one host of 32 is hogged.
    data = synthetic(ranks=64, hosts_of=32, steps=300)
    st = data.steps.assign(wait_us=1000 * np.random.default_rng(2).lognormal(0, 0.3, len(data.steps)))
    st.loc[st["rank"].isin([10, 11]), "wait_us"] *= 3
    assert [(c.rank, c.measured) for c in contention.find(data.functions, st, hosts=data.hosts())] == [
        (10, "steps"),
        (11, "steps"),
    ]


def test_a_pipeline_stage_that_waits_longer_for_a_cpu_by_design_is_no_contended_host() -> None:
    """DeepSpeed lays a pipeline out stage-major: on two hosts each holds one stage, whose ranks
    wait for a CPU differently by design (here the first stage's 3x the second's, every step).
    Compared host with host, that is a contended host; compared within each stage, nothing. A
    hogged host is still named where each stage has ranks on both."""
    data = synthetic(ranks=8, hosts_of=2, steps=900)
    st = data.steps.assign(wait_us=1000 * np.random.default_rng(3).lognormal(0, 0.3, len(data.steps)))
    first = st["rank"] < 4  # node0's ranks
    st.loc[first, "wait_us"] *= 3
    staged = replace(data, steps=st, ranks=data.ranks.assign(mesh=[{"pp": r // 4} for r in range(8)]))
    assert [f.ranks for f in straggler.find(replace(staged, ranks=data.ranks), SETTINGS)] == [
        [r] for r in range(4)
    ]
    assert straggler.find(staged, SETTINGS) == []
    interleaved = replace(staged, ranks=data.ranks.assign(mesh=[{"pp": r % 2} for r in range(8)]))
    found = straggler.find(interleaved, SETTINGS)
    assert [(f.cause, f.ranks, f.hosts) for f in found] == [
        ("host_contention", [r], ["node0"]) for r in range(4)
    ]
