"""Every collective a real job issues is seen always-on: DDP's (launched from C++), FSDP's, FSDP2's and
plain calls, in spawned multi-rank gloo jobs, with the wait on the rank that waits; tensor
parallelism's, launched by functional collectives, counted, numbered and timed."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest
import torch.multiprocessing as mp

from benchmarks.faults.catalogue import Fault, JobSpec
from benchmarks.faults.launch import launch
from benchmarks.procs import free_port
from rankscope.diagnosis import JobData
from rankscope.diagnosis.detectors.hang import Settings as HangSettings
from rankscope.diagnosis.detectors.hang import locate
from rankscope.wire.records import Heartbeat, RankInfo, StepBatch, WindowSummary, coverage_gaps
from tests.commands import torchrun
from tests.jobs import spawned
from tests.records import spool_records

STEPS = 150


def spawn(job: Callable[..., None], nprocs: int, *args: Path | str) -> None:
    """Run ``job(rank, port, *args)`` (a function of ``tests.jobs.spawned``; paths as strings) in
    ``nprocs`` spawned processes on a free port, and wait for them."""
    mp.start_processes(job, args=(free_port(), *map(str, args)), nprocs=nprocs, start_method="spawn")


def _stalled(records: list) -> list[Heartbeat]:
    """A rank's heartbeats a second or more into ``spawned.STUCK_AT``, the step a job is stuck in."""
    return [
        x
        for x in records
        if isinstance(x, Heartbeat) and x.step == spawned.STUCK_AT - 1 and x.progress_age_s >= 1.0
    ]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loop", "attach"),
    [
        ("manual", "start"),
        ("ddp", "start"),
        ("fsdp2", "start"),
        pytest.param("ddp", "loop", marks=pytest.mark.releases),
        pytest.param("fsdp2", "loop", marks=pytest.mark.releases),
    ],
)
def test_every_loop_shape_shows_its_collectives_and_the_wait_for_a_late_rank(
    loop: str, attach: str, tmp_path: Path
) -> None:
    """Rank 1's batches arrive 20 ms late: rank 0 waits for it inside the gradient collectives,
    whether the hook was attached before the model or at the loop, after it was wrapped."""
    launch(
        JobSpec(
            job=loop,
            attach=attach,
            world_size=2,
            hosts=1,
            port=free_port(),
            max_steps=STEPS,
            loop=loop,
            fault=Fault(kind="dataloader", rank=1, delay_ms=20),
            hook={"spool_dir": str(tmp_path), "window_s": 0, "flush_s": 0.5},
            log_dir=str(tmp_path / "logs"),
            progress=False,
        )
    )
    recs = spool_records(tmp_path, loop)
    # The rows are blocks of steps (totals of ``n_steps`` steps); past the first 10 steps.
    rows = {
        r: [row for x in rs if isinstance(x, StepBatch) for row in x.rows if row.step >= 10]
        for r, rs in recs.items()
    }
    # DDP: one bucket all-reduce + the loop's small all-reduce; FSDP2: gathers and reduce-scatters.
    least = {"manual": 1, "ddp": 2, "fsdp2": 4}[loop]
    for r in (0, 1):
        assert rows[r] and min(row.n_coll / row.n_steps for row in rows[r]) >= least, (r, rows[r][:3])
        assert all(row.first_coll_us >= 0 for row in rows[r])
        waited = sum(row.n_steps for row in rows[r] if row.comm_us > 0) / sum(row.n_steps for row in rows[r])
        assert waited >= 0.9, (r, waited)
    wait = {r: statistics.median(row.comm_us / row.n_steps for row in rows[r]) for r in (0, 1)}
    assert wait[0] > wait[1] + 10_000, wait  # the wait inversion: the healthy rank waits
    own = {r: statistics.median((row.dur_us - row.comm_us) / row.n_steps for row in rows[r]) for r in (0, 1)}
    assert own[1] > own[0] + 10_000, own  # so the late rank's own time stands out
    # Sequence numbers match across ranks: what names the rank a hang waits for.
    last = {r: [x for x in rs if isinstance(x, Heartbeat)][-1].last_seq for r, rs in recs.items()}
    assert last[0] == last[1] and last[0]["world"] >= least * STEPS


