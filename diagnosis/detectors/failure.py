"""``failure``: why a job's attempt died — the rank that failed first, its error and its class.

Each rank's hook sends an exit record when its process ends (``wire.records.Exit``): closed, an
exception (its class, message and the innermost frame of the job's own code), or a SIGTERM. When a
rank fails, the others end after it: their collectives raise because a peer is gone ("Connection
closed by peer"), or torchrun stops them (SIGTERM). So the rank that failed first is the earliest
exception that is not a peer's death; a rank that ended without a word (SIGKILL, the OOM killer,
a node lost) sends no exit record and its heartbeats stop: where the others ended after it, it is
the one. The error's class follows the failure taxonomy of Meta's reliability study (arXiv
2410.21680): GPU or memory hardware, out of memory, the network or collectives, infrastructure
(killed, preempted, a node lost) and the job's own code; the hardware classes say to cordon the host.
Where the rank's hook could ask NVML, its exit record also holds its GPU's faults since attach
(XID events, ECC errors, retired pages, remapped rows): a hardware XID or a moved counter makes
the failure ``gpu_hardware`` whatever the exception said (a GPU that fell off the bus surfaces in
the job as an NCCL error or a "peer died"), and the XIDs go with the evidence.

:func:`find` diagnoses the job's latest attempt where the job died of it; :func:`earlier` each
attempt the job started again after (a restart), whose finding says so, beside what the other
detectors find in the running job.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ..data import JobData
from ..findings import Finding
from ..gpu_faults import gpu_failed, gpu_faults


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    pass


PEER_DIED = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|ECONNRESET|"
    r"remote process exited|NCCL communicator was aborted|NCCL Error 6|"
    r"Socket closed|Connection refused|DistNetworkError.*(?:closed|reset)",
    re.IGNORECASE,
)
"""What a collective raises on a rank whose peer died: it did not fail first."""

CLASSES: tuple[tuple[str, re.Pattern[str], str], ...] = (
    (
        "gpu_hardware",
        re.compile(
            r"illegal memory access|uncorrectable ECC|ECC error|Xid|GPU is lost|fallen off the bus|"
            r"unspecified launch failure|CUDA error: (an )?(illegal|unknown|misaligned)",
            re.IGNORECASE,
        ),
        "cordon the host and check its GPU (XID/ECC events, retired pages) before it runs again",
    ),
    (
        "out_of_memory",
        re.compile(r"OutOfMemoryError|out of memory|MemoryError|Cannot allocate memory", re.IGNORECASE),
        "lower the memory the job needs (batch, activation checkpointing) or give it larger devices",
    ),
    (
        "network",
        re.compile(r"NCCL|Gloo|DistBackendError|DistNetworkError|timed out|Timeout|socket", re.IGNORECASE),
        "check the host's NIC and links, and the collectives' timeouts",
    ),
)
"""Error classes by what the exception says (class, then message), first match; else ``code``."""
HARDWARE = ("gpu_hardware",)
"""The classes whose host must be checked before it runs again (their advice: cordon it)."""
CODE_ADVICE = "fix the job's code where it raised"
KILLED_ADVICE = (
    "the process ended without a word (SIGKILL: the OOM killer, a preemption, a node lost): "
    "check the host's kernel log and the scheduler's events"
)


def explain(row: Any, gpu: dict[str, int] | None = None) -> tuple[str, str, str]:
    """Of the rank that failed first (its exit row, or None where it ended without a word, then
    ``gpu``: its GPU's XIDs from its last heartbeat): its error's class, what to do about it, and
    what it said (and its GPU, where it had faults)."""
    if row is None:
        klass, advice, what = "killed", KILLED_ADVICE, "its process ended without a word"
    else:
        klass, advice = classify(str(row.error), str(row.message))
        what = f"{row.error}: {row.message}".strip(": ")
        gpu = gpu_of(row)
    if faults := gpu_faults(gpu or {}):
        what = f"{what}; its GPU since attach: {faults}"
    if gpu_failed(gpu or {}):
        klass, advice = next((name, advice) for name, _, advice in CLASSES if name == "gpu_hardware")
    return klass, advice, what


def gpu_of(row: Any) -> dict[str, int]:
    """An exit row's GPU faults (``wire.records.Exit.gpu``)."""
    return dict(getattr(row, "gpu", None) or {})


def classify(error: str, message: str) -> tuple[str, str]:
    """The failure class of an exception, and what to do about it."""
    text = f"{error}: {message}"
    return next(
        ((name, advice) for name, pattern, advice in CLASSES if pattern.search(text)), ("code", CODE_ADVICE)
    )


def find(data: JobData, s: Settings) -> list[Finding]:
    """The latest attempt's failure, where the job died of it: one finding naming the rank that
    failed first (none where the job started again: see :func:`earlier`)."""
    ex = data.exits
    if ex.empty:
        return []
    attempt = int(ex["attempt"].max())
    ended = ex[ex["attempt"] == attempt]
    if _started_again(data, ended):
        return []  # the job restarted and runs: what it does now is the other detectors'
    return _failure(data, attempt, ended, again=False)


def earlier(data: JobData, s: Settings) -> list[Finding]:
    """The failure of each attempt the job started again after (a restart): what ended it, as
    :func:`find` says it, and that the job went on. A service that first reads the job after its
    ranks restarted still learns why the attempt before died, and on which host."""
    ex = data.exits
    if ex.empty:
        return []
    latest = int(ex["attempt"].max())
    out = []
    for attempt, ended in ex.groupby("attempt", sort=True):
        if int(attempt) < latest or _started_again(data, ended):
            out += _failure(data, int(attempt), ended, again=True)
    return out


def _started_again(data: JobData, ended: pd.DataFrame) -> bool:
    """Whether a rank of the job started after this attempt's last exit (its rank record is newer)."""
    if "time_us" not in data.ranks or ended.empty:
        return False
    last_exit = dict(zip(ended["rank"].astype(int), ended["time_us"].astype(int), strict=True))
    return any(
        int(t) > last_exit.get(int(r), 1 << 62)
        for r, t in zip(data.ranks["rank"], data.ranks["time_us"], strict=True)
    )


def _failure(data: JobData, attempt: int, ended: pd.DataFrame, again: bool) -> list[Finding]:
    """The finding of one ended attempt (``ended``: its exit records), if a rank failed it;
    ``again``: the job started again after it."""
    first = first_failed(ended, _silent(data, ended, again))
    if first is None:
        return []  # every rank closed, or was stopped: no failure
    t, rank, row = first
    host = data.hosts_of([rank]).get(rank, "")
    beats = data.heartbeats[data.heartbeats["rank"] == rank]
    if again:
        beats = beats[beats["time_us"] <= int(ended["time_us"].max())]
    xids = (
        dict(beats["gpu_xids"].iloc[-1] or {})
        if row is None and "gpu_xids" in beats and not beats.empty
        else {}
    )
    klass, advice, what = explain(row, xids)
    if row is not None:
        function = str(row.frame) or str(row.error)
        step, confidence = int(row.step), 0.95
        evidence: dict[str, Any] = {
            "error": str(row.error),
            "message": str(row.message),
            "frame": str(row.frame),
            **({"gpu": gpu_of(row)} if gpu_of(row) else {}),
        }
    else:
        function, confidence = "(killed: no exit record)", 0.8
        step = int(beats["step"].max()) if not beats.empty else -1
        evidence = {"last_heartbeat_us": t, **({"gpu": xids} if xids else {})}
    others = {int(r.rank): _how(r) for r in ended.itertuples(index=False) if int(r.rank) != rank}
    after = ", ".join(f"rank {r} {h}" for r, h in sorted(others.items())[:8])
    return [
        Finding(
            cause="failure",
            ranks=[rank],
            hosts=[host] if host else [],
            function=function,
            confidence=confidence,
            summary=(
                f"attempt {attempt} failed: rank {rank}{f' ({host})' if host else ''} failed first"
                f"{f' at step {step}' if step >= 0 else ''}: {what} [{klass}]"
                + (f"; after it: {after}" if after else "")
                + ("; the job started again" if again else "")
                + f". {advice[0].upper()}{advice[1:]}"
            ),
            evidence={
                "class": klass,
                "attempt": attempt,
                "step": step,
                "time_us": t,
                **evidence,
                "others": {str(r): h for r, h in sorted(others.items())},
                "advice": advice,
                "started_again": again,
            },
        )
    ]


def first_failed(ended: pd.DataFrame, silent: dict[int, int]) -> tuple[int, int, Any] | None:
    """Of one attempt's exit records (``ended``) and the ranks that went silent before its first
    exit (rank -> last heartbeat), the one that failed first: ``(time_us, rank, its exit row or
    None if silent)``, or None where no rank failed (all closed or were stopped). The earliest
    exception of its own (not a peer's death, unless its own GPU failed) or silence; where every
    exception is a peer's death and none went silent, the earliest."""
    raised = ended[ended["how"] == "exception"]
    own = raised[
        ~raised["message"].astype(str).str.contains(PEER_DIED)
        | np.array(
            [gpu_failed(gpu_of(r)) for r in raised.itertuples(index=False)], dtype=bool
        )  # its GPU failed
    ]
    candidates = [
        *((int(r.time_us), int(r.rank), r) for r in own.itertuples(index=False)),
        *((t, rank, None) for rank, t in silent.items()),
    ] or [(int(r.time_us), int(r.rank), r) for r in raised.itertuples(index=False)]
    return min(candidates, key=lambda c: c[0]) if candidates else None


def _silent(data: JobData, ended: pd.DataFrame, again: bool) -> dict[int, int]:
    """The job's ranks without an exit record in the attempt that went silent before its first
    exit, each with its last heartbeat's time then: those whose heartbeats stopped before it (a
    rank still running would have sent one since); of an attempt the job started again after,
    every rank without one (its heartbeats go on in the next attempt), at its last heartbeat
    before that exit, else that exit's time."""
    beats = data.heartbeats
    if ended.empty:
        return {}
    first_exit = int(ended["time_us"].min())
    said = set(ended["rank"].astype(int))
    last = {
        int(r): int(t)
        for r, t in zip(beats["rank"], beats["time_us"], strict=True)
        if int(r) not in said and (not again or int(t) < first_exit)
    }  # heartbeats are ordered by time: the last one of each rank wins
    if not again:
        return {r: t for r, t in last.items() if t < first_exit}
    everyone = data.ranks["rank"] if not data.ranks.empty else beats["rank"]
    return {int(r): last.get(int(r), first_exit) for r in everyone if int(r) not in said}


def _how(row: Any) -> str:
    """How a rank that did not fail first ended, in a few words."""
    if row.how == "signal":
        return f"stopped by signal {int(row.signal)}" if int(row.signal) else "stopped by a signal"
    if row.how == "exception":
        peer = bool(PEER_DIED.search(str(row.message)))
        return f"raised {row.error}" + (" (a peer died)" if peer else "")
    return "closed"
