"""Wire records: what a rank ships, versioned, as frozen dataclasses.

Wire format (the same on the spool and on Kafka): a key and a value.

* key   = ``"<job>/<rank>"`` in UTF-8 (Kafka partitions by it, so one rank's records stay in order);
* value = one JSON object in UTF-8 with ``"v"`` (schema version), ``"type"`` and the record's fields.
  Times are inside the value (``time_us``: microseconds since the Unix epoch), never in transport
  metadata, because the oldest brokers we support carry no record timestamps or headers.

Bulky parts are encoded as rows (lists) with a fixed column order, named by ``STEP_COLUMNS`` and
``FUNCTION_COLUMNS``, which keeps a 300-function window summary near 40 KB.

Record types:

``rank``       once at start: identity and topology labels of the rank.
``steps``      always on, every few seconds: one row per finished training step.
``heartbeat``  always on, from a watchdog thread: progress, the collective in flight, a stack if stalled.
``window``     one per profiling window: per-function execution patterns and busy fractions.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

SCHEMA_VERSION = 1
MAX_VALUE_BYTES = 1 << 20
"""A value larger than this is refused by decode() (and dead-lettered by the aggregator)."""


class RecordError(ValueError):
    """A value that is not a valid record; the message is the reason kept with the dead letter."""


class StepRow(NamedTuple):
    """One finished training step on one rank (all durations in microseconds)."""

    step: int
    start_us: int
    """Wall-clock start: the end of the previous step, so data fetching belongs to the step."""
    dur_us: int
    data_us: int
    """Time the step waited for its batch (the wrapped data loader's ``next``)."""
    comm_us: int
    """Wall time inside torch.distributed collectives (waiting for peers + transfer)."""
    n_coll: int
    first_coll_us: int
    """Time from step start to the first collective's entry (-1 if none): the rank's arrival time."""
    cpu_us: int
    """CPU time of the rank's main thread during the step."""
    nivcsw: int
    """Involuntary context switches of the rank's process (all threads) during the step: CPU contention."""


STEP_COLUMNS = StepRow._fields


class FunctionPattern(NamedTuple):
    """How one function executed during a profiling window on one rank."""

    kind: str
    """``op`` (CPU operator), ``kernel`` (GPU kernel), ``collective``, ``memcpy``, ``dataloader``,
    ``python`` (a function of the job's own code), ``pylib`` (a Python function of the interpreter,
    the standard library or an installed package), ``sched`` (the process's threads waiting for a CPU)."""
    name: str
    stack: str
    """For Python functions, the calling functions (outermost first, `` > ``-separated); else ''."""
    count: int  # type: ignore[assignment]  # shadows tuple.count; the wire name is worth it
    total_us: float
    mean_us: float
    p50_us: float
    p90_us: float
    max_us: float
    cv: float
    """Coefficient of variation of the durations (std / mean): the pattern's variability."""
    interval_us: float
    """Mean time between consecutive starts (0 with fewer than two executions)."""
    interval_cv: float
    nbytes: int
    """Bytes moved (collectives, copies), 0 where unknown."""


FUNCTION_COLUMNS = FunctionPattern._fields
KINDS = ("op", "kernel", "collective", "memcpy", "dataloader", "python", "pylib", "sched")


@dataclass(frozen=True, slots=True, kw_only=True)
class _Base:
    TYPE: ClassVar[str] = ""
    job: str
    rank: int
    host: str
    time_us: int
    """When the record was made, microseconds since the epoch."""

    @property
    def key(self) -> bytes:
        return f"{self.job}/{self.rank}".encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo(_Base):
    TYPE: ClassVar[str] = "rank"
    local_rank: int
    world_size: int
    pid: int
    nic: str = ""
    switch: str = ""
    backend: str = ""
    device: str = "cpu"


@dataclass(frozen=True, slots=True, kw_only=True)
class StepBatch(_Base):
    TYPE: ClassVar[str] = "steps"
    rows: tuple[StepRow, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(_Base):
    TYPE: ClassVar[str] = "heartbeat"
    step: int
    """Last finished step (-1 before the first)."""
    progress_age_s: float
    """Seconds since the rank last finished a step or a collective."""
    coll_group: str = ""
    coll_op: str = ""
    coll_seq: int = -1
    """The collective the rank is inside now (group, op, sequence number), -1 if none."""
    coll_age_s: float = 0.0
    last_seq: dict[str, int] = field(default_factory=dict)
    """Per process group, the sequence number of the last collective entered."""
    stack: str = ""
    """The main thread's Python stack, filled in when the rank is stalled."""
    dropped: int = 0
    """Records this rank dropped so far because its queue or transport was full."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowSummary(_Base):
    TYPE: ClassVar[str] = "window"
    window: int
    """The window's id: its first step (``step_lo``), the same on every rank."""
    step_lo: int
    step_hi: int
    """Steps ``step_lo <= s < step_hi`` were profiled."""
    dur_us: int
    busy: dict[str, float]
    """Fraction of the window the main thread spent in compute / comm / data; ``idle`` the rest."""
    n_events: int
    functions: tuple[FunctionPattern, ...]


Record = RankInfo | StepBatch | Heartbeat | WindowSummary
_TYPES: dict[str, type[_Base]] = {c.TYPE: c for c in (RankInfo, StepBatch, Heartbeat, WindowSummary)}


def encode(record: Record) -> tuple[bytes, bytes]:
    """The record's wire key and value."""
    d: dict[str, Any] = {"v": SCHEMA_VERSION, "type": record.TYPE}
    for f in fields(record):
        name, value = f.name, getattr(record, f.name)
        if name in ("rows", "functions"):
            value = [list(r) for r in value]
        d[name] = value
    return record.key, json.dumps(d, separators=(",", ":")).encode()


def _rows(raw: Any, row_type: Any, where: str) -> tuple:
    if not isinstance(raw, list):
        raise RecordError(f"{where} must be a list of rows")
    n = len(row_type._fields)
    out = []
    for i, r in enumerate(raw):
        if not isinstance(r, list) or len(r) != n:
            raise RecordError(f"{where}[{i}] must be a list of {n} values {row_type._fields}")
        out.append(row_type(*r))
    return tuple(out)


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "str": str,
    "int": int,
    "float": (int, float),
    "dict[str, float]": dict,
    "dict[str, int]": dict,
}


def decode(value: bytes) -> Record:
    """Parse and validate one wire value; raises RecordError with the reason."""
    if len(value) > MAX_VALUE_BYTES:
        raise RecordError(f"value of {len(value)} bytes exceeds the {MAX_VALUE_BYTES}-byte limit")
    try:
        d = json.loads(value)
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError, UnicodeDecodeError and ints over Python's digit limit;
        # RecursionError a deeply nested array. Either must be a RecordError, or one bad line
        # would stop every consumer that dead-letters RecordError and retries the rest.
        raise RecordError(f"not JSON: {exc}") from exc
    if not isinstance(d, dict):
        raise RecordError("value is not a JSON object")
    if d.get("v") != SCHEMA_VERSION:
        raise RecordError(f"unknown schema version {d.get('v')!r} (this reader knows {SCHEMA_VERSION})")
    rtype = d.get("type")
    cls = _TYPES.get(rtype) if isinstance(rtype, str) else None  # an unhashable type would raise TypeError
    if cls is None:
        raise RecordError(f"unknown record type {d.get('type')!r}")
    kwargs: dict[str, Any] = {}
    for f in fields(cls):
        name = f.name
        if name not in d:
            if f.default is not MISSING or f.default_factory is not MISSING:
                continue
            raise RecordError(f"{cls.TYPE} record lacks field {name!r}")
        field_value: Any = d[name]
        if name == "rows":
            field_value = _rows(field_value, StepRow, "rows")
        elif name == "functions":
            field_value = _rows(field_value, FunctionPattern, "functions")
        else:
            want = _FIELD_TYPES.get(str(f.type))
            if want is not None and (not isinstance(field_value, want) or isinstance(field_value, bool)):
                raise RecordError(f"field {name!r} must be {f.type}, got {field_value!r:.80}")
        kwargs[name] = field_value
    return cls(**kwargs)  # type: ignore[return-value]
