"""What the hook costs the jobs users run: separate runs of each job with the hook and without.

    python -m benchmarks.overhead.job [--jobs demo_job,nanogpt,pipeline,hf_trainer] [--pairs 5]
                                      [--flags JOB=FLAGS ...] [--json PATH]
    python -m benchmarks.overhead.job --in-run [--block-s 0.5] [--jobs ...] [--flags ...] [--json PATH]

Each job is a real training script launched as a user launches it: a fresh ``torchrun`` of 4 CPU
(gloo) ranks on a free port, with a spool directory and a job id of its own. A pair is one run
with the hook at its defaults and one with it turned off by ``RANKSCOPE_ENABLE=0`` (``attach``
then gives a hook whose calls do nothing: the script is the same in both arms); the order
alternates pair by pair, so that a machine that drifts slower hits both arms alike. ``JOBS``
below holds each job's script and flags, chosen so that a run takes 60-90 s on a 2-core machine
(much of it torch's imports and the ranks' start-up, timed only in ``wall_s``); ``--flags
JOB=FLAGS`` replaces a job's flags (``--flags "pipeline=--steps 40"``: a short run to check the
benchmark, not to time).

Measured per run: the training loop's time per step, from the ``train: <steps> steps in <s> s
(<ms> ms/step)`` line rank 0 prints (``rankscope/demo_job.py`` says ``done:``), and the whole
run's wall time (start-up included). From the spool of a run with the hook, per rank: the
windows it took and what they cost it (the last heartbeat's cumulative ``windows`` and
``window_cost_us``), its window records, and the windows' share of its time (``window_cost_us``
over the time from its first record to its last).

Per job: ``off_ms_per_step`` and ``on_ms_per_step`` are the medians over runs; ``ratio_pct`` is
the ratio of those medians (in %) with ``ratio_ci95_pct`` its 95% bootstrap interval over pairs;
``median_pair_pct`` is the median of each pair's ratio, with ``median_ci95_pct`` (as
``benchmarks.overhead.hook`` computes them). The hook holds its windows to their budget from its
start on (``profiler_hook.budget``), so a short run is held to it as a long one is; a run's
first minute still pays for the hook's start-up (``attach`` imports what the profiler needs).

Separate runs resolve only what moves less than the machine's speed from run to run (here more
than 10%). ``--in-run`` measures inside one run of each job instead (``INRUN``): the
same script under ``benchmarks.overhead.blocks``, its hook alternately working and paused in
blocks of ``--block-s`` seconds, in pairs, as ``benchmarks.overhead.hook`` does on its MLP; per
pair the slowest rank's blocks. What it leaves out is what a paused hook still does: its watchdog
thread's heartbeats (not its stack samples, paused too), the gradient hooks that time DDP's
synchronization (they return at once while paused), and any effect of a window that outlives its
working block (the separate runs count those); and each block's first step, which carries the
switch itself (``blocks.SETTLING``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.overhead.hook import _figures, _option, _table
from benchmarks.procs import free_port
from rankscope.wire.records import RecordError, WindowSummary, decode

ROOT = Path(__file__).parents[2]
WORLD = 4
JOBS: dict[str, tuple[str, str]] = {
    "demo_job": ("rankscope/demo_job.py", "--seconds 40"),
    "nanogpt": ("benchmarks/jobs/nanogpt_like.py", "--seconds 40"),
    "pipeline": ("benchmarks/jobs/pipeline_dp.py", "--steps 300"),
    "hf_trainer": ("tests/jobs/hf_trainer.py", "{spool} {out} --max-steps 1600 --job {job}"),
}
"""Job -> (its script, relative to the checkout; its flags). ``{spool}``, ``{out}`` and ``{job}``
stand for the run's spool directory, a scratch directory and its job id. ``demo_job`` is the DDP
job ``rankscope demo`` trains (a small GPT) without a fault; ``pipeline`` is FSDP2 over dp × a 1F1B
pipeline; ``hf_trainer`` the Hugging Face ``Trainer`` with rankscope as its callback."""
INRUN: dict[str, tuple[str, int]] = {
    "demo_job": ("--seconds 240", 400),
    "nanogpt": ("--seconds 240", 300),
    "pipeline": ("--seconds 240", 150),
    "hf_trainer": ("{spool} {out} --max-steps 10000 --job {job}", 1000),
}
"""``--in-run``: each job's flags for one run of ~4 minutes (the ``Trainer``'s ~2), and the steps it
warms up for (~25 s) before its blocks begin."""
RUN_TIMEOUT_S = 600.0
"""A run still going after this long is stopped and the benchmark fails (a hung job)."""

_TRAIN_LINE = re.compile(
    r"^(?:train|done): (?P<steps>\d+) steps in (?P<s>[\d.]+) s \((?P<ms>[\d.]+) ms/step\)", re.M
)


def parse_train_line(output: str) -> dict[str, float]:
    """The training loop's steps, seconds and ms per step from a job's output (the last such
    line: rank 0's). Raises ValueError where there is none, with the output's tail."""
    found = list(_TRAIN_LINE.finditer(output))
    if not found:
        tail = "\n".join(output.splitlines()[-15:])
        raise ValueError(
            f"no 'train: N steps in S s (MS ms/step)' line in the job's output; its end:\n{tail}"
        )
    m = found[-1]
    return {"steps": int(m["steps"]), "loop_s": float(m["s"]), "ms_per_step": float(m["ms"])}


def spool_windows(spool: Path) -> dict[int, dict[str, Any]]:
    """Per rank, from a run's spool: its windows and their cost (the last heartbeat's cumulative
    fields; None from a hook that does not send them), its window records, the span of its
    records (s) and the windows' share of that span (%)."""
    last_beat: dict[int, Any] = {}
    records: dict[int, int] = defaultdict(int)
    first_us: dict[int, int] = {}
    last_us: dict[int, int] = {}
    for f in sorted(spool.rglob("*.jsonl")):
        for line in f.read_bytes().splitlines():
            try:
                rec = decode(line)
            except RecordError:
                continue  # a line torn by a rank's exit: the rest of the file still counts
            r = rec.rank
            first_us[r] = min(first_us.get(r, rec.time_us), rec.time_us)
            last_us[r] = max(last_us.get(r, rec.time_us), rec.time_us)
            if isinstance(rec, WindowSummary):
                records[r] += 1
            elif rec.TYPE == "heartbeat" and (r not in last_beat or rec.time_us >= last_beat[r].time_us):
                last_beat[r] = rec
    out: dict[int, dict[str, Any]] = {}
    for r in sorted(first_us):
        beat = last_beat.get(r)
        windows = getattr(beat, "windows", None)
        cost_us = getattr(beat, "window_cost_us", None)
        span_s = (last_us[r] - first_us[r]) / 1e6
        out[r] = {
            "windows": windows,
            "window_cost_us": cost_us,
            "window_records": records[r],
            "span_s": round(span_s, 3),
            "share_pct": round(100 * cost_us / 1e6 / span_s, 3)
            if cost_us is not None and span_s > 0
            else None,
        }
    return out


