"""Fault scenarios: one readable YAML file each under ``benchmarks/faults/scenarios/``.

Example (``compute-2x-r2.yaml``)::

    about: rank 2's device becomes 2x slower 12 s into the run
    ci: true                 # part of the reduced suite (default: false)
    world_size: 4
    hosts: 2                 # ranks spread over node0, node1 (RANKSCOPE_HOST)
    seconds: 40              # rank 0 ends the job after this long
    loop: ddp                # ddp (default), manual (a hand-written all-reduce) or fsdp2
    attach: start            # start (default: before the model) or loop (after DDP, at the loop)
    fault:                   # benchmarks.faults.catalogue.Fault fields, plus the runner's own:
      kind: compute
      rank: 2
      factor: 2.0
      onset_s: 12
    expect:                  # the ground truth a correct top finding names
      cause: compute
      ranks: [2]

Runner-only fault fields: ``rate_mbit`` (``nic``/``switch``/``link``: the rate-limited link), ``hogs`` (``host``:
CPU-hog processes sharing the rank's core), ``observe_s`` (stop the job this long after onset: hangs).

``script: demo_job`` runs a user-style training script under torchrun instead (``rankscope/demo_job.py``,
``benchmarks/faults/torchrun_job.py``); its ``fault:`` block then names the script's own faults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.faults.catalogue import ATTACH, LOOPS, NETWORK_FAULTS, Fault

from .scoring import GroundTruth
from .torchrun_job import ScriptFault, parse_fault

SCENARIO_DIR = Path(__file__).parent / "scenarios"
_RUNNER_FIELDS = ("rate_mbit", "hogs", "observe_s")
_TOP_FIELDS = {
    "about",
    "ci",
    "world_size",
    "hosts",
    "switches",
    "network",
    "seconds",
    "fault",
    "expect",
    "hook",
    "loop",
    "attach",
    "script",
    "script_args",
    "rank0_duties",
}


class ScenarioError(ValueError):
    """A scenario file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    name: str
    """The file name without ``.yaml``."""
    about: str = ""
    ci: bool = False
    world_size: int = 4
    hosts: int = 2
    switches: int = 0
    network: bool = False
    """Run the ranks on a simulated cluster network (a namespace per host, bridges per switch);
    ``nic``, ``switch`` and ``link`` faults always do (a script's job too: a torchrun agent per host,
    each in its host's namespace)."""
    seconds: float = 40.0
    fault: Fault = field(default_factory=Fault)
    rate_mbit: float = 0.0
    hogs: int = 1
    observe_s: float = 0.0
    hook: dict[str, Any] = field(default_factory=dict)
    """Hook settings on top of the suite's."""
    loop: str = "ddp"
    """How the job averages gradients (``benchmarks.faults.catalogue.LOOPS``): DDP, as most users' jobs do."""
    attach: str = "start"
    """Where the script attaches the hook (``benchmarks.faults.catalogue.ATTACH``): ``loop`` is after the
    model is wrapped, where people add a hook to a script they have."""
    rank0_duties: bool = False
    """Rank 0 logs, evaluates and checkpoints as most scripts have it do (``JobSpec.rank0_duties``)."""
    truth: GroundTruth = field(default_factory=lambda: GroundTruth(kind="none"))
    script: str = ""
    """A user-style script run under torchrun instead of the suite's workload
    (``benchmarks.faults.torchrun_job``); it injects ``script_fault`` itself, ``fault`` is the same family's."""
    script_fault: ScriptFault | None = None
    script_args: tuple[str, ...] = ()
    """More of the script's own flags (``--schedule gpipe``): the variant of the job it runs."""
    split: str = "tuning"
    """``tuning`` (``scenarios/``: the thresholds were set on it), or one no threshold was set on:
    ``validation`` (``scenarios/validation/``) or ``soak`` (``scenarios/soak/``: a healthy job of
    many minutes)."""

    @property
    def kind(self) -> str:
        return self.truth.kind

    @property
    def faulty_ranks(self) -> tuple[int, ...]:
        f = self.fault
        if f.kind == "none":
            return ()
        if f.kind == "job_wide":
            return tuple(range(self.world_size))
        return tuple(sorted({f.rank, *f.ranks}))


