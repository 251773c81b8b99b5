"""rankscope's in-rank hook: light always-on step/collective tracking plus short profiling windows.

Importing this package loads only the standard library; torch is imported when a hook is attached.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from rankscope.wire.records import (
    FUNCTION_COLUMNS,
    STEP_COLUMNS,
    WIRE_VERSION,
    FunctionPattern,
    Heartbeat,
    RankInfo,
    RecordError,
    StepBatch,
    StepRow,
    WindowSummary,
    decode,
    encode,
)

from .config import Config, Identity
from .hook import Hook


def attach(
    config: Config | None = None, *, rank: int | None = None, world_size: int | None = None, **settings: Any
) -> Hook:
    """Start the hook for this rank; ``settings`` are :class:`Config` fields.

    Example::

        hook = profiler_hook.attach(job="llama-7b-run3", spool_dir="/var/spool/rankscope")

    Settings the caller got wrong (``Config(queue_size=0)``) raise. Anything the environment or the
    filesystem does wrong (``RANK=abc``, a spool directory that cannot be created, a job id no file
    can be named after) is logged once and gives a disabled hook (``failures == 1``): the job
    trains on without rankscope.
    """
    cfg = config if config is not None else Config(**settings)
    try:
        return Hook(cfg, Identity.from_env(rank, world_size))
    except Exception as exc:
        logging.getLogger(__name__).warning(
            "rankscope: the hook could not start (%s: %s); training continues without it",
            type(exc).__name__,
            exc,
        )
        off = Hook(replace(cfg, enable=False), Identity(rank=rank or 0, local_rank=0, world_size=1, host=""))
        off.failures = 1
        return off


__all__ = [
    "FUNCTION_COLUMNS",
    "STEP_COLUMNS",
    "WIRE_VERSION",
    "Config",
    "FunctionPattern",
    "Heartbeat",
    "Hook",
    "Identity",
    "RankInfo",
    "RecordError",
    "StepBatch",
    "StepRow",
    "WindowSummary",
    "attach",
    "decode",
    "encode",
]