@pytest.mark.slow
def test_a_users_own_ddp_comm_hook_still_runs_and_its_collectives_are_tracked(tmp_path: Path) -> None:
    spawn(spawned.user_hook_job, 2, tmp_path, tmp_path)
    got = [(tmp_path / f"rank{r}").read_text().split() for r in (0, 1)]
    # Every step ran the user's fp16 hook once; the tracked numbering is c10d's (what Flight Recorder
    # shows); the gradient is the average over ranks of x = 1 and x = 2 summed over 4 rows: 6.0.
    assert got[0][:3] == got[1][:3] == ["10", "0", "6.0000"]
    # Each collective counted once: the hook's all-reduces by their wrapper, not again as DDP's, and
    # the broadcasts DDP issues from C++ when it rebuilds its buckets after the first step, and when
    # it is built (before the first step: counted in it); the three paused steps' all-reduces not at
    # all.
    assert int(got[0][3]) == 10 + 2, got  # DDP's rebuild broadcasts the bucket sizes and indices
    launched = int(got[0][4])
    assert launched > 10 + 2, got  # and its construction broadcast the model
    for rank, recs in spool_records(tmp_path, "userhook").items():
        rows = [row for x in recs if isinstance(x, StepBatch) for row in x.rows]
        assert sum(row.n_steps for row in rows) == 7, (rank, rows)
        assert sum(row.n_coll for row in rows) == launched - 3, (rank, rows)
        assert all(row.comm_us > 0 for row in rows), (rank, rows)


@pytest.mark.slow
def test_collectives_launched_from_cxx_are_counted_numbered_and_name_the_rank_a_hang_waits_for(
    tmp_path: Path,
) -> None:
    """Tensor parallelism (DTensor's functional collectives, launched from C++ and waited on in
    ``wait_tensor``), then FSDP."""
    spawn(spawned.launched_from_cxx_job, 2, tmp_path, tmp_path)
    recs = spool_records(tmp_path, "cxx")
    seqs = [[int(n) for n in (tmp_path / f"rank{r}").read_text().split()] for r in (0, 1)]
    assert seqs[0] == seqs[1]
    for rank, rs in recs.items():
        rows = {row.step: row for x in rs if isinstance(x, StepBatch) for row in x.rows}
        assert sorted(rows) == list(range(30))
        # One all-reduce a tensor-parallel step, counted in its step (after step 0, which also
        # counts the device mesh's set-up), and step 15's own; timed where the thread waits on it.
        assert [rows[s].n_coll for s in range(1, 20)] == [2 if s == 15 else 1 for s in range(1, 20)], rank
        assert [s for s in range(20) if rows[s].comm_us <= 0] == [], rank
        # FSDP's gathers and reduce-scatters pass the wrapped functions: counted and timed.
        fsdp = [rows[s] for s in range(21, 30)]
        assert sum(r.n_coll for r in fsdp) + rows[20].n_coll == seqs[0][-1] - seqs[0][19] - 1
        assert all(r.n_coll >= 2 and r.comm_us > 0 for r in fsdp), fsdp
        last = [x for x in rs if isinstance(x, Heartbeat)][-1]
        assert last.last_seq == {"world": seqs[0][-1]}, rank  # c10d's numbers, on every rank
    # Rank 0 waited for the sleeping rank 1 in the tensor-parallel all-reduce, not in its own time.
    stuck_step = {
        r: next(row for x in rs if isinstance(x, StepBatch) for row in x.rows if row.step == spawned.STUCK_AT)
        for r, rs in recs.items()
    }
    assert stuck_step[0].comm_us >= 2_500_000, stuck_step[0]
    assert stuck_step[0].dur_us - stuck_step[0].comm_us < 500_000, stuck_step[0]
    assert stuck_step[1].dur_us - stuck_step[1].comm_us >= 2_900_000, stuck_step[1]

    # Stuck, rank 1 never launched the all-reduce numbered after its last; rank 0 waits in it.
    def stalled(rank: int) -> list[Heartbeat]:
        return _stalled(recs[rank])

    waiting = [x for x in stalled(0) if x.coll_op == "all_reduce"]
    assert waiting and {(x.coll_group, x.coll_seq) for x in waiting} == {
        ("world", seqs[0][spawned.STUCK_AT] + 1)
    }
    # Until it wakes up and launches it (its last heartbeats of the step may come after that).
    stuck = [x for x in stalled(1) if x.last_seq["world"] == seqs[1][spawned.STUCK_AT]]
    assert stuck and stuck[-1].progress_age_s >= 2.0 and stuck[-1].coll_seq == -1, stalled(1)
    hang = locate(
        pd.DataFrame([dataclasses.asdict(x) for x in (waiting[-1], stuck[-1])]), HangSettings(stall_s=1.0)
    )
    assert hang is not None and (hang.ranks, hang.seq) == ([1], seqs[0][spawned.STUCK_AT] + 1), hang


