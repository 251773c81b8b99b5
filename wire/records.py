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
``steps``      always on, every few seconds: one row per block of finished training steps (one row
               per step when steps take longer than ``Config.step_block_s``).
``heartbeat``  always on, from a watchdog thread: progress, the collective in flight, a stack if stalled.
``window``     one per profiling window: per-function execution patterns and busy fractions.
``checkpoint`` one per checkpoint saved or loaded inside ``Hook.checkpoint()``: when, how long it blocked.
``exit``       once, when the rank's process ends: how (closed, an exception and where, a signal).

Readers ignore fields they do not know, so ``RankInfo.attempt``, ``.spine``, ``.coverage``, the heartbeats' GPU
samples and the ``checkpoint`` type came within version 2, and the heartbeats' stack samples and link
sends and every record's ``pid`` and ``seq`` within version 3: an older aggregator stores the rest
and dead-letters a checkpoint with its reason.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

from .errors import RecordError

WIRE_VERSION = 4
"""Version 2 added ``StepRow.n_steps``, version 3 ``StepRow.wait_us``, version 4 ``StepRow.gc_us``;
older values are still read (their step rows as ``n_steps=1``, ``wait_us=0`` and ``gc_us=0``: none
known)."""
READ_VERSIONS = (1, 2, 3, WIRE_VERSION)
MAX_VALUE_BYTES = 1 << 20
"""A value larger than this is refused by decode() (and dead-lettered by the aggregator)."""


class StepRow(NamedTuple):
    """``n_steps`` consecutive finished training steps on one rank, from ``step`` on (all durations in
    microseconds, totals over those steps)."""

    step: int
    start_us: int
    """Wall-clock start of the first step: the end of the step before, so data fetching belongs to it."""
    dur_us: int
    data_us: int
    """Time the steps waited for their batches (the wrapped data loader's ``next``)."""
    comm_us: int
    """Wall time inside torch.distributed collectives (waiting for peers + transfer)."""
    n_coll: int
    first_coll_us: int
    """Mean time from a step's start to its first collective's entry, over the steps that entered one
    (-1 if none did): the rank's arrival time."""
    cpu_us: int
    """CPU time of the rank's main thread during the steps."""
    nivcsw: int
    """Involuntary context switches of the rank's process (all threads) during the steps: CPU contention."""
    n_steps: int
    wait_us: int = 0
    """Time the rank's main thread was runnable but had no CPU during the steps, outside collectives
    (Linux schedstat's run-queue wait; 0 where unknown): part of the step time less ``comm_us``
    that is not the rank's work but its host's contention."""
    gc_us: int = 0
    """Time Python's garbage collector stopped the process during the steps (it holds the GIL: no
    Python runs on any thread meanwhile); 0 where unknown. Part of the rank's own time."""


STEP_COLUMNS = StepRow._fields


