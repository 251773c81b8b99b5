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

Only an attempt that ended is diagnosed, and only the job's latest: where ranks started again
after the failure (a restart), the job runs, and what it does now is the other detectors'.
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
    """The latest attempt's failure, if it ended in one: one finding naming the rank that failed first."""
    ex = data.exits
    if ex.empty:
        return []
    attempt = int(ex["attempt"].max())
    ended = ex[ex["attempt"] == attempt]
    last_exit = dict(zip(ended["rank"].astype(int), ended["time_us"].astype(int), strict=True))
    if "time_us" in data.ranks and any(
        int(t) > last_exit.get(int(r), 1 << 62)
        for r, t in zip(data.ranks["rank"], data.ranks["time_us"], strict=True)
    ):
        return []  # a rank started again after it ended: the job restarted and runs
    first = first_failed(ended, _silent(data, ended))
    if first is None:
        return []  # every rank closed, or was stopped: no failure
    t, rank, row = first
    host = data.hosts_of([rank]).get(rank, "")
    beats = data.heartbeats[data.heartbeats["rank"] == rank]
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


def _silent(data: JobData, ended: pd.DataFrame) -> dict[int, int]:
    """The job's ranks without an exit record whose last heartbeat came before the attempt's first
    exit (a rank still running would have sent one since), each with that heartbeat's time."""
    beats = data.heartbeats
    if beats.empty or ended.empty:
        return {}
    first_exit = int(ended["time_us"].min())
    quiet = beats[~beats["rank"].astype(int).isin(set(ended["rank"].astype(int)))]
    return {
        int(r): int(t) for r, t in zip(quiet["rank"], quiet["time_us"], strict=True) if int(t) < first_exit
    }


def _how(row: Any) -> str:
    """How a rank that did not fail first ended, in a few words."""
    if row.how == "signal":
        return f"stopped by signal {int(row.signal)}" if int(row.signal) else "stopped by a signal"
    if row.how == "exception":
        peer = bool(PEER_DIED.search(str(row.message)))
        return f"raised {row.error}" + (" (a peer died)" if peer else "")
    return "closed"
