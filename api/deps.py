"""What the routers and pages share: the service of the app, and an unknown job or ticket (404)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from rankscope.wire.errors import NotFoundError

from .service import JobState, Service
from .tickets import Ticket


def _service(request: Request) -> Service:
    return request.app.state.service


Svc = Annotated[Service, Depends(_service)]
"""A route parameter: the app's :class:`Service`."""


def known_job(svc: Service, job: str) -> JobState:
    js = svc.jobs.get(job)
    if js is None:
        raise NotFoundError(f"no job {job!r}")
    return js


def known_ticket(svc: Service, ticket_id: str) -> Ticket:
    t = svc.tickets.get(ticket_id)
    if t is None:
        raise NotFoundError(f"no ticket {ticket_id!r}")
    return t
