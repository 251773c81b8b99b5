"""``job_wide``: every rank slower than the job's own start (its latest attempt's), over its last
steps. It runs only when no other detector found anything (``detectors.DETECTORS``): a job-wide
slowdown is what is left when no rank, link or host stands out."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rankscope.wire.records import WAIT_KIND, WAIT_PATTERN
from rankscope.wire.settings import check_numbers

from .. import grid
from ..data import JobData
from ..findings import Finding, effect, ms


@dataclass(frozen=True, slots=True, kw_only=True)
class Settings:
    ratio: float = 1.3
    """All ranks' step time grew by this factor from the first to the last chunks: job-wide..."""
    own_ratio: float = 1.2
    """...or all ranks' own time grew by this factor..."""
    step_ratio: float = 1.05
    """...while step time grew by this factor at least (where collectives dominate the step,
    waiting absorbs part of everybody's slower work: a 1.8x slower compute on shared cores raises
    own time ~1.3x, step time ~1.13x). On healthy jobs
    there own time less the run-queue wait stays within 0.86-1.05x of its start (with the wait in
    it, it drifts up to ~1.3x)."""
    steps: int = 3000
    """Steps the rule looks back over, longer than the stragglers' ``last_steps``: it compares the
    latest chunks with the first, which is the job's own start in a younger job."""
    min_s: float = 20.0
    """...and only once those steps span this many seconds: the first seconds of a job (imports on
    background threads, allocator and cache warm-up, the first profiling windows) are no baseline.
    6-14 s into a healthy job, they read as a 1.3-1.4x job-wide slowdown."""
    warmup_steps: int = 10
    """The first steps left out..."""
    chunks: int = 6
    """...and the chunks the rest is cut into (first against last)."""

    def __post_init__(self) -> None:
        check_numbers(self)


def find(data: JobData, s: Settings) -> list[Finding]:
    """All ranks slower than the job's own start: one finding of scope ``job``, or none."""
    f = _find(data, s)
    return [f] if f is not None else []


