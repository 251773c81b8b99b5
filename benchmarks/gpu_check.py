"""rankscope on one GPU: what the hook captures and costs there, and what the diagnosis makes of it.

    python -m benchmarks.gpu_check [--out DIR] [--json PATH] [--only loops,scenarios] [--seconds 20]
    python -m benchmarks.gpu_check --diagnose DIR [--json PATH]

Runs ``benchmarks/jobs/gpu_gpt.py`` (a small GPT, bf16 autocast, fused AdamW, a pinned-memory
``DataLoader``, the loss read every 10th step) under ``torchrun`` with the hook at its defaults, on
the torch the machine has, and prints one table (``--json``: the same as data):

- **loops** (one rank, NCCL): a launch-bound loop (d 384, 6 layers, seq 256: many short kernels)
  and a compute-bound one (d 2048, 8 layers, seq 1024), each run without the hook and with it as
  separate runs (ms per step after the warm-up, windows included: what a window leaves behind
  counts), the launch-bound one also with ``TEARDOWN_CUPTI=1``, and each once with the hook worked
  and paused in alternating blocks (the in-run A/B). From the runs with the hook, its spool: the
  windows stored, the GPU kernels and NCCL kernels per window, the NCCL collectives' GPU time per
  step from the step rows, the rank record's coverage, and the longest window start and stop on
  the training thread.
- **scenarios** (four ranks sharing the GPU over gloo with CUDA tensors, under MPS where it starts:
  NCCL refuses two ranks on one GPU): healthy; rank 2's GPU slower (an MPS share of 25% of the
  SMs; without MPS, its batch padded to 1.5x the work); rank 3 blocking 60 ms in a metrics upload
  every 5th step; rank 1 hanging in a checkpoint save. Their spools are kept under ``DIR``.

Each scenario's diagnosis needs the store (chDB), which a GPU machine may not have: where it can be
imported the scenarios are diagnosed at once, else ``--diagnose DIR`` does it on a machine that has
it (copy ``DIR`` there) and prints the table with the diagnoses. About 8 minutes by estimate;
``--only`` splits it in two where a command may run 10 minutes at most.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rankscope.wire.errors import RecordError
from rankscope.wire.records import RankInfo, StepBatch, WindowSummary, decode

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "benchmarks" / "jobs" / "gpu_gpt.py"
LOOPS = {
    "launch": [
        "--d-model",
        "384",
        "--n-layer",
        "6",
        "--n-head",
        "6",
        "--seq-len",
        "256",
        "--batch-size",
        "8",
    ],
    "compute": [
        "--d-model",
        "2048",
        "--n-layer",
        "8",
        "--n-head",
        "16",
        "--seq-len",
        "1024",
        "--batch-size",
        "8",
    ],
}
"""Loop shape -> gpu_gpt.py's model flags."""
RUNS: dict[str, list[tuple[str, dict[str, str]]]] = {
    "launch": [("off", {}), ("on", {}), ("off", {}), ("on", {}), ("on", {"TEARDOWN_CUPTI": "0"})],
    "compute": [("off", {}), ("on", {})],
}
"""Loop shape -> separate runs (hook mode, extra environment), in this order: the hook detaches CUPTI
between windows (``profiler_hook.cupti``), and ``TEARDOWN_CUPTI=0`` leaves it attached as kineto does."""
HANG_ONSET_S = 8.0
"""The hang scenario's rank hangs this long into training..."""
HANG_OBSERVE_S = 35.0
"""...and the job runs this long after that before it is stopped (the hook reports a stall after 10 s)..."""
START_S = 25.0
"""...counted from this long after its launch (imports, CUDA, CUPTI and the process group)."""
SCENARIOS: dict[str, dict[str, Any]] = {
    "healthy": {"flags": [], "expect": None},
    "slow_gpu": {"flags": ["--fault", "slow_gpu", "--fault-rank", "2"], "expect": ("compute", 2, "")},
    "stall": {
        "flags": ["--fault", "stall", "--fault-rank", "3", "--fault-ms", "60", "--every", "5"],
        "expect": ("code_path", 3, "upload_metrics"),
    },
    "hang": {
        "flags": ["--fault", "hang", "--fault-rank", "1", "--onset-s", str(HANG_ONSET_S)],
        "expect": ("hang", 1, "save_checkpoint"),
    },
}
"""Scenario -> gpu_gpt.py's fault flags and the finding expected: (cause, rank, function part)."""
SCENARIO_FLAGS = [
    "--d-model",
    "256",
    "--n-layer",
    "4",
    "--n-head",
    "4",
    "--seq-len",
    "1024",
    "--batch-size",
    "32",
]
"""Few parameters and many tokens, so that the GPU's work, not gloo's all-reduce of the gradients
through host memory, holds most of a step: at d 512 and 2,048 tokens a step (the H200's run of
2026-11-30) the all-reduce took 38 of 62 ms and the kernels under 2 ms, and a GPU whose kernels ran
2.6x slower did not slow the job."""