@pytest.mark.slow
def test_the_wait_in_a_collective_called_through_a_name_bound_before_attach_is_communication(
    tmp_path: Path,
) -> None:
    """nanoGPT-shaped scripts import ``all_reduce`` at their top, before the hook patches it: rank
    0's wait for its late peer there is still its wait in collectives, not its own time (unseen, a
    healthy DDP rank read up to 1.4x its fastest peer's own time); so is a wait on a process group's own
    method's work; an asynchronous call's wait is counted once."""
    spawn(spawned.bound_before_attach_job, 2, tmp_path)
    for rank, rs in spool_records(tmp_path, "bound").items():
        rows = {row.step: row for x in rs if isinstance(x, StepBatch) for row in x.rows}
        assert sorted(rows) == list(range(18)), rank
        for steps in (range(1, 6), range(6, 12), range(12, 18)):
            comm = [rows[s].comm_us for s in steps]
            own = [rows[s].dur_us - rows[s].comm_us for s in steps]
            if rank == 0:  # 30 ms a step in the collective, its own time a few ms at most
                assert min(comm) > 25_000 and max(own) < 15_000, (steps, comm, own)
            else:  # 30 ms of its own (asleep), hardly any wait
                assert max(comm) < 15_000 and min(own) > 25_000, (steps, comm, own)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["call", "group_rank"])
def test_a_send_and_its_recv_are_one_transfer_each_timed_once_on_the_rank_that_waits(
    tmp_path: Path, how: str
) -> None:
    """``send`` and ``recv`` are ``isend`` and ``irecv`` waited on at once (torch 2.6 on): each is
    one call, counted, numbered and timed once, as c10d numbers it (DeepSpeed's pipeline engine
    moves its activations so). Rank 1 sends 30 ms late: rank 0 waits for it inside ``recv``, or in
    the wait of an ``irecv`` whose peer is given as a rank of the default group (``group_src``).
    Then 2 s late: rank 0's heartbeats name the transfer it waits in and its peer, as a hang's
    diagnosis reads them, whether the step noted the call (a lean step) or recorded it in full."""
    spawn(spawned.send_recv_job, 2, tmp_path, tmp_path, how)
    recs = spool_records(tmp_path, "sendrecv")
    n = spawned.STUCK_AT + 1
    for rank, rs in recs.items():
        before, after = map(int, (tmp_path / f"rank{rank}").read_text().split())
        rows = [row for x in rs if isinstance(x, StepBatch) for row in x.rows]
        assert sum(row.n_steps for row in rows) == n and sum(row.n_coll for row in rows) == n, (rank, rows)
        assert all(row.comm_us <= row.dur_us for row in rows), (rank, rows)
        assert [x for x in rs if isinstance(x, Heartbeat)][-1].last_seq["world"] == after == before + n
        comm = sum(row.comm_us for row in rows if 0 < row.step < spawned.STUCK_AT) / (spawned.STUCK_AT - 1)
        if rank == 0:
            assert 25_000 < comm < 60_000, rows  # its 30 ms wait, once
        else:
            assert comm < 15_000, rows
    before = int((tmp_path / "rank0").read_text().split()[0])
    # Rank 0 waits in the transfer numbered after its last, for rank 1, from the step's start...
    waiting = [x for x in _stalled(recs[0]) if x.coll_op]
    assert waiting and {(x.coll_op, x.coll_group, x.coll_seq, x.coll_peer) for x in waiting} == {
        ("recv", "world", before + n, 1)
    }, _stalled(recs[0])
    assert all(x.coll_age_s >= 1.0 for x in waiting), waiting
    # ...which rank 1, asleep, has not entered (until it wakes up and sends).
    asleep = [x for x in _stalled(recs[1]) if x.last_seq["world"] == before + n - 1]
    assert asleep and all(x.coll_seq == -1 for x in asleep), _stalled(recs[1])
    hang = locate(
        pd.DataFrame([dataclasses.asdict(x) for x in (waiting[-1], asleep[-1])]), HangSettings(stall_s=1.0)
    )
    assert hang is not None and hang.ranks == [1], hang


