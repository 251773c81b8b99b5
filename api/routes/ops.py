"""``/healthz`` and Prometheus ``/metrics`` of the service itself (no token needed: no job data)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..service import Service

router = APIRouter(tags=["service"])


@router.get("/healthz")
def healthz(request: Request) -> JSONResponse:
    """200 while cycles succeed; 503 with the reason when the last one failed (the store is down…)."""
    svc: Service = request.app.state.service
    st = svc.stats
    body = {
        "status": "ok" if not st.problem else "failing",
        "problem": st.problem,
        "cycles": st.cycles,
        "last_cycle_s": round(st.last_cycle_s, 3),
        "seconds_since_cycle": round(time.time() - st.last_cycle_end, 1) if st.last_cycle_end else None,
    }
    return JSONResponse(body, status_code=503 if st.problem else 200)


class _Collector:
    def __init__(self, svc: Service) -> None:
        self.svc = svc

    def collect(self) -> Iterator[Metric]:
        st, n = self.svc.stats, self.svc.notifier
        yield GaugeMetricFamily(
            "rankscope_serve_cycle_seconds", "Duration of the last cycle", st.last_cycle_s
        )
        yield CounterMetricFamily("rankscope_serve_cycles", "Cycles run", st.cycles)
        yield CounterMetricFamily("rankscope_serve_cycle_errors", "Cycles that failed", st.cycle_errors)
        yield GaugeMetricFamily(
            "rankscope_serve_jobs_watched", "Jobs known to the service", len(self.svc.jobs)
        )
        yield GaugeMetricFamily(
            "rankscope_serve_jobs_diagnosed",
            "Jobs this replica diagnoses (the others' go to the other live replicas)",
            sum(map(self.svc.owns, list(self.svc.jobs))),
        )
        yield GaugeMetricFamily(
            "rankscope_serve_replicas", "Live replicas sharing the store", len(self.svc.replicas)
        )
        yield CounterMetricFamily(
            "rankscope_serve_ingested_records", "Records read from the spool", st.ingested
        )
        tickets = GaugeMetricFamily("rankscope_serve_tickets", "Tickets by state", labels=["state"])
        by_state = Counter(t.state for t in list(self.svc.tickets.values()))
        for state in ("open", "acknowledged", "resolved"):
            tickets.add_metric([state], by_state[state])
        yield tickets
        yield CounterMetricFamily(
            "rankscope_serve_webhook_deliveries", "Webhook posts answered 2xx", n.delivered
        )
        yield CounterMetricFamily("rankscope_serve_webhook_failures", "Webhook posts that failed", n.failed)


@router.get("/metrics")
def metrics(request: Request) -> Response:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(request.app.state.service))  # type: ignore[arg-type]
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
