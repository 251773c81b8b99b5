"""``/api/v1/jobs``: the jobs the service watches, their diagnosis, its history and the data behind the pictures."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from rankscope.diagnosis.efficiency import Efficiency
from rankscope.diagnosis.ettr import Reliability
from rankscope.renderers.html import MAX_POINTS, culprit_ranks, step_series
from rankscope.wire.errors import NotFoundError

from ..auth import need_read
from ..deps import Svc, known_job
from ..models import JobOut
from ..service import JobState, Service

router = APIRouter(prefix="/api/v1/jobs", tags=["jobs"], dependencies=[Depends(need_read)])


def job_out(svc: Service, js: JobState, now_us: int) -> JobOut:
    findings = (js.diagnosis or {}).get("findings", [])
    return JobOut(
        job=js.job,
        state=js.state(now_us, svc.settings.ended_after_s),  # type: ignore[arg-type]
        ranks=js.ranks,
        world_size=js.world_size,
        first_us=js.first_us,
        last_us=js.last_us,
        step=js.step,
        steps_per_s=round(js.steps_per_s, 3),
        findings=len(findings),
        open_tickets=sorted(t.id for t in list(svc.tickets.values()) if t.job == js.job and t.active),
        watching=sorted(js.pending),
    )


@router.get("", response_model=list[JobOut])
def list_jobs(
    svc: Svc, state: str | None = Query(None, pattern="^(running|slow|hung|ended)$")
) -> list[JobOut]:
    """Every job, the most recently active first."""
    now = svc.now_us
    out = [job_out(svc, js, now) for js in sorted(svc.jobs.values(), key=lambda j: -j.last_us)]
    return [j for j in out if state is None or j.state == state]


@router.get("/{job:path}/diagnosis")
def get_diagnosis(job: str, svc: Svc) -> dict[str, Any]:
    """The latest diagnosis, in the shape ``rankscope diagnose --json`` prints."""
    d = svc.diagnosis(known_job(svc, job).job)
    if d is None:
        raise NotFoundError(f"job {job!r} has not been diagnosed yet")
    return d.to_dict()


@router.get("/{job:path}/diagnoses")
def get_history(job: str, svc: Svc, limit: int = Query(50, ge=1, le=1000)) -> list[dict[str, Any]]:
    """The job's diagnoses, newest first: ``{"time_us", "diagnosis"}`` each."""
    return svc.history(known_job(svc, job).job, limit)


@router.get("/{job:path}/reliability")
def get_reliability(job: str, svc: Svc) -> dict[str, Any]:
    """ETTR, the time lost by cause, the attempts and the MTTF projection, in the shape
    ``rankscope reliability --json`` prints."""
    return _measured(svc.reliability(known_job(svc, job).job), job)


@router.get("/{job:path}/efficiency")
def get_efficiency(job: str, svc: Svc) -> dict[str, Any]:
    """Where the job's recent time went per rank (compute, collective wait, data wait, overhead), in
    the shape ``rankscope efficiency --json`` prints for the same steps."""
    return _measured(svc.efficiency(known_job(svc, job).job), job)


def _measured(m: Reliability | Efficiency | None, job: str) -> dict[str, Any]:
    if m is None:  # the measurements need steps
        raise NotFoundError(f"job {job!r} has no steps yet")
    return m.to_dict()


@router.get("/{job:path}/heatmap")
def get_heatmap(job: str, svc: Svc) -> dict[str, Any]:
    """Rank x function: each shown function's ms per step on each rank, from the profiling windows."""
    return svc.view(known_job(svc, job).job, "heatmap")  # type: ignore[no-any-return]


@router.get("/{job:path}/steps")
def get_steps(
    job: str,
    svc: Svc,
    points: int = Query(MAX_POINTS, ge=2, le=5000),
    ranks: Annotated[
        list[int] | None,
        Query(
            description="these ranks (default: every rank up to 16; beyond, the culprits and a spread of peers)"
        ),
    ] = None,
) -> dict[str, Any]:
    """Per rank: step time and own time (ms) by step, smoothed, at most about ``points`` points."""
    name = known_job(svc, job).job
    if points == MAX_POINTS and ranks is None:
        return svc.view(name, "steps")  # type: ignore[no-any-return]
    culprits = culprit_ranks(svc.diagnosis_or_empty(name))
    return step_series(svc.job_data(name), points, ranks, culprits)


@router.get("/{job:path}/windows")
def get_windows(job: str, svc: Svc) -> list[dict[str, Any]]:
    """The profiling windows: one row per window and rank."""
    with svc.lock:
        df = svc.store.windows(known_job(svc, job).job)
    return [{k: (v.item() if hasattr(v, "item") else v) for k, v in r.items()} for r in df.to_dict("records")]


# Last: a job id may hold '/' (``{job:path}``), so the routes of a job's parts must match first.
@router.get("/{job:path}", response_model=JobOut)
def get_job(job: str, svc: Svc) -> JobOut:
    return job_out(svc, known_job(svc, job), svc.now_us)