class FunctionPattern(NamedTuple):
    """How one function executed during a profiling window on one rank."""

    kind: str
    """``op`` (CPU operator), ``kernel`` (GPU kernel), ``collective``, ``memcpy``, ``dataloader``,
    ``python`` (a function of the job's own code), ``pylib`` (a Python function of the interpreter,
    the standard library or an installed package), ``annotation`` (a range the code marked with
    ``record_function``: a pipeline schedule's ``Forward``, FSDP's ``FSDP::post_backward_reduce``, a
    user's; hooks before 2026-11-30 recorded these as ``op``), ``sched`` (the process's threads
    waiting for a CPU),
    ``cut`` (the patterns a window left out beyond its ``max_functions``: their number as ``count``,
    their summed time as ``total_us``, the largest one's as ``max_us``)."""
    name: str
    stack: str
    """For Python functions, the calling functions (outermost first, `` > ``-separated); for a
    device's kernels and copies (NCCL's kernels: ``collective``), the CPU operator that launched
    them, after the innermost function of the job's own code around it where the window recorded
    Python functions (``train.py(40): forward > aten::mm``; '' where no operator is known); else ''."""
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
KINDS = (
    "op",
    "kernel",
    "collective",
    "memcpy",
    "dataloader",
    "python",
    "pylib",
    "annotation",
    "sched",
    "cut",
)
WAIT_KIND = "sched"
WAIT_PATTERN = "cpu_wait@sched"
"""The window pattern of the time the rank's threads were runnable but waited for a CPU
(``profiler_hook.schedstat``; read by ``diagnosis.detectors.straggler.contention``)."""
TRANSFER_PREFIX = "net_send@"
"""The collective patterns that time a network transfer alone (``net_send@<group>``: what an NCCL
net plugin reports per proxy step; ``benchmarks.scale.cluster`` records them so)."""
CUT_KIND = "cut"
"""The kind of a window's pattern that stands for the functions it left out (see ``kind``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class _Base:
    TYPE: ClassVar[str] = ""
    job: str
    rank: int
    host: str
    time_us: int
    """When the record was made, microseconds since the epoch."""
    pid: int = 0
    """The process that made it (0: a hook that did not say)."""
    seq: int = -1
    """Its number among the records its process made for its job and rank, from 0 in the order they
    left: a number the store never received is a record lost on the way — dropped by the hook's
    full queue, by the transport, or dead-lettered (-1: a hook that did not number them)."""

    @property
    def key(self) -> bytes:
        return f"{self.job}/{self.rank}".encode()


@dataclass(frozen=True, slots=True, kw_only=True)
class RankInfo(_Base):
    TYPE: ClassVar[str] = "rank"
    local_rank: int
    world_size: int
    nic: str = ""
    switch: str = ""
    """The leaf switch."""
    spine: str = ""
    backend: str = ""
    device: str = "cpu"
    attempt: int = 0
    """torchrun's restart count (``$TORCHELASTIC_RESTART_COUNT``): 0 for the job's first attempt."""
    coverage: str = ""
    """What the always-on tracking times, counts or does not see, in parts joined by ``"; "``: the
    collective calls, each DDP model, the process groups, the backends. A rank sends its record
    again, with its first stamp, when this changes (a model or a group made later); the parts
    :func:`coverage_gaps` picks say what is not seen."""
    mesh: dict[str, int] = field(default_factory=dict)
    """The rank's coordinate on each named dimension of the job's ``DeviceMesh`` (``{"dp": 1,
    "pp": 0}``; empty: no mesh), sent again like ``coverage`` where a mesh is made later."""


PIPELINE_DIMS = ("pp", "pipeline")
"""Device-mesh dimensions whose ranks do different work by design: pipeline stages (torchtitan and
the PyTorch docs name the dimension ``pp``). Tensor, context and expert parallel ranks share their
work evenly."""


def pipeline_role(mesh: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """A rank's role in the job: its coordinates on the ``PIPELINE_DIMS`` of its mesh (``()``:
    none). Ranks of one role do the same work: only they are compared with each other."""
    return tuple(sorted((d, int(c)) for d, c in mesh.items() if d in PIPELINE_DIMS))


GAP_WORDS = ("not tracked", "untested", "off (")
"""Words of a part of ``RankInfo.coverage`` that says something is not seen as documented."""


_AT_LINE = " @"


def sample_key(function: str, line: int) -> str:
    """A stack sample's key: the function as the profiler names Python functions
    (``"train.py(40): load"``, the line its definition starts on) and the line it was at
    (``"train.py(40): load @57"``). Keys of older hooks carry no line."""
    return f"{function}{_AT_LINE}{line}"


def split_sample_key(key: str) -> tuple[str, int | None]:
    """(function, line) of a :func:`sample_key` (line ``None`` where the key has none)."""
    function, at, line = key.rpartition(_AT_LINE)
    return (function, int(line)) if at and line.isdigit() else (key, None)


def coverage_gaps(coverage: str) -> list[str]:
    """The parts of a rank record's ``coverage`` that name a gap."""
    return [p for p in coverage.split("; ") if any(w in p for w in GAP_WORDS)]


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
    """The collective the rank is inside now (group, op, sequence number), -1 if none..."""
    coll_peer: int = -1
    """...and where it is a ``send`` or ``recv``, its peer (global rank; -1: none, or any)."""
    coll_age_s: float = 0.0
    last_seq: dict[str, int] = field(default_factory=dict)
    """Per process group, the sequence number of the last collective entered."""
    stack: str = ""
    """The main thread's Python stack, filled in when the rank is stalled."""
    samples: dict[str, int] = field(default_factory=dict)
    """Since the previous heartbeat, every 0.5 s: the innermost function of the job's own code the
    training thread was in and the line it was at (:func:`sample_key`; ``""``: none) → samples."""
    sends: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Since the previous heartbeat, per network link ``"<local IP>><peer IP>"`` of the rank's bulk
    TCP connections: (bytes the peer acknowledged, µs the kernel spent sending them: ``TCP_INFO``
    busy time less the time the receiver's window held it back)."""
    dropped: int = 0
    """Records this rank dropped so far because its queue or transport was full."""
    windows: int = 0
    """Profiling windows this rank has taken so far, their cost measured..."""
    window_cost_us: int = 0
    """...and what they cost it in all: the extra time of the steps they covered and disturbed,
    and the CPU time their summarizing took (``profiler_hook.budget``)."""
    gpu_util: float = -1.0
    """NVML: percent of the last sample period a kernel ran on the rank's GPU (-1: not read)."""
    gpu_mem_mb: float = -1.0
    """NVML: the GPU's memory in use, MiB (-1: not read)."""
    gpu_xids: dict[str, int] = field(default_factory=dict)
    """NVML: the GPU's XID events since attach, ``xid_<code>`` → events (as ``Exit.gpu``): what a
    rank killed without a word (an NCCL watchdog's abort after its GPU fell off the bus) leaves."""


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Checkpoint(_Base):
    TYPE: ClassVar[str] = "checkpoint"
    kind: str
    """``save`` or ``load``."""
    step: int
    """The training step it holds: saved after step ``step - 1``, or training resumes at ``step``."""
    start_us: int
    dur_us: int
    """How long the call blocked the training loop."""
    attempt: int = 0


CHECKPOINT_KINDS = ("save", "load")


@dataclass(frozen=True, slots=True, kw_only=True)
class Exit(_Base):
    TYPE: ClassVar[str] = "exit"
    how: str
    """How the rank's process ended: ``close`` (the script closed the hook, or it ended normally),
    ``exception`` (an exception escaped a step, or the script), ``signal`` (a SIGTERM: torchrun
    stopping a failed attempt's other workers). One that ends without a word (SIGKILL, the OOM
    killer, a node lost) sends none: its heartbeats stop."""
    step: int = -1
    """The step it was in, or had last finished."""
    attempt: int = 0
    """torchrun's restart count, as ``RankInfo.attempt``."""
    error: str = ""
    """The exception's class, qualified where not a built-in (``torch.OutOfMemoryError``)..."""
    message: str = ""
    """...its message (its first ``MAX_MESSAGE`` characters)..."""
    frame: str = ""
    """...and the innermost frame of the job's own code it came through (:func:`sample_key`)."""
    signal: int = 0
    """The signal that ended it (``signal``)."""
    gpu: dict[str, int] = field(default_factory=dict)
    """Its GPU's faults since attach, where NVML could say (``profiler_hook.gpu``): ``xid_<code>``
    (events of each XID), ``ecc_uncorrected``, ``retired_pages``, ``remapped_rows`` (how far each moved)."""


MAX_MESSAGE = 2000
"""An exit's message is cut to this many characters."""

Record = RankInfo | StepBatch | Heartbeat | WindowSummary | Checkpoint | Exit
_TYPES: dict[str, type[_Base]] = {
    c.TYPE: c for c in (RankInfo, StepBatch, Heartbeat, WindowSummary, Checkpoint, Exit)
}


def encode(record: Record) -> tuple[bytes, bytes]:
    """The record's wire key and value; raises ValueError for a non-finite float (JSON has none,
    and the aggregator would refuse it), so the shipper drops and counts such a record."""
    d: dict[str, Any] = {"v": WIRE_VERSION, "type": record.TYPE}
    for f in fields(record):
        name, value = f.name, getattr(record, f.name)
        if name in ("rows", "functions"):
            value = [list(r) for r in value]
        elif value == f.default or (f.default_factory is not MISSING and value == f.default_factory()):
            continue  # decode() fills it in: a heartbeat ships a third of its bytes fewer
        d[name] = value
    try:
        return record.key, json.dumps(d, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as exc:
        raise ValueError(f"{record.TYPE} record of {record.key!r} holds a NaN or infinity: {exc}") from None


# --- the rules a wire value must meet --------------------------------------------------------------
#
# decode() applies them all, so that the spool reader and the Kafka consumer (which share it through
# aggregator.batch.Batch) store a value exactly as it was sent or dead-letter it with the reason,
# never change it: the value is strict JSON in UTF-8 without a byte order mark (RFC 8259: no NaN or
# Infinity, no 07 or +7, no trailing comma), no object repeats a key; an integer field holds a JSON
# integer (not "7", 7.0 or true) within Int64, or the narrower range of INT_RANGES; a float field
# holds a JSON number (integer or not), read as the nearest double as every JSON reader does, and
# finite (1e400 is refused); a string field holds a string of valid Unicode (no lone surrogate).
# Fields a record type does not know are ignored. aggregator.schema holds ClickHouse to the same rules for the window summaries
# it parses itself.

INT64 = (-(1 << 63), 1 << 63)
"""Every integer field lies in ``[lo, hi)`` of this or of ``INT_RANGES``."""
INT_RANGES: dict[str, tuple[int, int]] = {
    "rank": (0, 1 << 31),
    "local_rank": (0, 1 << 31),
    "world_size": (1, 1 << 31),
    # A step's durations and counts, and a window's length, cannot be negative.
    **dict.fromkeys(
        ("dur_us", "data_us", "comm_us", "n_coll", "cpu_us", "nivcsw", "wait_us", "gc_us"), (0, INT64[1])
    ),
    "n_steps": (1, 1 << 31),
    "attempt": (0, 1 << 31),
    "pid": (0, 1 << 31),
    "seq": (-1, INT64[1]),
    "coll_peer": (-1, 1 << 31),
    "signal": (0, 256),
    "first_coll_us": (-1, INT64[1]),  # -1: the step entered no collective
}
"""Integer fields with a narrower range than INT64 (Int32 columns; durations and counts)."""


def _int(v: Any, lo: int = INT64[0], hi: int = INT64[1]) -> int:
    if type(v) is not int:  # bool is an int subclass, and JSON true is not a count
        raise ValueError("int")
    if not lo <= v < hi:
        raise ValueError(f"int in [{lo}, {hi})")
    return v


def _float(v: Any) -> float:
    if type(v) is int:
        try:
            v = float(v)
        except OverflowError:
            raise ValueError("a finite float") from None
    elif type(v) is not float:
        raise ValueError("float")
    if not math.isfinite(v):
        raise ValueError("a finite float")
    return v  # type: ignore[no-any-return]


def checked_str(v: Any) -> str:
    """``v`` if it is a string of valid Unicode; else ValueError saying what it must be."""
    if type(v) is not str:
        raise ValueError("str")
    if not v.isascii():
        try:
            v.encode()
        except UnicodeEncodeError:  # a lone surrogate from a JSON "\ud800" escape
            raise ValueError("valid Unicode") from None
    return v


def _pair(v: Any) -> tuple[int, int]:
    if type(v) not in (list, tuple) or len(v) != 2:  # a list from JSON, a tuple from the hook
        raise ValueError("a pair")
    return _int(v[0], 0), _int(v[1], 0)


def _map(check: Callable[[Any], Any], what: str) -> Callable[[Any], Any]:
    def checked(v: Any) -> Any:
        if type(v) is not dict:
            raise ValueError(what)
        try:
            return {checked_str(k): check(x) for k, x in v.items()}
        except ValueError:
            raise ValueError(what) from None

    return checked


_CHECKS: dict[str, Callable[[Any], Any]] = {
    "int": _int,
    "float": _float,
    "str": checked_str,
    "dict[str, float]": _map(_float, "dict[str, float] of finite floats"),
    "dict[str, int]": _map(_int, "dict[str, int] of Int64 integers"),
    "dict[str, tuple[int, int]]": _map(_pair, "dict[str, tuple[int, int]] of pairs of Int64 integers >= 0"),
}


def _check(name: str, type_: str) -> Callable[[Any], Any]:
    if name in INT_RANGES:
        lo, hi = INT_RANGES[name]
        return lambda v: _int(v, lo, hi)
    return _CHECKS[type_]


_ROW_CHECKS = {
    # NamedTuple annotations are ForwardRef('int') under ``from __future__ import annotations``.
    row_type: tuple(
        _check(name, getattr(t, "__forward_arg__", str(t))) for name, t in row_type.__annotations__.items()
    )
    for row_type in (StepRow, FunctionPattern)
}


_ROW_TYPES = {
    row_type: tuple(
        {"int": int, "float": float, "str": str}[getattr(t, "__forward_arg__", str(t))]
        for t in row_type.__annotations__.values()
    )
    for row_type in (StepRow, FunctionPattern)
}
"""Each row type's value types (NamedTuple annotations are ForwardRef('int') here)."""
_ROW_RANGES = {
    row_type: tuple(INT_RANGES.get(name, INT64) for name in row_type._fields)
    for row_type in (StepRow, FunctionPattern)
}
"""Each row type's integer ranges (INT64 unless INT_RANGES says otherwise), column by column."""


def _plainly_valid(rows: Sequence[Any], types: tuple[type, ...], ranges: tuple[tuple[int, int], ...]) -> bool:
    """A fast check of the common rows: lists of values of their exact types (floats as floats),
    integers within their ranges, finite floats, ASCII strings. Row by row where there are few
    (a step record holds one), else column by column."""
    if len(rows) <= 4:
        return all(_plain_row(r, types, ranges) for r in rows)
    if not set(map(type, rows)) <= {list, tuple} or set(map(len, rows)) != {len(types)}:
        return False
    for t, (lo, hi), column in zip(types, ranges, zip(*rows, strict=True), strict=True):
        if set(map(type, column)) != {t}:
            return False
        if t is int and not (lo <= min(column) and max(column) < hi):
            return False
        if t is float and not all(map(math.isfinite, column)):
            return False
        if t is str and not all(map(str.isascii, column)):
            return False
    return True


def _plain_row(row: Any, types: tuple[type, ...], ranges: tuple[tuple[int, int], ...]) -> bool:
    if (type(row) is not list and type(row) is not tuple) or tuple(map(type, row)) != types:
        return False
    for t, (lo, hi), v in zip(types, ranges, row, strict=True):
        if t is int:
            if not lo <= v < hi:
                return False
        elif t is float:
            if not math.isfinite(v):
                return False
        elif not v.isascii():
            return False
    return True


def _rows(raw: Any, row_type: Any, where: str) -> tuple:
    if type(raw) is not list and type(raw) is not tuple:
        raise RecordError(f"{where} must be a list of rows")
    if not raw or _plainly_valid(raw, _ROW_TYPES[row_type], _ROW_RANGES[row_type]):
        return tuple(map(tuple.__new__, itertools.repeat(row_type), raw))
    names = row_type._fields
    checks = _ROW_CHECKS[row_type]
    n = len(names)
    out = []
    for i, r in enumerate(raw):
        if (type(r) is not list and not isinstance(r, tuple)) or len(r) != n:
            raise RecordError(f"{where}[{i}] must be a list of {n} values {names}")
        try:
            out.append(row_type._make([check(x) for check, x in zip(checks, r, strict=True)]))
        except ValueError:
            for name, check, x in zip(names, checks, r, strict=True):
                try:
                    check(x)
                except ValueError as exc:
                    raise RecordError(f"{where}[{i}].{name} must be {exc}, got {x!r:.80}") from None
            raise
    return tuple(out)


def _field_checks(cls: type[_Base]) -> tuple[tuple[str, bool, Callable[[Any], Any] | None], ...]:
    """Each field of ``cls``: its name, whether a record may leave it out (it has a default), and
    its check (None: a list of rows)."""
    return tuple(
        (
            f.name,
            f.default is not MISSING or f.default_factory is not MISSING,
            None if f.name in ("rows", "functions") else _check(f.name, str(f.type)),
        )
        for f in fields(cls)
    )


_FIELD_CHECKS = {cls: _field_checks(cls) for cls in _TYPES.values()}


def _fields_of(cls: type[_Base], get: Callable[[str], Any], has: Callable[[str], bool]) -> dict[str, Any]:
    """The checked constructor arguments of ``cls`` from ``get``; raises RecordError."""
    kwargs: dict[str, Any] = {}
    for name, optional, check_value in _FIELD_CHECKS[cls]:
        if not has(name):
            if optional:
                continue
            raise RecordError(f"{cls.TYPE} record lacks field {name!r}")
        value = get(name)
        if check_value is not None:
            try:
                value = check_value(value)
            except ValueError as exc:
                raise RecordError(f"field {name!r} must be {exc}, got {value!r:.80}") from None
        elif name == "rows":
            value = _rows(value, StepRow, "rows")
        else:
            value = _rows(value, FunctionPattern, "functions")
        kwargs[name] = value
    if cls is Checkpoint and kwargs["kind"] not in CHECKPOINT_KINDS:
        raise RecordError(f"checkpoint kind must be one of {CHECKPOINT_KINDS}, got {kwargs['kind']!r:.80}")
    return kwargs


def check(record: Record) -> Record:
    """``record`` if its values meet the rules decode() applies; raises RecordError otherwise."""
    _fields_of(type(record), lambda name: getattr(record, name), lambda name: True)
    return record


def _refuse_constant(name: str) -> Any:
    raise RecordError(f"{name} is not a JSON number: non-finite numbers are refused")


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise RecordError(f"an object repeats the key {dup!r:.80}")
    return d


_JSON = json.JSONDecoder(parse_constant=_refuse_constant, object_pairs_hook=_object)
"""One decoder for every value (``json.loads`` with options builds one a call)."""


def decode(value: bytes) -> Record:
    """Parse and validate one wire value; raises RecordError with the reason (see the rules above)."""
    if len(value) > MAX_VALUE_BYTES:
        raise RecordError(f"value of {len(value)} bytes exceeds the {MAX_VALUE_BYTES}-byte limit")
    try:
        d = _JSON.decode(value.decode())
    except RecordError:
        raise
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError, UnicodeDecodeError and ints over Python's digit limit;
        # RecursionError a deeply nested array. Either must be a RecordError, or one bad line
        # would stop every consumer that dead-letters RecordError and retries the rest.
        raise RecordError(f"not JSON: {exc}") from exc
    if not isinstance(d, dict):
        raise RecordError("value is not a JSON object")
    version = d.get("v")
    if type(version) is not int or version not in READ_VERSIONS:
        raise RecordError(f"unknown schema version {version!r:.80} (this reader knows {READ_VERSIONS})")
    rtype = d.get("type")
    if version < WIRE_VERSION and rtype == "steps" and type(d.get("rows")) is list:
        # v1 rows lack n_steps (one step each), v1 and v2 rows wait_us, v1 to v3 rows gc_us (unknown: 0)
        tail = [1, 0, 0] if version == 1 else [0, 0] if version == 2 else [0]
        d["rows"] = [
            [*r, *tail] if type(r) is list and len(r) + len(tail) == len(STEP_COLUMNS) else r
            for r in d["rows"]
        ]
    cls = _TYPES.get(rtype) if isinstance(rtype, str) else None  # an unhashable type would raise TypeError
    if cls is None:
        raise RecordError(f"unknown record type {rtype!r:.80}")
    return cls(**_fields_of(cls, d.__getitem__, d.__contains__))  # type: ignore[return-value]
