"""Hook settings and the rank's identity, read from arguments and the environment."""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

from rankscope.wire.errors import UsageError
from rankscope.wire.settings import check_numbers

from .labels import topology

log = logging.getLogger(__name__)
_warned_shared_job = False


DEFAULT_WINDOW_BUDGET = 0.005


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """Settings of the in-rank hook. Every field has a default that is safe for production."""

    enable: bool = True
    """False turns every hook call into a no-op; so does ``$RANKSCOPE_ENABLE=0`` (an operator turns
    the hook off for a run without editing the script)."""
    job: str = ""
    """Job id shared by all ranks; default: $RANKSCOPE_JOB, $TORCHELASTIC_RUN_ID or 'default'. A
    ``TORCHELASTIC_RUN_ID`` of ``none`` (multi-node torchrun without ``--rdzv-id``) is used but
    warned about once per process: unrelated runs would share that job id."""
    spool_dir: str = ""
    """Where the spool sink appends records; default: $RANKSCOPE_SPOOL or ./rankscope-spool."""
    sink: str = "spool"
    """``spool`` (local files, the default), ``kafka``, or ``none``."""
    queue_size: int = 10_000
    """Records held for the background shipper; beyond this they are dropped and counted."""
    flush_s: float = 2.0
    """Seconds between shipments of the always-on step rows (at the first block that ends after)."""
    step_block_s: float = 2.0
    """Each always-on step row sums a block of consecutive steps that lasts about this long (a
    power-of-two number of steps, aligned on step numbers, so every rank's rows cover the same
    steps); 0: one row per step. One row per 10 ms step is ~400 KB a minute per rank; rows of 2 s
    keep a rank's always-on volume under 10 KB a minute at any step time, and the store reads each
    back as its steps. The diagnosis needs no finer grain: it compares ranks over chunks of several
    seconds (see ``profiler_hook.blocks``)."""
    heartbeat_s: float = 5.0
    """Seconds between heartbeats from the watchdog thread (a hang is named within a few of these)."""
    stall_s: float = 10.0
    """A rank with no progress for this long is stalled: its heartbeat carries its Python stack."""
    window_s: float = 30.0
    """A profiling window starts about every this many seconds, at a step every rank agrees on
    (0: never profile, not even when triggered); the first as soon as ``window_budget`` has room
    for it. A slowdown too small to trigger one (below) is still profiled within 30 s of its
    start, where ``window_budget`` has room: every window waits until it fits."""
    window_steps: int = 5
    """Steps profiled in each window, at most: fewer where a window costs more than one
    ``window_s`` interval's share of ``window_budget`` (``profiler_hook.budget``)."""
    window_budget: float = 0.0
    """The share of the rank's run time its profiling windows may cost, all of them together
    (periodic, triggered, follow-ups): each window's cost is measured (the extra time of the steps
    it covered and disturbed, and the CPU its summarizing took), and the next one waits until the
    windows so far, with it, stay within this share of the time since ``attach``; default:
    $RANKSCOPE_WINDOW_BUDGET or 0.005 (0.5%)."""
    trigger_ratio: float = 1.2
    """A window also starts when the mean step time of each of the last 2 seconds reaches this
    multiple of the median of the 8 seconds before on any rank, or that rank's own time outside
    collectives jumps 1.3x (a slowdown began: profile it now, and twice more 10 s apart, not at the
    next scheduled window); 0: never. Healthy DDP jobs on 2 shared cores, one row per step for 150 s
    at 4 and 8 ranks, jumped 1.08x and 1.09x at most; a rank behind a 1 Gbit/s NIC slowed the
    job 1.26x, under the 1.5x this was before, and got one window in 30 s after it began."""
    with_stack: bool = True
    """Record Python functions (by call stack) in the profiling windows that look for a cause, where
    ``window_budget`` has room for them: the second start-up window, those a slowdown or a rank
    standing out from its peers triggers, with their follow-ups, and every window while a rank
    stands out. Other windows record operators only:
    stacks took ~35 of the 45-75 ms a window cost a 2-rank DDP job at ~110 ms a step
    (``benchmarks.overhead.hook``)."""
    max_functions: int = 300
    """At most this many function patterns per window (the largest by total time are kept), and
    one more (``left_out@window``) that says how many were left out and the largest one's time."""
    patch_collectives: bool = True
    """Wrap torch.distributed collectives, and time DDP's gradient synchronization once per
    backward pass, to count, sequence and time every collective always-on."""
    kafka_bootstrap: str = ""
    """``host:port[,host:port]`` of the Kafka brokers (``sink="kafka"``); default: $RANKSCOPE_KAFKA."""
    kafka_topic: str = "rankscope"
    """Topic the records go to; the key (``job/rank``) keeps each rank's records in order."""
    kafka_api_version: str = ""
    """Broker protocol version such as ``0.9``; empty: detect (set it only for very old brokers)."""
    kafka_options: dict[str, Any] = field(default_factory=dict)
    """Passed to kafka-python's KafkaProducer as is: security_protocol, sasl_*, ssl_*, ..."""

    def __post_init__(self) -> None:
        check_numbers(self)
        for name in ("queue_size", "window_steps", "max_functions"):
            if getattr(self, name) < 1:
                raise UsageError(f"Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.step_block_s < 0:
            raise UsageError(f"Config.step_block_s must be >= 0, got {self.step_block_s}")
        for name in ("flush_s", "heartbeat_s", "stall_s"):
            if getattr(self, name) <= 0:
                raise UsageError(f"Config.{name} must be > 0, got {getattr(self, name)}")
        if not self.window_budget:
            try:
                budget = float(os.environ.get("RANKSCOPE_WINDOW_BUDGET") or DEFAULT_WINDOW_BUDGET)
            except ValueError:
                raise UsageError(
                    f"$RANKSCOPE_WINDOW_BUDGET must be a number, got {os.environ['RANKSCOPE_WINDOW_BUDGET']!r}"
                ) from None
            object.__setattr__(self, "window_budget", budget)
        if not 0 < self.window_budget <= 1:
            raise UsageError(f"Config.window_budget must be > 0 and <= 1, got {self.window_budget}")
        if self.window_s < 0:
            raise UsageError(f"Config.window_s must be >= 0, got {self.window_s}")
        if self.trigger_ratio and self.trigger_ratio <= 1:
            raise UsageError(f"Config.trigger_ratio must be 0 or > 1, got {self.trigger_ratio}")
        if self.sink not in ("spool", "kafka", "none"):
            raise UsageError(f"Config.sink must be 'spool', 'kafka' or 'none', got {self.sink!r}")
        if os.environ.get("RANKSCOPE_ENABLE", "1").strip().lower() in ("0", "false", "no", "off"):
            object.__setattr__(self, "enable", False)  # frozen: set once, here
        if not self.job and not os.environ.get("RANKSCOPE_JOB"):
            _warn_shared_job(os.environ.get("TORCHELASTIC_RUN_ID", ""))
        job = (
            self.job or os.environ.get("RANKSCOPE_JOB") or os.environ.get("TORCHELASTIC_RUN_ID") or "default"
        )
        object.__setattr__(self, "job", job)
        object.__setattr__(
            self, "spool_dir", self.spool_dir or os.environ.get("RANKSCOPE_SPOOL", "rankscope-spool")
        )
        object.__setattr__(
            self, "kafka_bootstrap", self.kafka_bootstrap or os.environ.get("RANKSCOPE_KAFKA", "")
        )
        if self.sink == "kafka" and not self.kafka_bootstrap:
            raise UsageError("Config.kafka_bootstrap (or $RANKSCOPE_KAFKA) is required with sink='kafka'")


def _warn_shared_job(run_id: str) -> None:
    global _warned_shared_job
    if run_id == "none" and not _warned_shared_job:
        _warned_shared_job = True
        log.warning(
            "rankscope: the job id falls back to TORCHELASTIC_RUN_ID=none (torchrun without "
            "--rdzv-id): unrelated runs would share the job 'none'; pass job= to attach(), set "
            "$RANKSCOPE_JOB, or give torchrun --rdzv-id"
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Identity:
    """Who this rank is. Host and topology labels can be overridden to simulate a cluster on one machine."""

    rank: int
    local_rank: int
    world_size: int
    host: str
    nic: str = ""
    switch: str = ""
    spine: str = ""
    pid: int = field(default_factory=os.getpid)
    attempt: int = 0
    """torchrun's restart count: 0 for the job's first attempt."""

    @classmethod
    def from_env(cls, rank: int | None = None, world_size: int | None = None) -> Identity:
        """Read $RANK, $LOCAL_RANK, $WORLD_SIZE (set by torchrun), falling back to torch.distributed.

        Topology: $RANKSCOPE_HOST, $RANKSCOPE_NIC, $RANKSCOPE_SWITCH, $RANKSCOPE_SPINE, or Kubernetes
        node labels (see :mod:`profiler_hook.labels`).
        """
        env = os.environ
        if rank is None or world_size is None:
            rank_env, world_env = env.get("RANK"), env.get("WORLD_SIZE")
            if rank_env is None or world_env is None:
                import torch.distributed as dist

                if dist.is_available() and dist.is_initialized():
                    rank_env, world_env = str(dist.get_rank()), str(dist.get_world_size())
            rank = int(rank_env or 0) if rank is None else rank
            world_size = int(world_env or 1) if world_size is None else world_size
        where = topology(env)
        return cls(
            rank=rank,
            local_rank=int(env.get("LOCAL_RANK", rank)),
            world_size=world_size,
            host=where["host"] or socket.gethostname(),
            nic=where["nic"],
            switch=where["switch"],
            spine=where["spine"],
            attempt=int(restarts) if (restarts := env.get("TORCHELASTIC_RESTART_COUNT", "")).isdigit() else 0,
        )
