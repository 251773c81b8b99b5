"""The fault suite's catalogue: the faults it injects into its own job and from outside it
(``Fault``), the job it runs them on (``JobSpec``: ranks, hosts, switches, loop), where each rank
sits, and the onset marker a faulty rank writes.

Faults (only on ``Fault.rank``):

``compute``     a slow device: every layer processes more rows (the real batch plus zero padding
                that is sliced off again, as many as make forward and backward ``factor``× as
                long), so the same operators take longer.
``dataloader``  slow storage: each batch fetch waits ``delay_ms`` more.
``code_path``   the rank runs an extra Python function every step (a gradient audit).

More, for the fault suite (``benchmarks/faults/suite.py``):

``callback``    every rank reports metrics after each step; the faulty rank's upload blocks.
``grad_hook``   a gradient hook left on the rank's parameters inspects every gradient.
``gc``          a memory clean-up every ``gc_every`` steps forces a full garbage collection
                (``gc.collect()``), which traverses every Python object of the process (torch's
                alone are ~150,000): a collector pause of tens of milliseconds.
``job_wide``    every rank becomes ``factor``× slower (a bad library, config or shared dependency).
``hang``        the rank blocks for good: before the all-reduce, inside its data loader's fetch,
                spinning in a Python function, or in a checkpoint write (``hang_at``). The suite
                stops the job afterwards.

``Fault.also`` adds a second rank-local fault on another rank (two faults at once).
``host`` ``nic`` ``switch`` ``link``  applied from outside the job (a CPU hog on the rank's core, a
                rate-limited NIC, uplink or link between two hosts); in the ranks they only mark the onset.

Every fault starts at ``onset_step`` or, with ``onset_s`` >= 0, at the first step after rank 0 has
trained that many seconds (rank 0 tells the others through the all-reduce, so all ranks agree on
the step). ``on_steps``/``off_steps`` make it intermittent. The first faulty step is written to
``JobSpec.marker_dir`` (``onset-r<rank>``: time and step), which tells the suite when the fault began
and when to apply the external ones.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NETWORK_FAULTS = ("nic", "switch", "link")
"""Applied to the simulated network (``benchmarks.faults.injectors.Fabric``): a NIC, a switch's uplink, the link between two hosts."""
_LOCAL_FAULTS = ("compute", "dataloader", "code_path", "callback", "grad_hook", "gc")
"""Faults that live inside one rank's code, any two of which can run at once on two ranks ."""
SUITE_FAULTS = ("none", *_LOCAL_FAULTS, "job_wide", "hang", "host", *NETWORK_FAULTS)
"""Every fault kind; the last three are applied from outside the ranks (see the fault suite)."""
HANG_SITES = ("collective", "dataloader", "python", "checkpoint")
ATTACH = ("start", "loop")
LOOPS = ("manual", "ddp", "fsdp2")


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    kind: str = "none"
    rank: int = 2
    ranks: tuple[int, ...] = ()
    """More faulty ranks besides ``rank`` (a host or a switch); ``job_wide`` is on every rank."""
    factor: float = 2.0
    """compute, job_wide: how many times more work each layer does on the faulty rank."""
    delay_ms: float = 15.0
    """dataloader: extra wait per batch on the faulty rank."""
    stall_every: int = 1
    """dataloader: only every this-many-th batch waits ``delay_ms`` (1: every batch)."""
    audit_rounds: int = 12
    """code_path: how many times the extra function walks the gradients per step; grad_hook: how
    many times the gradient hook inspects each gradient."""
    block_ms: float = 15.0
    """callback: how long the step callback blocks (a synchronous metrics upload)."""
    gc_every: int = 5
    """gc: steps between forced full collections."""
    also: str = "none"
    """A second fault, of a rank-local kind, on rank ``also_rank`` from the same onset (two at once)."""
    also_rank: int = 0
    hang_at: str = "collective"
    """hang: where the rank blocks, one of ``HANG_SITES``."""
    onset_step: int = 0
    """The fault starts at this step (ignored when ``onset_s`` >= 0)."""
    onset_s: float = -1.0
    """If >= 0, the fault starts at the first step after rank 0 has trained this many seconds."""
    on_steps: int = 0
    """If > 0, the fault is intermittent: on for this many steps, then off for ``off_steps``."""
    off_steps: int = 0

    def __post_init__(self) -> None:
        if self.kind not in SUITE_FAULTS:
            raise ValueError(f"unknown fault {self.kind!r}; choose one of {', '.join(SUITE_FAULTS)}")
        if self.factor < 1:
            raise ValueError(f"Fault.factor must be >= 1, got {self.factor}")
        if self.hang_at not in HANG_SITES:
            raise ValueError(f"Fault.hang_at must be one of {', '.join(HANG_SITES)}, got {self.hang_at!r}")
        if self.also not in ("none", *_LOCAL_FAULTS) or (self.also != "none" and self.also_rank == self.rank):
            raise ValueError(
                f"Fault.also must be one of {', '.join(_LOCAL_FAULTS)} on a rank other than rank"
            )
        if self.stall_every < 1 or self.on_steps < 0 or self.off_steps < 0:
            raise ValueError("Fault.stall_every must be >= 1, Fault.on_steps and Fault.off_steps >= 0")

    def on(self, rank: int) -> str:
        if self.kind == "job_wide" or rank == self.rank or rank in self.ranks:
            return self.kind
        return self.also if rank == self.also_rank else "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSpec:
    job: str
    world_size: int = 4
    port: int = 29500
    seconds: float = 60.0
    """Rank 0 ends the job at the first step after this many seconds (all ranks stop together)."""
    max_steps: int = 0
    """If > 0, stop after this many steps instead."""
    fault: Fault = field(default_factory=Fault)
    hosts: int = 2
    """Ranks are spread over this many simulated hosts (``node0``, ``node1``, ...)."""
    hook: dict[str, Any] | None = field(default_factory=dict)
    """profiler_hook.Config settings; None runs without the hook."""
    hook_blocks: int = 0
    """If > 0, the hook works only in even blocks of this many steps (an A/B inside one run)."""
    log_dir: str = ""
    """If set, each rank's stderr goes to ``<log_dir>/rank<R>.log``."""
    switches: int = 0
    """If > 0, hosts are spread over this many simulated switches (``RANKSCOPE_SWITCH=sw0``, ...)."""
    master_addr: str = "127.0.0.1"
    netns: dict[int, str] = field(default_factory=dict)
    """Rank -> network namespace (a name under /run/netns) the rank joins before connecting."""
    ifname: dict[int, str] = field(default_factory=dict)
    """Rank -> network interface gloo binds to (``GLOO_SOCKET_IFNAME``)."""
    pin_cpu: dict[int, int] = field(default_factory=dict)
    """Rank -> the one CPU core the rank is pinned to."""
    marker_dir: str = ""
    """If set, each faulty rank writes ``onset-r<rank>`` there at its first faulty step."""
    timeout_s: float = 0.0
    """If > 0, the process group's timeout (a collective waiting longer fails)."""
    progress: bool = True
    rank0_duties: bool = False
    """Rank 0 does what most scripts have it do: log the loss every 10 steps, evaluate on held-out
    batches every 50 and save a checkpoint every 100 (a healthy job whose rank 0 does more)."""
    batch_size: int = 64
    hidden: int = 512
    loop: str = "ddp"
    """How gradients are synchronized: ``ddp`` (``DistributedDataParallel``, as most jobs do),
    ``manual`` (a hand-written all-reduce) or ``fsdp2`` (``fully_shard``; no compute or job-wide faults)."""

    attach: str = "start"
    """Where the script attaches the hook: ``start`` (after the process group, before the model,
    as the README shows) or ``loop`` (just before the training loop, after the model, DDP and the
    optimizer are built: where people add a hook to a script they have)."""

    def __post_init__(self) -> None:
        if self.loop not in LOOPS:
            raise ValueError(f"JobSpec.loop must be one of {LOOPS}, got {self.loop!r}")
        if self.attach not in ATTACH:
            raise ValueError(f"JobSpec.attach must be one of {ATTACH}, got {self.attach!r}")


def host_of(rank: int, spec: JobSpec) -> str:
    per_host = max(1, -(-spec.world_size // max(1, spec.hosts)))
    return f"node{rank // per_host}"


def switch_of(rank: int, spec: JobSpec) -> str:
    """The simulated switch of ``rank``'s host ('' without switches)."""
    if spec.switches <= 0:
        return ""
    per_switch = max(1, -(-max(1, spec.hosts) // spec.switches))
    return f"sw{int(host_of(rank, spec)[4:]) // per_switch}"


def first_onset(marker_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The earliest onset marker a faulty rank wrote (``time``, ``step``, ``rank``), if any."""
    paths = sorted(Path(marker_dir).glob("onset-r*"))
    found = [json.loads(p.read_text()) for p in paths if p.suffix != ".tmp"]
    return min(found, key=lambda m: m["time"]) if found else None
