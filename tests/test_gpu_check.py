"""``benchmarks.gpu_check`` and its job, as far as a machine without a GPU can hold them: the job
script runs (on the CPU over gloo, as it does without CUDA) and its spool reads as gpu_check reads
it; gpu_check itself says plainly that it needs a GPU. The GPU runs are in the issue's notes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check
from rankscope.wire.records import Heartbeat
from tests.commands import torchrun


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 2
    assert "gpu_check needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_gpu_job_runs_and_its_spool_reads_as_gpu_check_reads_it(tmp_path: Path) -> None:
    """Two ranks of gpu_gpt.py (on the CPU here), rank 1 blocking in ``upload_metrics`` every 5th
    step from 4 s on: the run's measurements are written, each rank stored its first window (a
    window budget of 5% brings it a few seconds in; at the default 0.5%, a minute), rank 1's
    heartbeats' stack samples name the upload, and every step row has collective time."""
    out = tmp_path / "run.json"
    env = {**os.environ, "RANKSCOPE_SPOOL": str(tmp_path / "spool"), "RANKSCOPE_JOB": "gpu-smoke",
           "RANKSCOPE_WINDOW_BUDGET": "0.05"}  # fmt: skip
    flags = ["--d-model", "64", "--n-layer", "2", "--n-head", "4", "--seq-len", "32", "--vocab", "256"]
    flags += [
        "--seconds",
        "22",
        "--warmup-steps",
        "20",
        "--fault",
        "stall",
        "--fault-rank",
        "1",
        "--onset-s",
        "4",
    ]
    subprocess.run(
        [*torchrun(2), str(gpu_check.JOB), *flags, "--out", str(out)],
        env=env,
        check=True,
        timeout=180,
        capture_output=True,
    )
    run = json.loads(out.read_text())
    assert run["world"] == 2 and run["ms_per_step"] > 0 and run["steps"] > 100, run
    assert len(run["window_start_s"]) == len(run["window_stop_s"]) >= 1, run
    records = gpu_check.read_spool(tmp_path / "spool")
    figures = gpu_check.spool_figures(records)
    assert figures["windows"] >= 2, figures
    assert figures["steps_with_comm"] == 1.0 and figures["comm_us_per_step"] > 0, figures
    assert "DDP GPT on world: timed per backward pass" in figures["coverage"], figures
    uploads = {
        r.rank for r in records if isinstance(r, Heartbeat) for key in r.samples if "upload_metrics" in key
    }
    assert 1 in uploads, uploads
    table = gpu_check.report(
        {
            "environment": {"torch": torch.__version__, "cuda": None},
            "loops": {"launch": [{"name": "smoke", "mode": "on", "env": {}, **run, **figures}]},
        }
    )
    assert "smoke" in table and f"{run['ms_per_step']:.2f}" in table, table
