"""``failure`` on hand-built exit records: the rank that failed first, its class, and no one else."""

from __future__ import annotations

import pandas as pd

from rankscope.diagnosis import JobData, diagnose
from rankscope.diagnosis.detectors import failure
from tests.jobdata import only

T = 1_800_000_000_000_000
FRAME = "train.py(80): train_step @95"


def _exit(
    rank: int,
    dt_s: float,
    how: str,
    error: str = "",
    message: str = "",
    signal: int = 0,
    attempt: int = 0,
    gpu: dict[str, int] | None = None,
) -> dict:
    return {
        "rank": rank,
        "host": f"node{rank // 2}",
        "pid": 100 + rank,
        "attempt": attempt,
        "how": how,
        "step": 100,
        "error": error,
        "message": message,
        "frame": FRAME if how == "exception" else "",
        "signal": signal,
        "gpu": gpu or {},
        "time_us": T + int(dt_s * 1e6),
    }


RANKS = pd.DataFrame(
    {"rank": range(4), "host": [f"node{r // 2}" for r in range(4)], "time_us": T - 60_000_000}
)
PEER = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500"


def _beats(last_s: dict[int, float], xids: dict[int, dict[str, int]] | None = None) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"rank": r, "time_us": T + int(t * 1e6), "step": 99, "progress_age_s": 0.1, "coll_group": "",
             "coll_op": "", "coll_seq": -1, "coll_peer": -1, "last_seq": {"world": 500}, "stack": "",
             "gpu_xids": (xids or {}).get(r, {})}
            for r, t in last_s.items()
        ]
    )  # fmt: skip


def test_the_rank_that_raised_first_is_named_not_those_whose_peer_died_or_that_torchrun_stopped() -> None:
    exits = pd.DataFrame(
        [
            _exit(0, 0.4, "exception", "torch.distributed.DistBackendError", PEER),
            _exit(
                1, 0.0, "exception", "RuntimeError", "CUDA error: an illegal memory access was encountered"
            ),
            _exit(2, 0.5, "exception", "RuntimeError", PEER),
            _exit(3, 5.0, "signal", signal=15),
        ]
    )
    data = JobData(job="j", ranks=RANKS, exits=exits, heartbeats=_beats({r: -1.0 for r in range(4)}))
    f = only(diagnose(data).findings)  # a dead job's stale heartbeats make no hang
    assert (f.cause, f.ranks, f.hosts, f.function) == ("failure", [1], ["node0"], FRAME)
    assert f.evidence["class"] == "gpu_hardware" and "cordon the host" in f.evidence["advice"]
    assert f.evidence["others"] == {
        "0": "raised torch.distributed.DistBackendError (a peer died)",
        "2": "raised RuntimeError (a peer died)",
        "3": "stopped by signal 15",
    }


def test_a_gpu_that_fell_off_the_bus_is_its_hardware_whatever_its_rank_raised() -> None:
    """Rank 2's GPU fell off the bus (XID 79) and its ECC errors rose: the job saw only an NCCL
    error there, later than its peers saw theirs. Its hook's NVML answers name the hardware."""
    nccl = "NCCL error in: ProcessGroupNCCL.cpp:1935, unhandled system error, NCCL version 2.21.5"
    exits = pd.DataFrame(
        [
            _exit(0, 0.1, "exception", "torch.distributed.DistBackendError", PEER),
            _exit(1, 0.1, "exception", "torch.distributed.DistBackendError", PEER),
            _exit(2, 0.3, "exception", "torch.distributed.DistBackendError", nccl, gpu={"xid_79": 1, "ecc_uncorrected": 2}),
            _exit(3, 5.0, "signal", signal=15),
        ]
    )  # fmt: skip
    data = JobData(job="j", ranks=RANKS, exits=exits, heartbeats=_beats({r: -1.0 for r in range(4)}))
    f = only(failure.find(data, failure.Settings()))
    assert (f.ranks, f.hosts, f.evidence["class"]) == ([2], ["node1"], "gpu_hardware")
    assert f.evidence["gpu"] == {"xid_79": 1, "ecc_uncorrected": 2}
    assert "XID 79 (GPU has fallen off the bus), 2 uncorrected ECC errors" in f.summary
    assert "cordon the host" in f.evidence["advice"]
    # Without its GPU's answers the same exits read as the network's failure, on the same rank.
    plain = exits.assign(gpu=[{}] * 4)
    f = only(
        failure.find(
            JobData(job="j", ranks=RANKS, exits=plain, heartbeats=data.heartbeats), failure.Settings()
        )
    )
    assert (f.ranks, f.evidence["class"]) == ([2], "network")
    # An application's XID (13: a graphics engine exception, the kernel's own fault) is told, not blamed on the GPU.
    app = exits.assign(gpu=[{}, {}, {"xid_13": 2}, {}])
    f = only(
        failure.find(JobData(job="j", ranks=RANKS, exits=app, heartbeats=data.heartbeats), failure.Settings())
    )
    assert f.evidence["class"] == "network" and "XID 13 x2" in f.summary


