"""rankscope's in-rank hook: light always-on step/collective tracking plus short profiling windows.

Importing this package loads only the standard library; torch is imported when a hook is attached.
"""

from __future__ import annotations

from typing import Any

from .config import Config, Identity
from .hook import Hook
from .records import (
    FUNCTION_COLUMNS,
    SCHEMA_VERSION,
    STEP_COLUMNS,
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


def attach(
    config: Config | None = None, *, rank: int | None = None, world_size: int | None = None, **settings: Any
) -> Hook:
    """Start the hook for this rank; ``settings`` are :class:`Config` fields.

    Example::

        hook = profiler_hook.attach(job="llama-7b-run3", spool_dir="/var/spool/rankscope")
    """
    cfg = config if config is not None else Config(**settings)
    return Hook(cfg, Identity.from_env(rank, world_size))


__all__ = [
    "FUNCTION_COLUMNS",
    "SCHEMA_VERSION",
    "STEP_COLUMNS",
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
