"""``hang`` on hand-built heartbeats: the rank a stalled job waits for, and where it is."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from rankscope.diagnosis import JobData, diagnose
from rankscope.diagnosis.detectors import hang
from tests.jobdata import only, synthetic


def _hung(culprit: int = 2) -> pd.DataFrame:
    """Heartbeats of a 4-rank job stalled for 45 s: ``culprit`` never entered collective 42."""
    return pd.DataFrame(
        [
            {
                "rank": r,
                "time_us": 1_000_000_000,
                "step": 41,
                "progress_age_s": 45.0,
                "coll_group": "world",
                "coll_op": "all_reduce",
                "coll_seq": 42,
                "last_seq": {"world": 42},
                "stack": "",
            }
            for r in range(4)
            if r != culprit
        ]
        + [
            {
                "rank": culprit,
                "time_us": 1_000_000_000,
                "step": 41,
                "progress_age_s": 45.0,
                "coll_group": "",
                "coll_op": "",
                "coll_seq": -1,
                "last_seq": {"world": 41},
                "stack": (
                    '  File "/job/train.py", line 30, in main\n    save_checkpoint(model)\n'
                    '  File "/job/ckpt.py", line 7, in save_checkpoint\n    done.wait()\n'
                    '  File "/usr/lib/python3.11/threading.py", line 629, in wait\n    signaled = ...\n'
                    '  File "/venv/lib/python3.11/site-packages/x/y.py", line 3, in z\n    ...\n'
                ),
            }
        ]
    )


def test_hang_names_the_rank_that_never_entered_the_collective() -> None:
    hb = _hung()
    data = JobData(
        job="hung",
        ranks=pd.DataFrame({"rank": range(4), "host": ["a", "a", "b", "b"], "nic": "", "switch": ""}),
        heartbeats=hb,
    )
    f = only(hang.find(data, hang.Settings()))
    assert (f.cause, f.ranks, f.hosts) == ("hang", [2], ["b"])
    # The innermost frame of the job's own code, not the standard library's or a package's under it.
    assert f.function == 'File "/job/ckpt.py", line 7, in save_checkpoint'
    assert f.evidence["waiting_in"] == {"group": "world", "seq": 42}
    assert f.confidence >= 0.9


def test_a_rank_whose_gpu_fell_off_the_bus_hangs_with_its_xid_as_why() -> None:
    """Rank 2's GPU fell off the bus: its collective never completes; its heartbeats carried the
    XID NVML delivered (``Heartbeat.gpu_xids``), and the others' GPUs had none."""
    hb = _hung().assign(gpu_xids=[{}, {}, {}, {"xid_79": 1}])  # rank 2 is the last row
    hb.loc[hb["rank"] == 0, "gpu_xids"] = [{"xid_13": 1}]  # an application XID on a waiting rank
    data = JobData(job="hung", ranks=pd.DataFrame({"rank": range(4), "host": "a"}), heartbeats=hb)
    f = only(hang.find(data, hang.Settings()))
    assert f.ranks == [2]
    assert "rank 2's GPU since attach: XID 79 (GPU has fallen off the bus)" in f.summary
    assert f.evidence["gpu_xids"] == {"2": {"xid_79": 1}}, "only the culprits' GPUs"


def test_running_job_is_not_a_hang() -> None:
    hb = pd.DataFrame(
        [
            {
                "rank": r,
                "time_us": 10**9,
                "step": 5,
                "progress_age_s": 0.1,
                "coll_group": "",
                "coll_op": "",
                "coll_seq": -1,
                "last_seq": {"world": 5},
                "stack": "",
            }
            for r in range(4)
        ]
    )
    assert hang.find(JobData(job="ok", heartbeats=hb), hang.Settings()) == []


def test_a_hung_job_is_its_hang_alone() -> None:
    """A job that stopped has one thing to fix: what the other detectors read in its steps before
    it stopped (here a rank slower from step 150 on) is not reported beside the hang."""
    slow = synthetic(ranks=4, steps=300, hosts_of=2, slow={1: {"compute_us": 2000, "from": 150}})
    assert [f.ranks for f in diagnose(slow).findings] == [[1]], "the straggler alone is found"
    f = only(diagnose(replace(slow, heartbeats=_hung(culprit=2))).findings)
    assert (f.cause, f.ranks) == ("hang", [2])


def test_a_pipeline_hang_is_followed_along_the_waits_to_the_rank_that_waits_for_no_one() -> None:
    """A (dp=2, pp=2) job, rank 2 stuck in its checkpoint write: rank 3, its next stage, waits in
    ``recv`` from it; rank 0 in the all-gather of their data-parallel group that rank 2 never
    entered; rank 1 in its own group's, for rank 3. The numbers of different groups are not
    compared: rank 3's ``recv`` #101 names no one outside its pipeline."""

    def beat(rank: int, op: str = "", group: str = "", seq: int = -1, peer: int = -1, **last: int) -> dict:
        return {
            "rank": rank,
            "time_us": 10**9,
            "step": 60,
            "progress_age_s": 45.0,
            "coll_group": group,
            "coll_op": op,
            "coll_seq": seq,
            "coll_peer": peer,
            "last_seq": last,
            "stack": 'File "/job/train.py", line 9, in save_checkpoint' if rank == 2 else "",
        }

    hb = pd.DataFrame(
        [
            beat(0, "all_gather_into_tensor", "dp0", 51, dp0=51, pp0=100),
            beat(1, "all_gather_into_tensor", "dp1", 51, dp1=51, pp0=100),
            beat(2, dp0=50, pp1=100),
            beat(3, "recv", "pp1", 101, peer=2, dp1=50, pp1=101),
        ]
    )
    h = hang.locate(hb)
    assert h is not None and h.ranks == [2]
    assert h.evidence["waits_for"] == {"0": [2], "1": [3], "3": [2]}
    assert h.why == "rank 3 waits in recv #101 of group 'pp1' for rank(s) [2]"
    f = only(hang.find(JobData(job="pp", heartbeats=hb), hang.Settings()))
    assert (f.ranks, f.function) == ([2], 'File "/job/train.py", line 9, in save_checkpoint')


def test_a_rank_stuck_in_a_collective_its_peers_have_left_is_the_one_they_wait_for() -> None:
    """Rank 1 stopped with a collective launched from C++ counted (#41, its heartbeat's "c10d"
    call) that the others finished long ago; they wait in #42 for it."""
    hb = _hung(culprit=1)
    hb.loc[hb["rank"] == 1, ["coll_group", "coll_op", "coll_seq"]] = ["world", "c10d", 41]
    h = hang.locate(hb)
    assert h is not None and h.ranks == [1] and h.seq == 42