def test_a_rank_killed_without_a_word_is_the_one_its_peers_died_of() -> None:
    exits = pd.DataFrame([_exit(r, 1.0 + r / 10, "exception", "RuntimeError", PEER) for r in (0, 1, 3)])
    data = JobData(job="j", ranks=RANKS, exits=exits, heartbeats=_beats({0: 0.9, 1: 0.9, 2: -2.0, 3: 0.9}))
    f = only(failure.find(data, failure.Settings()))
    assert (f.ranks, f.evidence["class"], f.confidence) == ([2], "killed", 0.8)
    # The same, where its heartbeats said its GPU fell off the bus first (an NCCL watchdog's abort
    # then ends a process without a word): the GPU's hardware, to cordon.
    beats = _beats({0: 0.9, 1: 0.9, 2: -2.0, 3: 0.9}, xids={2: {"xid_79": 1}})
    f = only(failure.find(JobData(job="j", ranks=RANKS, exits=exits, heartbeats=beats), failure.Settings()))
    assert (f.ranks, f.evidence["class"], f.evidence["gpu"]) == ([2], "gpu_hardware", {"xid_79": 1})
    assert "ended without a word; its GPU since attach: XID 79" in f.summary


def test_an_out_of_memory_error_and_the_jobs_own_code_are_told_apart() -> None:
    assert (
        failure.classify("torch.OutOfMemoryError", "CUDA out of memory. Tried to allocate 2.00 GiB")[0]
        == "out_of_memory"
    )
    assert failure.classify("KeyError", "'labels'")[0] == "code"
    assert (
        failure.classify("torch.distributed.DistBackendError", "NCCL error in: ... unhandled system error")[0]
        == "network"
    )


def test_a_job_that_ended_well_has_no_failure_and_one_that_restarted_says_why_it_did() -> None:
    closed = pd.DataFrame([_exit(r, 1.0, "close") for r in range(4)])
    assert failure.find(JobData(job="j", ranks=RANKS, exits=closed), failure.Settings()) == []
    assert diagnose(JobData(job="j", ranks=RANKS, exits=closed)).findings == []
    # Rank 1 raised; every rank started again after it (torchrun's restart): the job runs, and
    # why the attempt before died is said beside what the job does now, on the same rank.
    crashed = pd.DataFrame([_exit(1, 0.0, "exception", "RuntimeError", "boom")])
    restarted = RANKS.assign(time_us=T + 30_000_000)
    data = JobData(job="j", ranks=restarted, exits=crashed)
    assert failure.find(data, failure.Settings()) == []
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.evidence["attempt"], f.evidence["started_again"]) == ("failure", [1], 0, True)
    assert f.summary.startswith(
        "attempt 0 failed: rank 1 (node0) failed first at step 100: RuntimeError: boom"
    )
    assert "; the job started again." in f.summary


def test_each_attempt_a_restarted_job_lost_is_told_with_the_rank_that_went_silent_in_it() -> None:
    """Attempt 0: rank 2 killed without a word, its peers' collectives raised as it went. Attempt 1:
    rank 3 raised; the job started again and runs attempt 2, whose heartbeats are each rank's
    latest: a rank silent in attempt 0 is found by its missing exit record."""
    exits = pd.DataFrame(
        [_exit(r, 1.0 + r / 10, "exception", "RuntimeError", PEER) for r in (0, 1, 3)]
        + [_exit(3, 40.0, "exception", "ValueError", "bad batch", attempt=1)]
        + [_exit(r, 40.5, "signal", signal=15, attempt=1) for r in (0, 1, 2)]
    )
    beats = _beats({0: 60.0, 1: 60.0, 2: 60.0, 3: 60.0})
    data = JobData(job="j", ranks=RANKS.assign(time_us=T + 50_000_000), exits=exits, heartbeats=beats)
    found = sorted(diagnose(data).findings, key=lambda f: f.evidence["attempt"])
    assert [(f.ranks, f.evidence["attempt"], f.evidence["class"]) for f in found] == [
        ([2], 0, "killed"),
        ([3], 1, "code"),
    ]
    assert found[0].evidence["last_heartbeat_us"] == T + 1_000_000, (
        "no heartbeat of it then: the attempt's first exit"
    )
