"""The demo's and the fault suite's user-style GPT script (rankscope/demo_job.py): a real 2-rank run under torchrun."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.faults.catalogue import JobSpec
from benchmarks.faults.scenarios import SCENARIO_DIR, ScenarioError, load, load_all
from benchmarks.faults.torchrun_job import SCRIPTS, commands
from benchmarks.procs import free_port
from rankscope.wire.records import STEP_COLUMNS


def _records(spool: Path) -> list[dict]:
    out = []
    for path in spool.rglob("*.jsonl"):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


@pytest.mark.slow
def test_lm_script_trains_under_torchrun_with_the_hook_at_its_defaults_but_its_window_budget(
    tmp_path: Path,
) -> None:
    spool, markers = tmp_path / "spool", tmp_path / "markers"
    markers.mkdir()
    # A window budget of 5% brings the first window a few seconds in (at the default 0.5%: ~a minute).
    env = {
        **os.environ,
        "RANKSCOPE_SPOOL": str(spool),
        "RANKSCOPE_HOST": "nodeA",
        "RANKSCOPE_WINDOW_BUDGET": "0.05",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        "--rdzv-id",
        "lm-test",
        str(SCRIPTS["demo_job"]),
        "--seconds",
        "13",
        "--fault",
        "metrics_block",
        "--fault-rank",
        "1",
        "--onset-s",
        "3",
        "--marker-dir",
        str(markers),
        "--eval-every",
        "20",
        "--ckpt-every",
        "50",
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "eval loss" in run.stdout and "done:" in run.stdout

    recs = _records(spool / "lm-test")  # the job id is torchrun's run id
    steps = {r["rank"]: r for r in recs if r["type"] == "steps"}
    assert set(steps) == {0, 1}
    stepped = {  # a row holds n_steps steps: blocks of ~2 s
        rank: sum(
            row[STEP_COLUMNS.index("n_steps")]
            for r in recs
            if r["type"] == "steps" and r["rank"] == rank
            for row in r["rows"]
        )
        for rank in (0, 1)
    }
    assert min(stepped.values()) >= 50, stepped
    assert any(r["type"] == "window" for r in recs), "no profiling window summary"
    assert {r["host"] for r in recs if r["type"] == "rank"} == {"nodeA"}

    onset = json.loads((markers / "onset-r1").read_text())
    assert onset["rank"] == 1 and onset["step"] > 0 and not (markers / "onset-r0").exists()


@pytest.mark.slow
def test_a_rank_killed_under_torchrun_restarts_the_job_and_reliability_measures_the_cost(
    tmp_path: Path,
) -> None:
    from rankscope.diagnosis.ettr import CAUSES
    from tests.commands import rankscope

    spool, ckpt = tmp_path / "spool", tmp_path / "ckpt"
    # Restarts as torch 2.13 makes them work: a c10d rendezvous (each attempt a new round), and its
    # store not shared with the process group, which otherwise hands a restarted attempt its
    # predecessor's gloo addresses (pytorch/pytorch#135712; failed 1 run in 2 here without it).
    env = {**os.environ, "RANKSCOPE_SPOOL": str(spool), "RANKSCOPE_HOST": "nodeA"}
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
    cmd += [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "lm-restart",
    ]
    cmd += [str(SCRIPTS["demo_job"])]
    cmd += ["--seconds", "6", "--fault", "crash", "--fault-rank", "1", "--onset-s", "3"]
    cmd += ["--ckpt-every", "15", "--ckpt-dir", str(ckpt)]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as job:  # fmt: skip
        try:
            stdout, stderr = job.communicate(timeout=240)
        finally:
            with contextlib.suppress(ProcessLookupError):  # no worker outlives a failed test
                os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "attempt 1: resumed from the checkpoint" in stdout, stdout[-3000:]

    store = tmp_path / "store"
    assert rankscope("ingest", "--spool", str(spool), "--store", str(store)).returncode == 0
    out = rankscope("reliability", "--store", str(store), "--json")
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    first, second = r["attempts"]
    assert first["first_step"] == 0 and second["first_step"] > 0, (
        "attempt 1 resumes where a checkpoint left off"
    )
    assert second["first_step"] % 15 == 1, "...one step after the checkpoint's"
    assert first["last_step"] >= second["first_step"] - 1 and first["restart_s"] > 0
    # Why it ended: rank 1 went without a word (SIGKILL); its peer said how it ended.
    assert (first["failed_rank"], first["failure"]) == (1, "killed") and second["failure"] == ""
    assert r["failures"] == {"killed": 1} and r["lost_by_failure"]["killed"] >= first["restart_s"]
    # The killed rank's peer shipped its last steps as torchrun stopped it (the hook closes on
    # SIGTERM); none are redone only if the kill came right after a checkpoint (1 run in 15).
    assert first["redone_steps"] == max(0, first["last_step"] - second["first_step"] + 1)
    assert r["lost_s"]["redo"] == first["redo_s"] and (first["redo_s"] > 0) == (first["redone_steps"] > 0)
    assert r["saves"] >= 2 and r["loads"] == 1 and r["write_s"] > 0 and r["interval_s"] > 0
    assert r["restart_s"] == first["restart_s"] and r["expected_ettr"] is not None
    assert set(r["lost_s"]) == set(CAUSES) and r["lost_s"]["restart"] >= first["restart_s"]
    assert 0 < r["ettr"] < 1 and r["nodes"] == 1
    assert r["productive_s"] + sum(r["lost_s"].values()) == pytest.approx(r["wall_s"], rel=1e-3)
    text = rankscope("reliability", "--store", str(store))
    assert text.returncode == 0 and "attempt 1" in text.stdout and "ETTR" in text.stdout, text.stdout
    assert "failed: rank 1 [killed]" in text.stdout and "failures by class: killed 1x" in text.stdout
    fleet = rankscope("reliability", "--store", str(store), "--fleet").stdout
    assert fleet.splitlines()[1].split()[:3] == ["nodeA", "killed", "1x"] and "LEMON" not in fleet, fleet
    assert "failures by class over" in fleet and "killed 1x (" in fleet.splitlines()[-1], fleet
    # The diagnosis of the job that went on says why its first attempt died, and nothing else:
    # no straggler made of the crash: nothing else on the killed rank, nothing job-wide. (Rank 0
    # alone logs, evaluates and writes the checkpoint every 15 steps here: in one CI run in six its
    # own time read 1.16x its peers' in the restarted attempt, a straggler of its own duties.)
    out = rankscope("diagnose", "--store", str(store), "--job", "lm-restart", "--json")
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout)["findings"]
    failures = [f for f in found if f["cause"] == "failure"]
    assert len(failures) == 1, [f["summary"] for f in found]
    made_of_the_crash = [
        f for f in found if f["cause"] != "failure" and (1 in f["ranks"] or f["cause"] == "job_wide")
    ]
    assert not made_of_the_crash and all(f["ranks"] == [0] for f in found if f["cause"] != "failure"), [
        f["summary"] for f in found
    ]
    (f,) = failures
    assert (f["cause"], f["ranks"], f["hosts"]) == ("failure", [1], ["nodeA"]), f["summary"]
    assert (f["evidence"]["attempt"], f["evidence"]["class"], f["evidence"]["started_again"]) == (
        0,
        "killed",
        True,
    )
    own = json.loads(
        rankscope(
            "reliability", "--store", str(store), "--json", "--failures-per-1000-node-days", "store"
        ).stdout
    )
    node_days = r["nodes"] * r["wall_s"] / 86_400  # the store's only job: its one failure over its node-days
    assert own["failures_per_node_day"] == pytest.approx(1 / node_days, rel=1e-3)
    assert any("1 failures in" in n for n in own["notes"]) and own["mttf_s"] < r["mttf_s"]

    eff = rankscope("efficiency", "--store", str(store), "--json")
    assert eff.returncode == 0, eff.stderr
    e = json.loads(eff.stdout)
    assert [r["rank"] for r in e["ranks"]] == [0, 1] and e["device"] == "cpu"
    for r in e["ranks"]:  # DDP's all-reduces are timed, so the split is more than one figure
        assert 0 < r["comm_wait"] < 1 and r["own"] + r["comm_wait"] + r["data_wait"] == pytest.approx(
            1, abs=1e-3
        )
    fleet = rankscope("efficiency", "--store", str(store), "--fleet")
    assert fleet.returncode == 0 and "lm-restart" in fleet.stdout, fleet.stdout


def test_lm_scenarios_load_and_map_onto_the_suites_fault_families() -> None:
    lm = {s.name: s for s in load_all("full", ["lm-"])}
    assert len(lm) == 7 and all(s.script == "demo_job" and not s.ci for s in lm.values())
    assert {n for n, s in lm.items() if s.attach == "loop"} == {
        "lm-attach_at_loop-metrics_block-15ms-r3",
        "lm-attach_at_loop-slow_backward-1.7x-r1",
    }
    kinds = {s.kind for s in lm.values()}
    assert kinds == {"healthy", "dataloader", "compute", "code_path", "hang-checkpoint"}
    hang = lm["lm-hang_checkpoint-r2"]
    assert hang.fault.kind == "hang" and hang.observe_s > 0 and hang.faulty_ranks == (2,)


def test_a_script_scenario_runs_one_torchrun_per_simulated_host(tmp_path: Path) -> None:
    sc = load(SCENARIO_DIR / "lm-slow_data-15ms-r2.yaml")
    assert sc.attach == "start"
    spec = JobSpec(job="j1", world_size=4, hosts=2, hook={"spool_dir": "/s"}, marker_dir="/m")
    cmds = commands(sc, spec)
    assert [env["RANKSCOPE_HOST"] for _, env in cmds] == ["node0", "node1"]
    for node, (cmd, env) in enumerate(cmds):
        assert env["RANKSCOPE_SPOOL"] == "/s"
        assert cmd[cmd.index("--node-rank") + 1] == str(node) and cmd[cmd.index("--rdzv-id") + 1] == "j1"
        assert cmd[cmd.index("--fault") + 1] == "slow_data" and cmd[cmd.index("--fault-rank") + 1] == "2"

    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "script: demo_job\nfault: {kind: compute, rank: 1}\nexpect: {cause: compute, ranks: [1]}\n"
    )
    with pytest.raises(ScenarioError, match="unknown fault"):
        load(bad)
    bad.write_text("script: demo_job\nhosts: 3\n")
    with pytest.raises(ScenarioError, match="multiple of hosts"):
        load(bad)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "rank", "error", "klass", "said"),
    [
        ("cuda_error", 1, "RuntimeError", "gpu_hardware", "illegal memory access"),
        ("oom", 2, "torch.OutOfMemoryError", "out_of_memory", "CUDA out of memory"),
        ("bad_sample", 3, "zlib.error", "code", "truncated stream"),
    ],
)
def test_a_rank_whose_device_fails_is_named_first_with_its_error_not_the_ranks_stopped_after_it(
    tmp_path: Path, fault: str, rank: int, error: str, klass: str, said: str
) -> None:
    """A rank raises what PyTorch raises when its GPU fails under it, or runs out of memory, or
    what zlib raises on a truncated shard (a plain exception of the job's own data), 3 s in:
    its peers' collectives raise as it goes, torchrun stops the rest, the attempt ends. The
    diagnosis names that rank alone, by time, with its error, its class and the line it raised
    at; the reliability report puts the attempt down to it."""
    from tests.commands import rankscope, torchrun

    spool = tmp_path / "spool"
    env = {
        **os.environ,
        "RANKSCOPE_SPOOL": str(spool),
        "RANKSCOPE_JOB": "gpu-fault",
        "RANKSCOPE_HOST": "nodeA",
    }
    cmd = [
        *torchrun(4),
        str(SCRIPTS["demo_job"]),
        "--seconds",
        "20",
        "--fault",
        fault,
        "--fault-rank",
        str(rank),
    ]
    run = subprocess.run([*cmd, "--onset-s", "3"], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode != 0 and said in run.stderr, run.stderr[-3000:]
    store = tmp_path / "store"
    assert rankscope("ingest", "--spool", str(spool), "--store", str(store)).returncode == 0
    out = rankscope("diagnose", "--store", str(store), "--job", "gpu-fault", "--json")
    assert out.returncode == 0, out.stderr
    (f,) = json.loads(out.stdout)["findings"]
    assert (f["cause"], f["ranks"], f["hosts"]) == ("failure", [rank], ["nodeA"]), f["summary"]
    assert f["evidence"]["class"] == klass and f["evidence"]["error"] == error
    assert "demo_job.py" in f["function"] and f["evidence"]["step"] > 0
    assert set(f["evidence"]["others"]) == {str(r) for r in range(4)} - {str(rank)}, f["evidence"]
    r = json.loads(rankscope("reliability", "--store", str(store), "--job", "gpu-fault", "--json").stdout)
    (only,) = r["attempts"]
    assert (only["failed_rank"], only["failed_host"], only["failure"]) == (rank, "nodeA", klass), only
