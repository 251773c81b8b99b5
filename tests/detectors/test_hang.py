"""``hang`` on hand-built heartbeats: the rank a stalled job waits for, and where it is."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from diagnosis import JobData, diagnose
from diagnosis.detectors import hang
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
