"""``hang`` on hand-built heartbeats: the rank a stalled job waits for, and where it is."""

from __future__ import annotations

import pandas as pd

from diagnosis import JobData
from diagnosis.detectors import hang
from tests.jobdata import only


def test_hang_names_the_rank_that_never_entered_the_collective() -> None:
    hb = pd.DataFrame(
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
            for r in (0, 1, 3)
        ]
        + [
            {
                "rank": 2,
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