def command(job: str, spool: Path, out: Path, job_id: str, flags: str, blocks: bool = False) -> list[str]:
    """The ``torchrun`` command line of one run of ``job`` (tests/commands.py's free-port form);
    with ``blocks``, its script run by ``benchmarks.overhead.blocks``."""
    script, _ = JOBS[job]
    filled = flags.format(spool=spool, out=out, job=job_id)
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={WORLD}",
        f"--master-port={free_port()}",
        *(["-m", "benchmarks.overhead.blocks"] if blocks else []),
        str(ROOT / script),
        *shlex.split(filled),
    ]


def run_once(
    job: str, hook: bool, flags: str, index: int, blocks: dict[str, str] | None = None
) -> dict[str, Any]:
    """One run of ``job`` in a scratch directory of its own: its loop figures, wall time and,
    with the hook, its windows per rank; with ``blocks`` (``benchmarks.overhead.blocks``'
    settings), its blocks per rank."""
    with tempfile.TemporaryDirectory(prefix=f"rankscope-job-{job}-") as tmp:
        spool, out = Path(tmp, "spool"), Path(tmp, "out")
        job_id = f"{job}-{'on' if hook else 'off'}-{index}"
        # The hook at its defaults: no setting of the caller's environment reaches the ranks.
        env = {k: v for k, v in os.environ.items() if not k.startswith("RANKSCOPE_")}
        env.update(RANKSCOPE_SPOOL=str(spool), RANKSCOPE_JOB=job_id)
        if not hook:
            env["RANKSCOPE_ENABLE"] = "0"
        if blocks is not None:
            env.update(blocks, AB_OUT=str(Path(tmp, "blocks")))
        t0 = time.perf_counter()
        output, rc = _launch(command(job, spool, out, job_id, flags, blocks is not None), env)
        wall_s = time.perf_counter() - t0
        if rc != 0:
            tail = "\n".join(output.splitlines()[-20:])
            raise SystemExit(
                f"{job} ({'hook on' if hook else 'hook off'}) exited with {rc}; its end:\n{tail}"
            )
        ranks = spool_windows(spool)
        ab = [json.loads(f.read_text()) for f in sorted(Path(tmp, "blocks").glob("rank*.json"))]
    if blocks is not None and len(ab) != WORLD:
        raise SystemExit(f"{job}: {len(ab)} of its {WORLD} ranks wrote their blocks")
    if not hook and ranks:
        raise SystemExit(f"{job}: the run with RANKSCOPE_ENABLE=0 left records of ranks {sorted(ranks)}")
    if hook and len(ranks) != WORLD:
        raise SystemExit(f"{job}: the run with the hook left records of ranks {sorted(ranks)}, not {WORLD}")
    run = {"job": job, "hook": hook, "wall_s": round(wall_s, 2), **parse_train_line(output), "ranks": ranks}
    return {**run, "blocks": ab} if blocks is not None else run


