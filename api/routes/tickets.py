"""``/api/v1/tickets``: list and filter, one ticket with its timeline and deliveries, and the write actions."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from rankscope.diagnosis import CAUSES

from ..auth import need_read, need_write
from ..deps import Svc, known_ticket
from ..models import Action, TicketDetail, TicketOut

router = APIRouter(prefix="/api/v1/tickets", tags=["tickets"], dependencies=[Depends(need_read)])


@router.get("", response_model=list[TicketOut])
def list_tickets(
    svc: Svc,
    job: str | None = None,
    state: str | None = Query(None, pattern="^(open|acknowledged|resolved|active)$"),
    cause: str | None = Query(None, pattern="^(" + "|".join(CAUSES) + ")$"),
    limit: int = Query(500, ge=1, le=10000),
) -> list[dict]:
    """Tickets, the most recently updated first; ``state=active`` is open or acknowledged."""
    out = []
    for t in sorted(svc.tickets.values(), key=lambda t: -t.updated_us):
        if (job is not None and t.job != job) or (cause is not None and t.cause != cause):
            continue
        if state is not None and (t.state != state if state != "active" else not t.active):
            continue
        out.append(t.to_dict())
    return out[:limit]


@router.get("/{ticket_id}", response_model=TicketDetail)
def get_ticket(ticket_id: str, svc: Svc) -> dict:
    t = known_ticket(svc, ticket_id)
    return {**t.to_dict(), "deliveries": svc.deliveries(t.id)}


def _action(name: str):  # type: ignore[no-untyped-def]
    def act(ticket_id: str, svc: Svc, body: Action | None = None) -> dict:
        return svc.change_ticket(known_ticket(svc, ticket_id).id, name, body.reason if body else "").to_dict()

    act.__name__ = name
    act.__doc__ = f"{name.capitalize()} the ticket (write scope); the change joins its timeline."
    return act


for _name in ("acknowledge", "resolve", "silence", "unsilence"):
    router.post(
        f"/{{ticket_id}}/{_name}", response_model=TicketOut, name=_name, dependencies=[Depends(need_write)]
    )(_action(_name))