def kind_of(fault: Fault) -> str:
    """The fault kind for the report: ``compute``, ``compute-intermittent``, ``hang-python``..."""
    k = fault.kind
    if k == "none":
        return "healthy"
    if fault.also != "none":
        return "two-faults"
    if k == "hang":
        return f"hang-{fault.hang_at}"
    if fault.on_steps or (k == "dataloader" and fault.stall_every > 1):
        return f"{k}-intermittent"
    return k


def load(path: str | Path) -> Scenario:
    """Read and check one scenario file."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: cannot read it: {exc}") from exc
    if not isinstance(raw, dict):
        raise ScenarioError(f"{path}: expected a mapping of fields, got {type(raw).__name__}")
    unknown = set(raw) - _TOP_FIELDS
    if unknown:
        raise ScenarioError(f"{path}: unknown fields {sorted(unknown)}; known: {sorted(_TOP_FIELDS)}")
    fault_raw = dict(raw.get("fault") or {"kind": "none"})
    runner = {k: fault_raw.pop(k) for k in _RUNNER_FIELDS if k in fault_raw}
    if "ranks" in fault_raw:
        fault_raw["ranks"] = tuple(fault_raw["ranks"])
    script = str(raw.get("script") or "")
    script_fault: ScriptFault | None = None
    try:
        if script and fault_raw.get("kind") in NETWORK_FAULTS:  # the suite's; the script marks its onset
            fault = Fault(**fault_raw)
            script_fault = parse_fault(
                script, {"kind": "network", "rank": fault.rank, "onset_s": fault_raw.get("onset_s", 10.0)}
            )
        elif script:
            script_fault = parse_fault(script, fault_raw)
            fault = script_fault.suite_fault()
        else:
            fault = Fault(**fault_raw)
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{path}: fault: {exc}") from exc
    exp = dict(raw.get("expect") or {})
    kind = script_fault.report_kind if script_fault and script_fault.kind != "network" else kind_of(fault)
    try:
        truth = GroundTruth(
            kind=kind,
            cause=exp.get("cause"),
            ranks=tuple(exp.get("ranks") or ()),
            scope=exp.get("scope", "job" if exp.get("cause") == "job_wide" else "rank"),
            where=str(exp.get("where", "")),
            function=_texts(exp.get("function")),
            also=_also(exp.get("also"), kind),
        )
        sc = Scenario(
            name=path.stem,
            about=str(raw.get("about", "")),
            ci=bool(raw.get("ci", False)),
            world_size=int(raw.get("world_size", 4)),
            hosts=int(raw.get("hosts", 2)),
            switches=int(raw.get("switches", 0)),
            network=bool(raw.get("network", False)) or fault.kind in NETWORK_FAULTS,
            seconds=float(raw.get("seconds", 40.0)),
            fault=fault,
            rate_mbit=float(runner.get("rate_mbit", 0.0)),
            hogs=int(runner.get("hogs", 1)),
            observe_s=float(runner.get("observe_s", 0.0)),
            hook=dict(raw.get("hook") or {}),
            loop=str(raw.get("loop", "ddp")),
            attach=str(raw.get("attach", "start")),
            rank0_duties=bool(raw.get("rank0_duties", False)),
            truth=truth,
            script=script,
            script_fault=script_fault,
            script_args=tuple(str(x) for x in raw.get("script_args") or ()),
            split=path.parent.name if path.parent.name in UNTUNED else "tuning",
        )
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{path}: {exc}") from exc
    _check(path, sc)
    return sc


def _texts(raw: Any) -> tuple[str, ...]:
    """``expect.function``: one text, or a list of texts any of which is right."""
    if raw is None:
        return ()
    return tuple(str(x) for x in raw) if isinstance(raw, list) else (str(raw),)


def _also(raw: Any, kind: str) -> GroundTruth | None:
    """The second fault's ground truth (``expect.also``: cause, ranks, function)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"expect.also must be a mapping (cause, ranks, function), got {raw!r}")
    return GroundTruth(
        kind=kind,
        cause=raw.get("cause"),
        ranks=tuple(raw.get("ranks") or ()),
        function=_texts(raw.get("function")),
    )