def _find(data: JobData, s: Settings) -> Finding | None:
    # The job's own start is its latest attempt's: a restart's processes are new ones.
    steps = data.attempt_steps()
    if steps.empty:
        return None
    # The seconds the rule compares, the warm-up it leaves out not counted: a job's first step
    # holds its start-up (imports, building the model, the process group), often 10-20 s alone.
    lo = max(int(steps["step"].min()) + s.warmup_steps, int(steps["step"].max()) - s.steps + 1)
    recent = steps[steps["step"] >= lo]
    # The steps' time: a row of a large job's read stands for ``width`` steps (its means per step).
    if recent.empty or recent.groupby("step")["dur_us"].median().sum() * grid.width(recent) < s.min_s * 1e6:
        return None
    cut = grid.Cut(warmup_steps=s.warmup_steps, last_steps=s.steps, chunks=s.chunks)
    g = grid.grid(steps, cut, ["dur_us", "own_us", "cpu_us"])
    if g is None or len(np.unique(g.chunk)) < 3:
        return None
    last = sorted(np.unique(g.chunk))
    # The baseline: the job's own start, its first chunk, where the steps read begin with it; of
    # an older job, whose first chunk read is any 30 s of its life, the chunks before the last
    # two: a 20-minute healthy job's steps ran 1.25x faster for one such chunk (its cores freed
    # for a while), and the chunks after it read as a job-wide slowdown.
    young = g.first_step < int(steps["step"].min()) + s.warmup_steps + g.width
    before = last[:1] if young else last[:-2]
    growth: dict[str, tuple[float, np.ndarray]] = {}
    g.values["cpu_us"][g.values["cpu_us"] <= 0] = np.nan  # not read in that block
    for col in ("dur_us", "own_us", "cpu_us"):
        per = grid.chunk_medians(g, col, s.chunks)  # rank x chunk
        base = grid.nanmedian(per[:, before], axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = min(float(grid.nanmedian(per[:, c] / base, axis=0)) for c in last[-2:])
        growth[col] = (ratio, np.column_stack([base, per[:, last[-1]]]))
    # Step time carries every slowdown but also the job's tail (each step waits for its slowest
    # rank); own time is free of that noise for compute and data slowdowns. Own time alone is not
    # enough: the job must have become measurably slower too.
    step_ratio, own_ratio, cpu = growth["dur_us"][0], growth["own_us"][0], growth["cpu_us"][0]
    col = "dur_us"
    step_grew = step_ratio >= 1 + (s.ratio - 1) / 2
    if own_ratio > step_ratio and (step_grew or (step_ratio >= s.step_ratio and own_ratio >= s.own_ratio)):
        col = "own_us"
    ratio, per = growth[col]
    if not ratio >= (s.ratio if col == "dur_us" else s.own_ratio):
        return None
    ranks = [int(r) for r in g.ranks]
    what = "step time" if col == "dur_us" else "own time per step (outside collectives)"
    base_ms = ms(float(grid.nanmedian(per[:, 0], axis=0)))
    now_ms = ms(float(grid.nanmedian(per[:, 1], axis=0)))
    summary = f"all {len(ranks)} ranks slowed down together: {what} {ratio:.2f}x " + (
        "the job's own start" if young else f"the {len(before)} chunks of steps before"
    )
    evidence = {
        "metric": f"median {what}, last chunks vs {'first chunk' if young else 'the chunks before'}",
        "baseline_ms": base_ms,
        "now_ms": now_ms,
        "ratio": round(ratio, 3),
        "step_time_ratio": round(step_ratio, 3),
        # It held over the last two chunks at least: what a ticket counts the job's lost time by
        # (without it, a job-wide slowdown of any length was a ticket's lowest severity).
        "held_steps": int(g.chunk_steps(s.chunks)[last[-2:]].sum()),
    }
    waits, whose = _cpu_wait_growth(data), "threads"
    if waits is None:  # fewer than two windows: the training thread's wait, read in every block
        waits, whose = _step_wait_growth(g, before, last, s.chunks), "training thread"
    if waits is not None and waits[1] - waits[0] >= EXTERNAL_LOAD_SHARE * (now_ms - base_ms) > 0:
        summary += (
            f"; every rank's {whose} now wait{'s' if whose == 'training thread' else ''} "
            f"{waits[1] - waits[0]:.1f} ms more per step for a CPU "
            f"({waits[0]:.1f} -> {waits[1]:.1f} ms): other processes on the job's cores (external load)"
        )
        evidence.update(
            cpu_wait_ms_per_step_first=waits[0], cpu_wait_ms_per_step_last=waits[1], cpu_wait_of=whose
        )
    elif cpu - 1 >= CPU_TIME_SHARE * (ratio - 1) > 0:
        summary += (
            f"; every rank's steps also took {cpu:.2f}x the CPU time: more work per step, or slower "
            "cores (a throttled CPU, or caches and memory bandwidth shared with other processes)"
        )
    if np.isfinite(cpu):
        evidence["cpu_time_ratio"] = round(cpu, 3)
    return Finding(
        cause="job_wide",
        ranks=ranks,
        hosts=sorted(set(data.hosts().values())),
        function="step",
        confidence=round(effect(ratio), 3),
        summary=summary,
        evidence=evidence,
        scope="job",
    )


EXTERNAL_LOAD_SHARE = 0.5
"""A job-wide slowdown is put down to load from outside the job when the ranks' CPU wait per step
grew by at least this share of the step time's growth."""


CPU_TIME_SHARE = 0.5
"""...and to the work on the CPU, when no wait explains it and the ranks' CPU time per step grew by
at least this share of it: more work per step, or slower cores. On shared cores healthy jobs' CPU
time per step drifts up to ~1.22x over tens of seconds, their own time with it."""


def _step_wait_growth(
    g: grid.Grid, before: list[int], last: list[int], chunks: int
) -> tuple[float, float] | None:
    """The ranks' median run-queue wait per step of the training thread outside collectives (ms),
    in the baseline chunks and in the last two (the lesser), as the step time's growth is read:
    where no two windows read every thread's."""
    if "wait_us" not in g.values:
        return None
    per = grid.chunk_medians(g, "wait_us", chunks)  # rank x chunk
    first = float(grid.nanmedian(grid.nanmedian(per[:, before], axis=1), axis=0))
    now = min(float(grid.nanmedian(per[:, c], axis=0)) for c in last[-2:])
    if not (np.isfinite(first) and np.isfinite(now)):
        return None
    return round(first / 1e3, 3), round(now / 1e3, 3)


def _cpu_wait_growth(data: JobData) -> tuple[float, float] | None:
    """The ranks' median CPU wait per step (ms) of all their threads, in the first and the last
    profiling window (None: fewer than two windows)."""
    f = data.functions
    if f.empty:
        return None
    f = f[(f["kind"] == WAIT_KIND) & (f["name"] == WAIT_PATTERN)]
    if f["window"].nunique() < 2:
        return None
    per_step = f["total_us"].astype(float) / (f["step_hi"] - f["step_lo"]).clip(lower=1) / 1e3
    by_window = per_step.groupby(f["window"]).median().sort_index()
    return round(float(by_window.iloc[0]), 3), round(float(by_window.iloc[-1]), 3)