@pytest.mark.slow
def test_a_megatron_jobs_ranks_carry_their_place_in_its_parallelism_from_its_named_groups(
    tmp_path: Path,
) -> None:
    """Without a ``DeviceMesh``: Megatron-LM describes each process group it makes by name."""
    spawn(spawned.megatron_groups_job, 4, tmp_path)
    recs = spool_records(tmp_path, "megatron")
    mesh = {r: [x for x in rs if isinstance(x, RankInfo)][-1].mesh for r, rs in recs.items()}
    assert mesh == {r: {"dp": 0, "tp": r % 2, "pp": r // 2} for r in range(4)}


@pytest.mark.slow
def test_a_pipeline_made_without_a_device_mesh_gives_each_rank_its_stage(tmp_path: Path) -> None:
    """Without a ``DeviceMesh`` or named groups: a rank's place in a pipeline is the index of the
    ``torch.distributed.pipelining`` stage it runs, and each rank is compared with the ranks of
    its stage (the diagnosis's roles)."""
    spawn(spawned.pipeline_without_mesh_job, 4, tmp_path)
    recs = spool_records(tmp_path, "pipeline")
    mesh = {r: [x for x in rs if isinstance(x, RankInfo)][-1].mesh for r, rs in recs.items()}
    assert mesh == {r: {"pp": r % 2} for r in range(4)}
    ranks = pd.DataFrame({"rank": list(mesh), "mesh": list(mesh.values())})
    assert JobData(job="pipeline", ranks=ranks).roles() == [[0, 2], [1, 3]]


MESHES = {
    "pipeline_dp": {r: {"dp": r // 2, "pp": r % 2} for r in range(4)},
    "tp_dp": {r: {"dp": r // 2, "tp": r % 2} for r in range(4)},
    "deepspeed_pipe": {r: {"pp": r // 2} for r in range(4)},  # pipe-major; no mesh, no named groups
}
"""Each 2-D job's ranks' places in its parallelism."""


@pytest.mark.slow
@pytest.mark.parametrize("script", list(MESHES))
def test_a_rank_that_waits_for_its_pipeline_or_tensor_parallel_peer_waits_in_communication_not_in_its_own_time(
    tmp_path: Path, script: str
) -> None:
    """Three 2-D jobs, rank 0 blocking 60 ms in a metrics upload every step from 8 s in. Two
    written as torchtitan writes them: (dp=2, pp=2), FSDP2 over dp, 1F1B over pp: its next stage
    (rank 1) waits for its activations in ``recv``, the other pipeline in FSDP's collectives with
    it; (dp=2, tp=2), tensor parallelism by ``parallelize_module``, FSDP2 over dp: its
    tensor-parallel peer (rank 1) waits in the collectives DTensor launches in every block
    (functional collectives, waited on in ``wait_tensor``), the other replica in FSDP's. And
    DeepSpeed's ``PipelineModule`` over 2 stages and 2 replicas, as its docs write one: its next
    stage (rank 2) waits in ``recv``, its replica (rank 1) in the gradients' all-reduce. Only rank
    0's own time grows; each rank's record carries its place in the job's parallelism (DeepSpeed's
    from the stage its engine runs)."""
    env = {**os.environ, "RANKSCOPE_SPOOL": str(tmp_path / "spool"), "RANKSCOPE_JOB": script}
    path = Path(__file__).parents[1] / "benchmarks" / "jobs" / f"{script}.py"
    # By time, not steps: on a slower machine 70 steps once ended right after the 8-s onset. 16 s
    # in all once left 4 blocks after the onset, and the tensor-parallel job, whose 31 calls a step
    # read their run-queue wait one step in ~12, measured rank 0's upload at 34 ms of its 60.
    flags = ["--seconds", "24", "--fault", "metrics_block", "--fault-rank", "0", "--onset-s", "8"]
    run = subprocess.run(
        [*torchrun(4), str(path), *flags, "--fault-ms", "60", "--marker-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    onset = json.loads((tmp_path / "onset-r0").read_text())["step"]
    recs = spool_records(tmp_path / "spool", script)
    infos = {r: [x for x in rs if isinstance(x, RankInfo)][-1] for r, rs in recs.items()}
    assert {r: i.mesh for r, i in infos.items()} == MESHES[script]
    # The mesh's groups, made without a backend named, are gloo's: no "untested backend" said.
    assert all(coverage_gaps(i.coverage) == [] for i in infos.values()), infos[0].coverage

    def per_step_ms(rank: int, after: bool) -> tuple[float, float]:
        """(own, collective) ms per step over the blocks wholly after the onset, or before it (the
        first two steps, the warm-up, left out: 2-3x the others' own and collective time in runs
        here; with an onset 4 s in, the warm-up was half of what came before it, and once rank 0's
        collective time went down by 115 ms a step after its onset)."""
        rows = [row for x in recs[rank] if isinstance(x, StepBatch) for row in x.rows]
        rows = [r for r in rows if (r.step >= onset if after else r.step > 1 and r.step + r.n_steps <= onset)]
        n = sum(r.n_steps for r in rows)
        own = sum(r.dur_us - r.comm_us - r.data_us - r.wait_us for r in rows)
        return own / n / 1e3, sum(r.comm_us for r in rows) / n / 1e3

    grown = {
        r: tuple(a - b for a, b in zip(per_step_ms(r, True), per_step_ms(r, False), strict=True))
        for r in range(4)
    }
    # Rank 0's own time carries its 60 ms upload; the others wait for it, in communication (33-93
    # ms more a step in runs here), not in their own time (~+60 ms were the wait untracked). On 4
    # ranks sharing 2 cores every rank's own time also moves with the machine (-8 to +37 ms a
    # step in the same runs, all ranks alike): rank 0 is compared with each of the others.
    for r in (1, 2, 3):
        assert grown[0][0] - grown[r][0] >= 40 and grown[r][1] >= 20, grown


@pytest.mark.slow
def test_a_windows_dtensor_collectives_and_their_waits_are_communication_not_compute(tmp_path: Path) -> None:
    """The tensor x data parallel job with windows whatever they cost (``$RANKSCOPE_WINDOW_BUDGET``
    = 1: at the default budget its first window comes minutes in; the schedule's first is ~12 s
    in): the collectives DTensor launches from C++ in every block, and the waits for them, are in
    every rank's windows as collectives."""
    env = {**os.environ, "RANKSCOPE_SPOOL": str(tmp_path / "spool"), "RANKSCOPE_JOB": "tp_dp",
           "RANKSCOPE_WINDOW_BUDGET": "1"}  # fmt: skip
    path = Path(__file__).parents[1] / "benchmarks" / "jobs" / "tp_dp.py"
    run = subprocess.run(
        [*torchrun(4), str(path), "--seconds", "16"], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    for rank, recs in spool_records(tmp_path / "spool", "tp_dp").items():
        windows = [x for x in recs if isinstance(x, WindowSummary)]
        dtensor = [f for w in windows for f in w.functions if f.name.startswith("_c10d_f")]
        assert windows and dtensor and {f.kind for f in dtensor} == {"collective"}, (rank, dtensor)