def _check(path: Path, sc: Scenario) -> None:
    if not 2 <= sc.world_size <= 64:
        raise ScenarioError(f"{path}: world_size must be in 2..64, got {sc.world_size}")
    bad = [r for r in sc.faulty_ranks if not 0 <= r < sc.world_size]
    if bad:
        raise ScenarioError(f"{path}: fault ranks {bad} outside 0..{sc.world_size - 1}")
    if sc.attach not in ATTACH:
        raise ScenarioError(f"{path}: attach must be one of {', '.join(ATTACH)}, got {sc.attach!r}")
    if sc.loop not in LOOPS:
        raise ScenarioError(f"{path}: loop must be one of {', '.join(LOOPS)}, got {sc.loop!r}")
    if sc.loop == "fsdp2" and sc.fault.kind in ("compute", "job_wide"):
        raise ScenarioError(f"{path}: the fsdp2 loop has no {sc.fault.kind} fault")
    if sc.fault.kind in NETWORK_FAULTS:
        if sc.rate_mbit <= 0:
            raise ScenarioError(f"{path}: fault.rate_mbit must be > 0 for a {sc.fault.kind} fault")
        if 0 in sc.faulty_ranks:
            raise ScenarioError(f"{path}: rank 0 hosts the rendezvous and cannot sit behind the slow link")
    if sc.fault.kind == "hang" and sc.observe_s <= 0:
        raise ScenarioError(f"{path}: a hang needs fault.observe_s > 0 (when to stop the hung job)")
    if sc.script and (sc.hook or sc.loop != "ddp"):
        raise ScenarioError(f"{path}: a script runs at the hook's defaults: no hook or loop")
    if sc.script_args and not sc.script:
        raise ScenarioError(f"{path}: script_args are a script's flags: give script too")
    if sc.script and sc.world_size % max(1, sc.hosts):
        raise ScenarioError(f"{path}: world_size must be a multiple of hosts (a torchrun per host)")
    if sc.truth.healthy != (sc.fault.kind == "none"):
        raise ScenarioError(f"{path}: expect.cause must be given exactly when a fault is injected")
    if (sc.truth.also is None) != (sc.fault.also == "none"):
        raise ScenarioError(f"{path}: expect.also must be given exactly when fault.also is")


UNTUNED = ("validation", "soak")
"""The suites no threshold was set on, each the scenarios in the folder of its name."""
SUITES = ("full", "ci", *UNTUNED)


def load_all(suite: str = "full", only: Sequence[str] = (), directory: Path = SCENARIO_DIR) -> list[Scenario]:
    """The scenarios of ``suite``, sorted by name; ``only``: just the ones whose name contains one
    of these. ``full``: the tuning set, every scenario the diagnosis's thresholds were set on;
    ``ci``: those of them marked ``ci: true``; ``validation``: those under ``validation/``, which no
    threshold was set on (nor may be: a scenario tuned on moves to the tuning set); ``soak``:
    those under ``soak/``, healthy jobs that run for many minutes (no threshold set on them either),
    for the false alarms and tickets of a job's hours."""
    if suite not in SUITES:
        raise ScenarioError(f"suite must be one of {', '.join(SUITES)}, got {suite!r}")
    where = directory / suite if suite in UNTUNED else directory
    out = [load(p) for p in sorted(where.glob("*.yaml"))]
    if suite == "ci":
        out = [s for s in out if s.ci]
    if only:
        out = [s for s in out if any(o in s.name for o in only)]
    return out
