"""The framework callbacks in real multi-process CPU runs: Lightning's DDP launcher and the Hugging
Face Trainer under torchrun, each with DDP over gloo and checkpoint saves, the hook attached only
through the callback."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rankscope.wire.records import STEP_COLUMNS
from tests.commands import torchrun

JOBS = Path(__file__).parent / "jobs"
BENCH_JOBS = Path(__file__).parents[1] / "benchmarks" / "jobs"


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run a training job in its own session (no process outlives it); its output."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), **(env or {})}
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True) as job:  # fmt: skip
        try:
            out, _ = job.communicate(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, out[-4000:]
    return out


def _records(spool: Path, job: str) -> list[dict]:
    return [json.loads(line) for p in (spool / job).glob("*.jsonl") for line in p.read_text().splitlines()]


def _check(recs: list[dict], steps: int, saves: tuple[int, ...] = (20, 40, 60)) -> None:
    """Both ranks shipped every step with DDP's all-reduce timed, and rank 0's checkpoints."""
    for rank in (0, 1):
        rows = [row for r in recs if r["type"] == "steps" and r["rank"] == rank for row in r["rows"]]
        assert sum(row[STEP_COLUMNS.index("n_steps")] for row in rows) == steps, (rank, rows)
        assert {row[0] for row in rows} >= {0}, "steps numbered by the framework's global step from 0"
        assert sum(row[4] for row in rows) > 0 and sum(row[5] for row in rows) >= steps, "comm_us, n_coll"
        assert sum(row[3] for row in rows) > 0, "data_us: the time between steps the loop fetched batches"
    saved = [r for r in recs if r["type"] == "checkpoint" and r["rank"] == 0]
    assert [s["step"] for s in saved] == list(saves) and all(s["dur_us"] > 0 for s in saved), saved
    assert {r["rank"] for r in recs if r["type"] == "rank"} == {0, 1}


@pytest.mark.slow
def test_the_lightning_callback_in_a_two_process_ddp_fit(tmp_path: Path) -> None:
    pytest.importorskip("lightning", reason="pip install rankscope[lightning] (./dev test installs it)")
    spool = tmp_path / "spool"
    _run([sys.executable, str(JOBS / "lightning_ddp.py"), str(spool), str(tmp_path / "ckpt")], tmp_path)
    _check(_records(spool, "lightning-job"), 60)


@pytest.mark.slow
def test_the_hugging_face_callback_in_a_two_process_trainer_under_torchrun(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="pip install rankscope[hf] (./dev test installs it)")
    spool = tmp_path / "spool"
    out = _run(
        # Windows every second whatever they cost: several to compare across the ranks.
        [
            *torchrun(2),
            str(JOBS / "hf_trainer.py"),
            str(spool),
            str(tmp_path / "out"),
            "1.0",
            "--window-budget",
            "1",
        ],
        tmp_path,
    )
    recs = _records(spool, "hf-job")
    _check(recs, 2400, saves=(800, 1600, 2400))
    # Its DDP holds a collective of each backward pass until the next: windows start all the same.
    windows = {r: [w["window"] for w in recs if w["type"] == "window" and w["rank"] == r] for r in (0, 1)}
    said = [line for line in out.splitlines() if "rankscope" in line]
    assert len(windows[0]) >= 2 and windows[0] == windows[1], (windows, said)


@pytest.mark.slow
def test_a_nanogpt_like_script_with_the_hook_added_at_its_loop_gets_its_stall_named_by_its_line(
    tmp_path: Path,
) -> None:
    """nanoGPT's train.py wraps its model in DDP at module level, long before a user adds a hook at
    the loop; rank 1 sleeps 40 ms before each backward pass, in that loop. The hook finds the model
    all the same: its peers wait in DDP's all-reduce for rank 1 in its step rows. The diagnosis
    names rank 1, and the line of the module-level loop it sleeps at: a code path, not compute in
    an operator that ran a little slower beside it."""
    spool, store = tmp_path / "spool", tmp_path / "store"
    script = BENCH_JOBS / "nanogpt_like.py"
    stall = ["--seconds", "25", "--fault", "stall", "--fault-rank", "1", "--fault-ms", "40", "--onset-s", "0"]
    _run(
        [*torchrun(4), str(script), *stall],
        tmp_path,
        {"RANKSCOPE_SPOOL": str(spool), "RANKSCOPE_JOB": "nanogpt"},
    )
    recs = _records(spool, "nanogpt")
    ranks = [r for r in recs if r["type"] == "rank"]
    assert {r["rank"] for r in ranks} == {0, 1, 2, 3}
    assert all("DDP GPT on world: timed per backward pass" in r["coverage"] for r in ranks), ranks
    wait = {}
    for rank in (0, 1, 2, 3):
        rows = [row for r in recs if r["type"] == "steps" and r["rank"] == rank for row in r["rows"]]
        wait[rank] = sum(row[4] for row in rows) / sum(row[STEP_COLUMNS.index("n_steps")] for row in rows)
    assert min(wait[r] for r in (0, 2, 3)) > wait[1] + 30_000, wait  # µs a step: the others wait for rank 1
    rankscope = [sys.executable, "-m", "rankscope.cli"]
    _run([*rankscope, "ingest", "--spool", str(spool), "--store", str(store)], tmp_path)
    diagnosis = json.loads(_run([*rankscope, "diagnose", "--store", str(store), "--json"], tmp_path))
    sleep_line = next(i for i, ln in enumerate(script.read_text().splitlines(), 1) if "time.sleep(" in ln)
    assert [(f["cause"], f["ranks"], f["function"]) for f in diagnosis["findings"]] == [
        ("code_path", [1], f"nanogpt_like.py({sleep_line}): <module>")
    ], diagnosis["findings"]
