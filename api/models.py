"""The API's response and request bodies (pydantic), as operators script against them."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class JobOut(BaseModel):
    job: str
    state: Literal["running", "slow", "hung", "ended"]
    ranks: int
    world_size: int
    first_us: int
    last_us: int
    step: int = Field(description="latest step seen")
    steps_per_s: float = Field(description="over the last minute of steps")
    findings: int
    open_tickets: list[str]
    watching: list[str] = Field(
        default=[],
        description="fingerprints of findings not yet ticketed (they open once held rules.open_after_s)",
    )


class EventOut(BaseModel):
    time_us: int
    state: str
    reason: str


class TicketOut(BaseModel):
    id: str
    fingerprint: str
    occurrence: int
    job: str
    cause: str
    scope: str
    culprit: str
    ranks: list[int]
    hosts: list[str]
    function: str
    summary: str
    confidence: float
    evidence: dict[str, Any]
    state: Literal["open", "acknowledged", "resolved"]
    silenced: bool
    severity: Literal["minor", "major", "critical"]
    lost_rank_s: float
    opened_us: int
    updated_us: int
    last_seen_us: int
    resolved_us: int
    previous: str
    events: list[EventOut]


class TicketDetail(TicketOut):
    deliveries: list[dict[str, Any]]


class Action(BaseModel):
    reason: str = Field("", max_length=2000)
