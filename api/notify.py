"""Webhook notifications of ticket changes: Alertmanager's JSON, or Slack's text, retried with backoff.

Deliveries run on one background thread: :meth:`Notifier.send` only queues, so a dead or slow
receiver never holds up the diagnosis. Every attempt (delivered or not, with the error) is passed
to ``record``, which the service stores.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

log = logging.getLogger(__name__)

Format = Literal["alertmanager", "slack"]
_ZERO_TIME = "0001-01-01T00:00:00Z"  # Alertmanager's "not ended"


@dataclass(frozen=True, slots=True)
class Webhook:
    url: str
    format: Format = "alertmanager"


def _iso(us: int) -> str:
    return (
        datetime.fromtimestamp(us / 1e6, timezone.utc)
        .isoformat(timespec="milliseconds")
        .replace("+00:00", "Z")
    )


ALERTNAMES = {"hang": "RankscopeHang", "failure": "RankscopeFailure"}
"""The alert's name by the ticket's cause: a hung job, a job whose rank failed; any other cause is
a slowdown (``RankscopeSlowdown``)."""


def alertmanager_payload(ticket: dict[str, Any], link: str) -> dict[str, Any]:
    """Alertmanager's webhook payload (version 4) with the ticket as its one alert."""
    status = "resolved" if ticket["state"] == "resolved" else "firing"
    labels = {
        "alertname": ALERTNAMES.get(ticket["cause"], "RankscopeSlowdown"),
        "job": ticket["job"],
        "cause": ticket["cause"],
        "scope": ticket["scope"],
        "culprit": ticket["culprit"],
        "severity": ticket["severity"],
        "ticket": ticket["id"],
    }
    annotations = {
        "summary": f"{ticket['cause']} on {ticket['culprit']} in job {ticket['job']}",
        "description": ticket["summary"],
        "lost_rank_seconds": str(ticket["lost_rank_s"]),
    }
    alert = {
        "status": status,
        "labels": labels,
        "annotations": annotations,
        "startsAt": _iso(ticket["opened_us"]),
        "endsAt": _iso(ticket["resolved_us"]) if status == "resolved" else _ZERO_TIME,
        "generatorURL": link,
        "fingerprint": ticket["fingerprint"],
    }
    return {
        "version": "4",
        "groupKey": f"{{}}:{{ticket={ticket['id']!r}}}",
        "truncatedAlerts": 0,
        "status": status,
        "receiver": "rankscope",
        "groupLabels": {"ticket": ticket["id"]},
        "commonLabels": labels,
        "commonAnnotations": annotations,
        "externalURL": link.split("/tickets/")[0],
        "alerts": [alert],
    }


def slack_payload(ticket: dict[str, Any], link: str) -> dict[str, Any]:
    resolved = ticket["state"] == "resolved"
    head = "RESOLVED" if resolved else f"FIRING ({ticket['severity']})"
    return {
        "text": f"[{head}] job {ticket['job']}: {ticket['cause']} on {ticket['culprit']} — "
        f"{ticket['summary']} <{link}|ticket {ticket['id']}>"
    }


class Notifier:
    """Queues ticket notifications and delivers them to every webhook, retrying with backoff."""

    def __init__(
        self,
        webhooks: Sequence[Webhook],
        record: Callable[[str, int, str, str, int, str], None],
        *,
        attempts: int = 6,
        backoff_s: float = 1.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.webhooks = webhooks
        self._record = record
        self.attempts, self.backoff_s, self.timeout_s = attempts, backoff_s, timeout_s
        self._due: list[tuple[float, int, Webhook, dict[str, Any], str, int]] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._stop = False
        self.delivered = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="rankscope-webhooks", daemon=True)
        if webhooks:
            self._thread.start()

    def send(self, ticket: dict[str, Any], link: str) -> None:
        """Queue ``ticket`` (as it is now) for every webhook; returns at once."""
        with self._cv:
            for hook in self.webhooks:
                body = (slack_payload if hook.format == "slack" else alertmanager_payload)(ticket, link)
                heapq.heappush(self._due, (time.monotonic(), next(self._order), hook, body, ticket["id"], 1))
            self._cv.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop after delivering what is due now (up to ``timeout_s``); later retries are dropped."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stop and (not self._due or self._due[0][0] > time.monotonic()):
                    self._cv.wait(self._due[0][0] - time.monotonic() if self._due else None)
                if self._stop and (not self._due or self._due[0][0] > time.monotonic()):
                    return
                _, _, hook, body, ticket, attempt = heapq.heappop(self._due)
            error = self._post(hook.url, body)
            status = body.get("status", "firing" if "FIRING" in body.get("text", "") else "resolved")
            try:
                self._record(ticket, time.time_ns() // 1000, hook.url, status, attempt, error)
            except Exception as exc:  # the record is lost, not the delivery loop
                log.warning("rankscope serve: cannot record a webhook delivery: %s", exc)
            if not error:
                self.delivered += 1
                continue
            self.failed += 1
            if attempt < self.attempts:
                delay = self.backoff_s * 2 ** (attempt - 1)
                with self._cv:
                    heapq.heappush(
                        self._due,
                        (time.monotonic() + delay, next(self._order), hook, body, ticket, attempt + 1),
                    )
            else:
                log.warning("rankscope serve: webhook %s gave up on ticket %s after %d attempts: %s",
                            hook.url, ticket, attempt, error)  # fmt: skip

    def _post(self, url: str, body: dict[str, Any]) -> str:
        """POST ``body`` as JSON; '' when the receiver answered 2xx, else what went wrong."""
        req = urllib.request.Request(
            url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return "" if 200 <= resp.status < 300 else f"HTTP {resp.status}"
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"[:500]