def _torchrun(nproc: int, flags: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(JOB),
    ]
    # The job imports the hook from this checkout, installed or not (a GPU machine lent for a check).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    with log.open("w") as fh:
        proc = subprocess.Popen(
            cmd + flags, env={**os.environ, "PYTHONPATH": path, **env}, stdout=fh, stderr=subprocess.STDOUT
        )
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                return proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                return proc.wait()


def read_spool(spool: Path) -> list[Any]:
    """Every record of a spool directory (any job); lines that do not decode are left out."""
    out = []
    for f in sorted(spool.rglob("*.jsonl")):
        for line in f.read_bytes().splitlines():
            try:
                out.append(decode(line))
            except RecordError:
                continue
    return out


def spool_figures(records: list[Any]) -> dict[str, Any]:
    """What the hook stored: windows, kernels per window, NCCL time per step, coverage."""
    wins = [r for r in records if isinstance(r, WindowSummary)]
    rows = [row for r in records if isinstance(r, StepBatch) for row in r.rows]
    ranks = [r for r in records if isinstance(r, RankInfo)]
    steps = sum(row.n_steps for row in rows)
    return {
        "windows": len(wins),
        "kernels_per_window": [sum(1 for f in w.functions if f.kind == "kernel") for w in wins],
        "nccl_kernels_per_window": [
            sum(1 for f in w.functions if f.kind == "collective" and f.name.startswith("nccl")) for w in wins
        ],
        "kernels_with_operator": sum(1 for w in wins for f in w.functions if f.kind == "kernel" and f.stack),
        "comm_us_per_step": sum(row.comm_us for row in rows) / steps if steps else None,
        "steps_with_comm": sum(row.n_steps for row in rows if row.comm_us > 0) / steps if steps else None,
        "coverage": ranks[-1].coverage if ranks else "",
    }


def _save(out: Path, result: dict[str, Any]) -> None:
    """What has run so far, kept after each run: a command cut short by its time limit loses none."""
    (out / "result.json").write_text(json.dumps(result, indent=1))


def run_loops(out: Path, seconds: float, result: dict[str, Any]) -> None:
    """The loops' runs, into ``result["loops"]``."""
    loops = result["loops"] = {}
    for loop, flags in LOOPS.items():
        runs: list[dict[str, Any]] = []
        loops[loop] = runs
        for i, (mode, extra) in enumerate([*RUNS[loop], ("ab", dict[str, str]())]):
            name = f"{loop}-{i}-{mode}" + ("-attached" if extra else "")
            d = out / "loops" / name
            d.mkdir(parents=True, exist_ok=True)
            env = {"RANKSCOPE_SPOOL": str(d / "spool"), "RANKSCOPE_JOB": name, **extra}
            length = seconds + 15 if mode == "ab" else seconds
            job = [
                "--backend",
                "nccl",
                "--hook",
                mode,
                "--seconds",
                str(length),
                "--out",
                str(d / "run.json"),
            ]
            t0 = time.perf_counter()
            rc = _torchrun(1, flags + job, env, d / "log.txt", timeout=length + 180)
            run: dict[str, Any] = {
                "name": name,
                "mode": mode,
                "env": extra,
                "rc": rc,
                "wall_s": time.perf_counter() - t0,
            }
            if (d / "run.json").exists():
                run.update(json.loads((d / "run.json").read_text()))
            if mode != "off":
                run.update(spool_figures(read_spool(d / "spool")))
            runs.append(run)
            _save(out, result)
            print(f"  {name}: rc {rc}, {run.get('ms_per_step', float('nan')):.2f} ms/step", flush=True)


