"""Records and spools the store's tests write, and what they read back."""

from __future__ import annotations

from pathlib import Path

from rankscope.aggregator import Store
from rankscope.aggregator.spool import file_id
from rankscope.wire.records import (
    Checkpoint,
    Exit,
    FunctionPattern,
    Heartbeat,
    RankInfo,
    Record,
    StepBatch,
    StepRow,
    WindowSummary,
    encode,
)

JOB = "llama's run; DROP TABLE steps"  # quotes and SQL in a job id: values must travel as parameters
T0 = 1_700_000_000_000_000


def rank_info(rank: int, time_us: int = T0) -> RankInfo:
    return RankInfo(
        job=JOB, rank=rank, host=f"node{rank // 2}", time_us=time_us, local_rank=rank % 2, world_size=2,
        pid=1000 + rank, nic="mlx5_0", switch="leaf1", spine="spine0", backend="gloo", device="cpu",
    )  # fmt: skip


def step_row(step: int, rank: int) -> StepRow:
    start = T0 + step * 100_000
    return StepRow(
        step, start, 90_000 + rank * 5_000, 1_000, 20_000, 3, 40_000 + rank, 85_000, rank, 1, 300 + rank,
        step % 5 * 1_000,
    )  # fmt: skip


def steps(rank: int, lo: int, hi: int) -> StepBatch:
    rows = tuple(step_row(s, rank) for s in range(lo, hi))
    return StepBatch(job=JOB, rank=rank, host=f"node{rank // 2}", time_us=T0 + hi * 100_000, rows=rows)


def heartbeat(rank: int, time_us: int, step: int, gpu_xids: dict[str, int] | None = None) -> Heartbeat:
    return Heartbeat(
        gpu_xids=gpu_xids or {},
        job=JOB, rank=rank, host=f"node{rank // 2}", time_us=time_us, step=step, progress_age_s=0.25,
        coll_group="0", coll_op="allreduce", coll_seq=step * 3, coll_age_s=0.01,
        last_seq={"0": step * 3, "1": step}, stack="train.py:42 step", dropped=rank,
        samples={"train.py(40): step": step, "": 1},
        sends={"10.0.0.1>10.0.0.2": (step << 20, step * 1_000)} if step else {},
    )  # fmt: skip


def function(kind: str, name: str, count: int, stack: str = "") -> FunctionPattern:
    return FunctionPattern(
        kind, name, stack, count, count * 10.0, 10.0, 9.5, 12.0, 30.0, 0.2, 50.0, 0.1, 4096
    )


def window(rank: int, number: int) -> WindowSummary:
    functions = (
        function("op", "aten::mm", 40),
        function("collective", "allreduce", 3),
        function("python", "forward", 4, stack="train.py:main > train.py:step"),
    )
    return WindowSummary(
        job=JOB, rank=rank, host=f"node{rank // 2}", time_us=T0 + number * 1_000_000, window=number,
        step_lo=number * 10, step_hi=number * 10 + 5, dur_us=500_000,
        busy={"compute": 0.6, "comm": 0.3, "data": 0.05, "idle": 0.05}, n_events=1234 + rank,
        functions=functions,
    )  # fmt: skip


def checkpoint(rank: int, step: int = 5) -> Checkpoint:
    return Checkpoint(
        job=JOB, rank=rank, host=f"node{rank // 2}", time_us=T0 + 600_000, kind="save", step=step,
        start_us=T0 + 500_000, dur_us=90_000 + rank,
    )  # fmt: skip


def exit_record(rank: int) -> Exit:
    """Rank 1 raised, its GPU fallen off the bus; rank 0 was stopped."""
    how = {
        "how": "exception",
        "error": "RuntimeError",
        "message": "boom",
        "frame": "train.py(40): step @41",
        "gpu": {"xid_79": 1, "ecc_uncorrected": 2},
    }
    return Exit(
        job=JOB, rank=rank, host=f"node{rank // 2}", time_us=T0 + 3_000_000 - rank, pid=1000 + rank, step=7,
        **(how if rank else {"how": "signal", "signal": 15}),
    )  # fmt: skip


def all_records() -> list[Record]:
    out: list[Record] = []
    for rank in (0, 1):
        out += [rank_info(rank), steps(rank, 0, 5), checkpoint(rank), steps(rank, 5, 8)]
        out += [
            heartbeat(rank, T0 + 1_000_000, 4),
            heartbeat(rank, T0 + 2_000_000, 7, {"xid_79": 1} if rank else None),
        ]
        out += [window(rank, 1), window(rank, 2), exit_record(rank)]
    return out


def write_spool(root: Path, records: list[Record]) -> list[Path]:
    """One file per rank in ``<job-dir>/<host>-rank<R>.jsonl``, as the hook's spool sink lays them out."""
    paths = []
    for rank in sorted({r.rank for r in records}):
        path = root / "job-a" / f"node{rank // 2}-rank{rank}-{1000 + rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("ab") as f:
            f.writelines(encode(r)[1] + b"\n" for r in records if r.rank == rank)
        paths.append(path)
    return paths


def snapshot(store: Store) -> dict[str, list[dict[str, object]]]:
    """Everything the read side returns for JOB, as plain values, for equality checks."""
    frames = {
        "ranks": store.ranks(JOB),
        "steps": store.steps(JOB),
        "windows": store.windows(JOB),
        "functions": store.functions(JOB),
        "heartbeats": store.heartbeats_latest(JOB),
        "attempts": store.attempts(JOB),
        "checkpoints": store.checkpoints(JOB),
        "exits": store.exits(JOB),
    }
    return {name: df.to_dict("records") for name, df in frames.items()}


EXPECTED_COUNTS = {
    "ranks": 2, "attempts": 2, "steps": 16, "heartbeats": 4, "windows": 4, "functions": 12, "checkpoints": 2,
    "exits": 2, "arrivals": 0,  # these records are not numbered, as an older hook's
}  # fmt: skip


def offset_of(store: Store, path: Path) -> int:
    """How far ``path`` has been ingested, by its file identity."""
    fid = file_id(path)
    assert fid is not None
    return store.offset(fid).offset
