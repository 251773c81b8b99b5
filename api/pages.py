"""The web page: a jobs list, a job page (findings, tickets, heatmap, step charts) and a ticket page.

Server-rendered HTML with inline SVG (the report's renderer), no scripts and no network; pages of
jobs that still run reload themselves every few seconds.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from html import escape as _e
from urllib.parse import quote

from fastapi import APIRouter, Depends
from fastapi.responses import HTMLResponse

from rankscope.diagnosis import Diagnosis
from rankscope.renderers.html import efficiency_section, page, reliability_section, render_report

from .auth import need_read
from .deps import Svc, known_job, known_ticket
from .tickets import Ticket, TicketSettings, culprit, fingerprint, open_after_s

router = APIRouter(tags=["pages"], include_in_schema=False, dependencies=[Depends(need_read)])
REFRESH_S = 5
_CSS = """
table.list{border-collapse:collapse;margin:8px 0}table.list td,table.list th{padding:4px 12px;
border-bottom:1px solid #eee;text-align:left;font-size:13.5px}table.list th{color:#666;font-weight:600}
.st{border-radius:3px;padding:1px 7px;color:#fff;font-size:12.5px}.st.running,.st.resolved{background:#43a047}
.st.slow,.st.open{background:#b2182b}.st.hung{background:#6a1b9a}.st.ended{background:#888}
.st.acknowledged{background:#ef6c00}
"""


def _time(us: int) -> str:
    return datetime.fromtimestamp(us / 1e6, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if us else "—"


def _refresh(active: bool) -> str:
    return f'<meta http-equiv="refresh" content="{REFRESH_S}">' if active else ""


def _html(title: str, body: str, head: str = "") -> HTMLResponse:
    return HTMLResponse(page(title, body, head + f"<style>{_CSS}</style>"))


def _ticket_rows(tickets: list[Ticket]) -> str:
    if not tickets:
        return '<p class="note">No tickets.</p>'
    rows = "".join(
        f'<tr><td><a href="/tickets/{quote(t.id)}">{_e(t.id)}</a></td>'
        f'<td><span class="st {t.state}">{t.state}</span>{" (silenced)" if t.silenced else ""}</td>'
        f"<td>{_e(t.job)}</td><td>{_e(t.cause)}</td><td>{_e(t.culprit)}</td><td>{t.severity}</td>"
        f"<td>{t.lost_rank_s:g}</td><td>{_time(t.opened_us)}</td></tr>"
        for t in tickets
    )
    head = "<tr><th>ticket</th><th>state</th><th>job</th><th>cause</th><th>culprit</th><th>severity</th>"
    return f'<table class="list">{head}<th>lost rank-s</th><th>opened</th></tr>{rows}</table>'


def _watched(d: Diagnosis, pending: dict[str, int], now_us: int, rules: TicketSettings) -> str:
    """The findings not yet sure enough to ticket (``TicketSettings.open_after_s``): shown, paging no one."""
    rows = [
        f"<li>{_e(f.cause)} on {_e(culprit(f))} (confidence {f.confidence:.2f}), seen for "
        f"{(now_us - pending[fp]) / 1e6:.0f} s of the {open_after_s(f, rules):g} s it must hold</li>"
        for f in d.findings
        if (fp := fingerprint(d.job, f)) in pending
    ]
    if not rows:
        return ""
    return f'<p class="note">Watching, not yet a ticket:</p><ul>{"".join(rows)}</ul>'


@router.get("/", response_class=HTMLResponse)
def jobs_page(svc: Svc) -> HTMLResponse:
    now = svc.now_us
    rows = []
    for js in sorted(svc.jobs.values(), key=lambda j: -j.last_us):
        state = js.state(now, svc.settings.ended_after_s)
        n = len((js.diagnosis or {}).get("findings", []))
        rows.append(
            f'<tr><td><a href="/jobs/{quote(js.job, safe="")}">{_e(js.job)}</a></td>'
            f'<td><span class="st {state}">{state}</span></td><td>{js.ranks}</td><td>{js.step}</td>'
            f"<td>{js.steps_per_s:.2f}</td><td>{n}</td><td>{_time(js.last_us)}</td></tr>"
        )
    table = (
        '<table class="list"><tr><th>job</th><th>state</th><th>ranks</th><th>step</th><th>steps/s</th>'
        f"<th>findings</th><th>last record</th></tr>{''.join(rows)}</table>"
        if rows
        else '<p class="note">No jobs yet: point the hooks\' spool (or Kafka) at this service.</p>'
    )
    active = [t for t in list(svc.tickets.values()) if t.active]
    body = f"<h1>rankscope</h1><h2>Jobs</h2>{table}<h2>Open tickets</h2>" + _ticket_rows(
        sorted(active, key=lambda t: -t.updated_us)
    )
    return _html("rankscope: jobs", body, _refresh(True))


@router.get("/jobs/{job:path}", response_class=HTMLResponse)
def job_page(job: str, svc: Svc) -> HTMLResponse:
    js = known_job(svc, job)
    d = svc.diagnosis_or_empty(job)
    state = js.state(svc.now_us, svc.settings.ended_after_s)
    tickets = sorted((t for t in list(svc.tickets.values()) if t.job == job), key=lambda t: -t.updated_us)
    extra = (
        f'<p class="meta">state <span class="st {state}">{state}</span> · step {js.step} · '
        f'{js.steps_per_s:.2f} steps/s · diagnosed {_time(js.diagnosed_us)} · <a href="/">all jobs</a></p>'
        f"<h2>Tickets</h2>{_ticket_rows(tickets)}" + _watched(d, js.pending, svc.now_us, svc.settings.tickets)
    )
    if (e := svc.efficiency(job)) is not None:
        extra += efficiency_section(e)
    if (r := svc.reliability(job)) is not None:
        extra += reliability_section(r)
    head = _refresh(state != "ended") + f"<style>{_CSS}</style>"
    drawn = svc.view(job, "pictures")
    return HTMLResponse(render_report(d, svc.job_data(job), extra=extra, head=head, drawn=drawn))


@router.get("/tickets/{ticket_id}", response_class=HTMLResponse)
def ticket_page(ticket_id: str, svc: Svc) -> HTMLResponse:
    t = known_ticket(svc, ticket_id)
    timeline = "".join(
        f'<tr><td>{_time(e.time_us)}</td><td><span class="st {e.state}">{e.state}</span></td><td>{_e(e.reason)}</td></tr>'
        for e in t.events
    )
    deliveries = "".join(
        f"<tr><td>{_time(d['time_us'])}</td><td>{_e(d['url'])}</td><td>{_e(d['status'])}</td>"
        f"<td>{d['attempt']}</td><td>{'delivered' if d['ok'] else _e(d['error'])}</td></tr>"
        for d in svc.deliveries(t.id)
    )
    evidence = "".join(
        f"<dt>{_e(k)}</dt><dd><code>{_e(v if isinstance(v, str) else json.dumps(v))[:400]}</code></dd>"
        for k, v in t.evidence.items()
    )
    body = (
        f"<h1>Ticket <code>{_e(t.id)}</code></h1>"
        f'<p class="meta"><span class="st {t.state}">{t.state}</span> · job '
        f'<a href="/jobs/{quote(t.job, safe="")}">{_e(t.job)}</a> · severity {t.severity} '
        f"({t.lost_rank_s:g} rank-seconds lost) · occurrence {t.occurrence}"
        + (f' after <a href="/tickets/{quote(t.previous)}">{_e(t.previous)}</a>' if t.previous else "")
        + "</p>"
        f'<div class="card"><span class="cause">{_e(t.cause)}</span> <b>{_e(t.culprit)}</b> '
        f"(hosts {_e(', '.join(t.hosts))}) · confidence {t.confidence:.2f}<br>{_e(t.summary)}<br>"
        f'function <code>{_e(t.function)}</code><dl class="ev">{evidence}</dl></div>'
        f'<h2>Timeline</h2><table class="list"><tr><th>time</th><th>state</th><th>reason</th></tr>{timeline}</table>'
        "<h2>Notifications</h2>"
        + (
            f'<table class="list"><tr><th>time</th><th>webhook</th><th>status</th><th>attempt</th>'
            f"<th>result</th></tr>{deliveries}</table>"
            if deliveries
            else '<p class="note">None sent.</p>'
        )
    )
    return _html(f"rankscope: ticket {t.id}", body, _refresh(t.active))