def _mps(start: bool) -> bool:
    """Start (or stop) the CUDA MPS daemon; whether it runs."""
    try:
        if start:
            return (
                subprocess.run(["nvidia-cuda-mps-control", "-d"], capture_output=True, timeout=30).returncode
                == 0
            )
        subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        pass
    return False


def run_scenarios(out: Path, seconds: float, result: dict[str, Any]) -> None:
    """The scenarios' runs, into ``result["scenarios"]``."""
    mps = _mps(start=True)
    scenarios: dict[str, Any] = {"mps": mps, "runs": {}}
    result["scenarios"] = scenarios
    try:
        for name, sc in SCENARIOS.items():
            d = out / "scenarios" / name
            d.mkdir(parents=True, exist_ok=True)
            flags = SCENARIO_FLAGS + sc["flags"] + ["--backend", "gloo", "--seconds", str(seconds)]
            if name == "slow_gpu" and mps:
                flags += ["--mps-pct", "25"]
            timeout = START_S + HANG_ONSET_S + HANG_OBSERVE_S if name == "hang" else seconds + 180
            env = {"RANKSCOPE_SPOOL": str(d / "spool"), "RANKSCOPE_JOB": f"gpu-{name}"}
            t0 = time.perf_counter()
            rc = _torchrun(4, flags, env, d / "log.txt", timeout=timeout)
            figures = spool_figures(read_spool(d / "spool"))
            scenarios["runs"][name] = {
                "rc": rc,
                "wall_s": time.perf_counter() - t0,
                "job": f"gpu-{name}",
                **figures,
            }
            _save(out, result)
            print(f"  {name}: rc {rc}, {figures['windows']} windows", flush=True)
    finally:
        if mps:
            _mps(start=False)


def diagnose_scenarios(out: Path, scenarios: dict[str, Any]) -> None:
    """Ingest each scenario's spool into a store of its own and diagnose it (needs the server extra)."""
    from rankscope.aggregator import Store, ingest
    from rankscope.diagnosis import diagnose, read_job

    for name, run in scenarios["runs"].items():
        with tempfile.TemporaryDirectory() as tmp, Store.embedded(tmp) as store:
            ingest(out / "scenarios" / name / "spool", store)
            d = diagnose(read_job(store, run["job"]))
        top = d.findings[0] if d.findings else None
        run["finding"] = (
            {
                "cause": top.cause,
                "ranks": top.ranks,
                "function": top.function,
                "confidence": top.confidence,
            }
            if top
            else None
        )
        run["findings"] = len(d.findings)
        expect = SCENARIOS[name]["expect"]
        if expect is None:
            run["right"] = top is None
        else:
            cause, rank, function = expect
            run["right"] = (
                top is not None and top.cause == cause and top.ranks == [rank] and function in top.function
            )


def _environment() -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:
            env["nccl"] = f"unknown ({exc})"
    return env


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _tail(function: str, width: int = 36) -> str:
    """The end of a long function name: where a hang's frame names its function."""
    return function if len(function) <= width else "…" + function[-width + 1 :]