def _launch(cmd: list[str], env: dict[str, str]) -> tuple[str, int]:
    """Run ``cmd`` in a session of its own, output captured; stop all of it (torchrun and its
    ranks) if it runs past ``RUN_TIMEOUT_S``."""
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        tail = "\n".join(output.splitlines()[-20:])
        raise SystemExit(
            f"{shlex.join(cmd[3:])}: still running after {RUN_TIMEOUT_S:.0f} s; its end:\n{tail}"
        ) from None
    return output, proc.returncode


def figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One job's figures from its runs (in pairs: each pair one run with the hook, one without,
    in either order)."""
    on = [r for r in runs if r["hook"]]
    off = [r for r in runs if not r["hook"]]
    on_ms, off_ms = [r["ms_per_step"] for r in on], [r["ms_per_step"] for r in off]
    ab = _figures([[a["loop_s"], a["steps"], b["loop_s"], b["steps"]] for a, b in zip(on, off, strict=True)])
    per_rank = sorted({rank for r in on for rank in r["ranks"]})

    def by_rank(field: str) -> list[Any]:
        return [_median([r["ranks"][rank][field] for r in on if rank in r["ranks"]]) for rank in per_rank]

    costs = [v["window_cost_us"] for r in on for v in r["ranks"].values()]
    windows = [v["windows"] for r in on for v in r["ranks"].values()]
    known = None not in costs and None not in windows and sum(windows) > 0
    return {
        "pairs": len(on),
        "off_ms_per_step": round(statistics.median(off_ms), 2),
        "on_ms_per_step": round(statistics.median(on_ms), 2),
        "ratio_pct": round((statistics.median(on_ms) / statistics.median(off_ms) - 1) * 100, 2),
        "ratio_ci95_pct": _ratio_interval(on_ms, off_ms),
        "median_pair_pct": ab["median_pair_pct"],
        "median_ci95_pct": ab["median_ci95_pct"],
        "pair_pct": ab["pair_pct"],
        "off_wall_s": round(statistics.median(r["wall_s"] for r in off), 1),
        "on_wall_s": round(statistics.median(r["wall_s"] for r in on), 1),
        "windows": by_rank("windows"),
        "window_records": by_rank("window_records"),
        "window_ms": round(sum(costs) / sum(windows) / 1e3, 1) if known else None,
        "windows_share_pct": by_rank("share_pct"),
    }


def block_figures(run: dict[str, Any]) -> dict[str, Any]:
    """One in-run job's figures from its ranks' blocks: per pair, the slowest rank's working and
    paused blocks (the job runs at its slowest rank's pace); and the CPU time all ranks' processes
    took per step (``cpu_ms_per_step``: paused, working), whose ratio moves far less with the
    machine's other load than the time does, and of that their training threads' (``train_cpu_``;
    the rest is the hook's threads, the backend's and the windows' summarizing: where a cost is).
    Runs kept before the training threads' time was recorded have none (None)."""
    ranks = [r["blocks"] for r in run["blocks"]]
    pairs, cpu_pairs, thread_pairs = [], [], []
    for i in range(0, min(map(len, ranks)) // 2 * 2, 2):
        per = [{mode: block for mode, *block in r[i : i + 2]} for r in ranks]
        on, off = per[0]["on"], per[0]["off"]
        pairs.append([max(p["on"][0] for p in per), on[1], max(p["off"][0] for p in per), off[1]])
        cpu_pairs.append([sum(p["on"][2] for p in per), on[1], sum(p["off"][2] for p in per), off[1]])
        if all(len(p["on"]) > 3 for p in per):
            thread_pairs.append([sum(p["on"][3] for p in per), on[1], sum(p["off"][3] for p in per), off[1]])
    if not pairs:
        raise SystemExit(f"{run['job']}: no pair of blocks; give it a longer run (--flags)")
    windows = [r["windows"] for r in run["blocks"]]
    cost_us = [r["window_cost_us"] for r in run["blocks"]]
    cpu = _figures(cpu_pairs)
    thread = _figures(thread_pairs) if len(thread_pairs) == len(pairs) else None
    return {
        "steps_per_block": run["blocks"][0]["steps_per_block"],
        **_figures(pairs),
        "cpu_ms_per_step": [cpu["off_ms_per_step"], cpu["on_ms_per_step"]],
        "cpu_pct": cpu["overhead_pct"],
        "cpu_ci95_pct": cpu["ci95_pct"],
        "train_cpu_ms_per_step": [thread["off_ms_per_step"], thread["on_ms_per_step"]] if thread else None,
        "train_cpu_pct": thread["overhead_pct"] if thread else None,
        "train_cpu_ci95_pct": thread["ci95_pct"] if thread else None,
        "windows": windows,
        "window_ms": round(sum(cost_us) / sum(windows) / 1e3, 1) if sum(windows) else 0.0,
        "windows_share_pct": [v["share_pct"] for _, v in sorted(run["ranks"].items())],
        "loop_s": run["loop_s"],
    }


def _median(values: list[Any]) -> Any:
    """The median of ``values``, None where any is unknown (a hook that does not send them)."""
    return None if not values or None in values else round(statistics.median(values), 3)


def _ratio_interval(on_ms: list[float], off_ms: list[float], n: int = 2000) -> list[float]:
    """The 95% interval of the ratio of the medians (in %), resampling pairs."""
    rng, idx = random.Random(0), range(len(on_ms))
    ratios = []
    for _ in range(n):
        pick = rng.choices(idx, k=len(on_ms))
        ratios.append(statistics.median(on_ms[i] for i in pick) / statistics.median(off_ms[i] for i in pick))
    ratios.sort()
    return [round((ratios[int(0.025 * n)] - 1) * 100, 2), round((ratios[int(0.975 * n)] - 1) * 100, 2)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of {', '.join(JOBS)}")
    p.add_argument("--pairs", type=int, default=5, help="runs with and without the hook, per job (default 5)")
    p.add_argument(
        "--flags", action="append", default=[], metavar="JOB=FLAGS", help="replace a job's flags (JOBS)"
    )
    p.add_argument(
        "--in-run",
        action="store_true",
        help="one run of each job (INRUN) in blocks, the hook working and paused",
    )
    p.add_argument("--block-s", type=float, default=0.5, help="--in-run: seconds per block (default 0.5)")
    p.add_argument(
        "--hook",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--in-run: a hook option away from its default, to find where a cost is",
    )
    p.add_argument("--json", help="write the results here")
    a = p.parse_args(argv)
    jobs = [j for j in a.jobs.split(",") if j]
    unknown = [j for j in jobs if j not in JOBS]
    if unknown or not jobs:
        raise SystemExit(f"--jobs {a.jobs!r}: unknown {unknown}; choose from {', '.join(JOBS)}")
    if a.pairs < 1:
        raise SystemExit(f"--pairs must be >= 1, got {a.pairs}")
    flags = {job: INRUN[job][0] if a.in_run else JOBS[job][1] for job in jobs}
    for text in a.flags:
        job, sep, value = text.partition("=")
        if not sep or job not in JOBS:
            raise SystemExit(f"--flags {text!r}: expected JOB=FLAGS with JOB one of {', '.join(JOBS)}")
        flags[job] = value
    t0 = time.perf_counter()
    rows, runs = [], []
    if a.in_run:
        options = dict(_option(o) for o in a.hook)
        for job in jobs:
            settings = {
                "AB_START_STEPS": str(INRUN[job][1]),
                "AB_BLOCK_S": str(a.block_s),
                "AB_HOOK": json.dumps(options),
            }
            run = run_once(job, True, flags[job], 0, settings)
            runs.append(run)
            rows.append({"job": job, **block_figures(run)})
            print(f"  {job}: {rows[-1]['pairs']} pairs, {rows[-1]['median_pair_pct']:+.2f}%", flush=True)
        result = {"benchmark": "job_overhead_in_run", "ranks": WORLD, "settings": options or "defaults", "flags": flags,
                  "block_s": a.block_s, "rows": rows, "runs": runs, "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        _table(rows, ["job", "pairs", "steps_per_block", "off_ms_per_step", "on_ms_per_step", "overhead_pct",
                      "ci95_pct", "median_pair_pct", "median_ci95_pct", "cpu_ms_per_step", "cpu_pct",
                      "cpu_ci95_pct", "train_cpu_ms_per_step", "train_cpu_pct", "train_cpu_ci95_pct", "windows",
                      "window_ms", "windows_share_pct"])  # fmt: skip
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=2))
        return result
    for job in jobs:
        mine = []
        for pair in range(a.pairs):
            for hook in (True, False) if pair % 2 == 0 else (False, True):
                run = run_once(job, hook, flags[job], pair)
                print(
                    f"  {job} pair {pair} hook {'on ' if hook else 'off'}: {run['ms_per_step']} ms/step, "
                    f"{run['steps']} steps, {run['wall_s']:.0f} s in all",
                    flush=True,
                )
                mine.append(run)
        runs += mine
        rows.append({"job": job, **figures(mine)})
    result = {
        "benchmark": "job_overhead",
        "ranks": WORLD,
        "settings": "defaults",
        "flags": flags,
        "rows": rows,
        "runs": runs,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    _table(rows, ["job", "pairs", "off_ms_per_step", "on_ms_per_step", "ratio_pct", "ratio_ci95_pct",
                  "median_pair_pct", "median_ci95_pct", "windows", "window_ms", "windows_share_pct",
                  "off_wall_s", "on_wall_s"])  # fmt: skip
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