def report(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        f"rankscope gpu_check: {env.get('gpu', 'no GPU')}, torch {env['torch']}, CUDA {env['cuda']}, NCCL {env.get('nccl')}"
    ]
    for loop, runs in result.get("loops", {}).items():
        lines.append(f"\n{loop}-bound loop, 1 rank NCCL: separate runs (ms/step after warm-up)")
        lines.append(
            f"  {'run':28} {'ms/step':>8} {'windows':>7} {'kernels/win':>11} {'nccl k/win':>10} {'comm us/step':>12} {'start ms':>8} {'stop ms':>8}"
        )
        for r in runs:
            starts, stops = r.get("window_start_s") or [], r.get("window_stop_s") or []
            lines.append(
                f"  {r['name']:28} {_fmt(r.get('ms_per_step')):>8} {r.get('windows', '-')!s:>7} "
                f"{_fmt(statistics.median(r['kernels_per_window']) if r.get('kernels_per_window') else None, '.0f'):>11} "
                f"{_fmt(statistics.median(r['nccl_kernels_per_window']) if r.get('nccl_kernels_per_window') else None, '.0f'):>10} "
                f"{_fmt(r.get('comm_us_per_step'), '.0f'):>12} "
                f"{_fmt(1e3 * max(starts) if starts else None, '.0f'):>8} {_fmt(1e3 * max(stops) if stops else None, '.0f'):>8}"
            )
        off = [r["ms_per_step"] for r in runs if r["mode"] == "off" and r.get("ms_per_step")]
        on = [r["ms_per_step"] for r in runs if r["mode"] == "on" and not r["env"] and r.get("ms_per_step")]
        if off and on:
            lines.append(
                f"  separate runs: hook {100 * (statistics.median(on) / statistics.median(off) - 1):+.2f}% (median of each arm); "
                f"without it {min(off):.2f}-{max(off):.2f} ms/step"
            )
        ab: dict[str, Any] = next((r for r in runs if r["mode"] == "ab"), {})
        lines.append(
            f"  in-run A/B: {_fmt(ab.get('ab_overhead_pct'), '+.2f')}% over {ab.get('ab_pairs', 0)} pairs, "
            f"median pair {_fmt(ab.get('ab_median_pair_pct'), '+.2f')}%"
        )
        cov = next((r["coverage"] for r in runs if r.get("coverage")), "")
        lines.append(f"  coverage: {cov}")
    sc = result.get("scenarios")
    if sc:
        lines.append(
            f"\nscenarios, 4 ranks on one GPU over gloo ({'MPS' if sc['mps'] else 'no MPS: the slower GPU padded'})"
        )
        lines.append(f"  {'scenario':10} {'rc':>4} {'windows':>7} {'finding':60} right")
        for name, r in sc["runs"].items():
            f = r.get("finding", "not diagnosed")
            said = (
                f if isinstance(f, str) else "no finding" if f is None
                else f"{f['cause']} rank {','.join(map(str, f['ranks']))} {_tail(f['function'])} ({f['confidence']:.2f})"
            )  # fmt: skip
            lines.append(f"  {name:10} {r['rc']:>4} {r['windows']:>7} {said:60} {r.get('right', '-')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="gpu-check", help="where the runs' spools, logs and results go")
    ap.add_argument("--only", default="loops,scenarios")
    ap.add_argument("--seconds", type=float, default=20.0, help="each run's training time")
    ap.add_argument("--diagnose", default="", help="diagnose the scenarios of an earlier run's --out")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    result: dict[str, Any]
    if args.diagnose:
        out = Path(args.diagnose)
        result = json.loads((out / "result.json").read_text())
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check needs a CUDA GPU: torch.cuda.is_available() is False here", file=sys.stderr)
            return 2
        out = Path(args.out)
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        parts = set(args.only.split(","))
        result = {"environment": _environment()}
        if "loops" in parts:
            run_loops(out, args.seconds, result)
        if "scenarios" in parts:
            run_scenarios(out, args.seconds, result)
        _save(out, result)
    if "scenarios" in result:
        try:
            diagnose_scenarios(out, result["scenarios"])
        except ImportError as exc:
            print(
                f"(not diagnosed here: {exc}; run `python -m benchmarks.gpu_check --diagnose {out}` where the store is)"
            )
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
