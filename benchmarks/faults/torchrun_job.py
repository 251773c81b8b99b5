"""Run a user-style training script under ``torchrun`` for the fault suite.

A scenario with ``script: demo_job`` runs ``rankscope/demo_job.py`` (the job ``rankscope demo`` runs)
instead of the suite's workload; ``script: nanogpt_like`` runs ``benchmarks/jobs/nanogpt_like.py``,
``script: pipeline_dp`` ``benchmarks/jobs/pipeline_dp.py`` (data x pipeline parallel, ``attach: loop``),
``script: tp_dp`` ``benchmarks/jobs/tp_dp.py`` (data x tensor parallel, ``attach: loop``),
``script: deepspeed_pipe`` ``benchmarks/jobs/deepspeed_pipe.py`` (DeepSpeed's pipeline engine over
data x pipeline parallel ranks, ``attach: loop``), ``script: pp_tp_dp``
``benchmarks/jobs/pp_tp_dp.py`` (pipeline x data x tensor parallel, 8 ranks, ``attach: loop``).
The script injects its faults itself (command-line flags); its ``fault:`` block names one of the
script's faults::

    script: demo_job
    world_size: 4
    hosts: 2
    fault:
      kind: slow_data        # none, slow_data, slow_backward, metrics_block, hang_checkpoint
      rank: 2
      delay_ms: 15           # slow_data: per batch; metrics_block: per upload_metrics() call
      onset_s: 12
    expect: {cause: dataloader, ranks: [2]}

On a simulated network (a ``nic``, ``switch`` or ``link`` fault, or ``network: true``) each agent
runs in its host's network namespace (``ip netns exec``), its ranks' gloo on that host's NIC.

Each simulated host is one ``torchrun`` agent (a static rendezvous with ``--nnodes hosts
--node-rank N``, as a multi-node job is launched), started with ``RANKSCOPE_HOST=node<N>``, so its
ranks (``N * ranks_per_host + LOCAL_RANK``) are named as the suite's workload names them. The job id
is torchrun's run id (``--rdzv-id``), the spool ``$RANKSCOPE_SPOOL``: the script attaches the hook
at its defaults, as a user would. Each agent's output (its ranks' too) goes to
``<log_dir>/node<N>.log``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.faults.catalogue import Fault, JobSpec, first_onset, host_of, switch_of

if TYPE_CHECKING:
    from .scenarios import Scenario

JOBS_DIR = Path(__file__).parents[1] / "jobs"
SCRIPTS = {
    "demo_job": Path(__file__).parents[2] / "rankscope" / "demo_job.py",
    "nanogpt_like": JOBS_DIR / "nanogpt_like.py",
    "pipeline_dp": JOBS_DIR / "pipeline_dp.py",
    "tp_dp": JOBS_DIR / "tp_dp.py",
    "deepspeed_pipe": JOBS_DIR / "deepspeed_pipe.py",
    "pp_tp_dp": JOBS_DIR / "pp_tp_dp.py",
}
"""Scenario ``script:`` name -> the training script."""

LM_FAULTS: dict[str, tuple[str, str]] = {
    "none": ("none", "healthy"),
    "slow_data": ("dataloader", "dataloader"),
    "slow_backward": ("compute", "compute"),
    "metrics_block": ("code_path", "code_path"),
    "hang_checkpoint": ("hang", "hang-checkpoint"),
}
"""demo_job's fault -> (the suite workload's fault of the same family, the report's fault kind)."""
FAULTS = {
    "demo_job": LM_FAULTS,
    "nanogpt_like": {"none": ("none", "healthy"), "stall": ("code_path", "code_path")},
    "pipeline_dp": {
        **{k: v for k, v in LM_FAULTS.items() if k != "slow_data"},
        "network": ("none", "network"),
    },
    "tp_dp": {k: v for k, v in LM_FAULTS.items() if k != "slow_data"},
    "deepspeed_pipe": {k: v for k, v in LM_FAULTS.items() if k != "slow_data"},
    "pp_tp_dp": {k: v for k, v in LM_FAULTS.items() if k != "slow_data"},
}
"""Per script, its faults (as ``LM_FAULTS``)."""
_FAULT_FIELDS = {"kind", "rank", "onset_s", "delay_ms", "factor"}
_OWN_ENV = ("RANKSCOPE_JOB", "RANKSCOPE_HOST", "RANKSCOPE_NIC", "RANKSCOPE_SWITCH", "RANKSCOPE_SPOOL")
"""Hook settings from the suite's own environment that must not reach the job's ranks."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ScriptFault:
    """A fault the script injects itself (its ``--fault`` flags)."""

    script: str = "demo_job"
    kind: str = "none"
    rank: int = 1
    onset_s: float = 10.0
    """Seconds into training (rank 0's clock) at which the fault starts."""
    delay_ms: float = 15.0
    """slow_data: extra read time per batch; metrics_block: how long each upload blocks."""
    factor: float = 1.7
    """slow_backward: how many times the work the rank's forward and backward do."""

    def __post_init__(self) -> None:
        if self.kind not in FAULTS[self.script]:
            raise ValueError(
                f"unknown fault {self.kind!r} for {self.script}; choose one of {', '.join(FAULTS[self.script])}"
            )
        if self.factor <= 1 or self.delay_ms <= 0 or self.onset_s < 0:
            raise ValueError("fault.factor must be > 1, fault.delay_ms > 0 and fault.onset_s >= 0")

    def flags(self) -> list[str]:
        if self.kind == "none":
            return ["--fault", "none"]
        return [
            "--fault",
            self.kind,
            "--fault-rank",
            str(self.rank),
            "--onset-s",
            str(self.onset_s),
            "--fault-ms",
            str(self.delay_ms),
            "--fault-factor",
            str(self.factor),
        ]

    def suite_fault(self) -> Fault:
        """The suite workload's fault of the same family: what the suite's bookkeeping reads
        (faulty ranks, onset, whether it is a hang)."""
        return Fault(
            kind=FAULTS[self.script][self.kind][0],
            rank=self.rank,
            onset_s=self.onset_s,
            factor=self.factor,
            delay_ms=self.delay_ms,
        )

    @property
    def report_kind(self) -> str:
        return FAULTS[self.script][self.kind][1]


def parse_fault(script: str, raw: Mapping[str, Any]) -> ScriptFault:
    """The scenario's ``fault:`` block (runner fields such as ``observe_s`` already taken out)."""
    if script not in SCRIPTS:
        raise ValueError(f"script must be one of {', '.join(SCRIPTS)}, got {script!r}")
    unknown = set(raw) - _FAULT_FIELDS
    if unknown:
        raise ValueError(f"fields {sorted(unknown)} are not {script}'s; it takes {sorted(_FAULT_FIELDS)}")
    fields: dict[str, Any] = {
        k: float(v) if k in ("onset_s", "delay_ms", "factor") else v for k, v in raw.items()
    }
    return ScriptFault(script=script, **fields)


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (torchrun's ranks run in sessions of their own)."""
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out += [int(c) for c in fh.read().split()]
    except OSError:
        pass
    return out


def _stop(agents: list[subprocess.Popen], ranks: list[int], grace_s: float = 15.0) -> None:
    """SIGTERM the agents (torchrun then stops its ranks); SIGKILL what is left after ``grace_s``."""
    for p in agents:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in agents:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(5.0)
    for pid in ranks:  # a rank its agent could not stop (if that pid still runs a script of ours)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if any(str(s).encode() in fh.read() for s in SCRIPTS.values()):
                    os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def commands(sc: Scenario, spec: JobSpec) -> list[tuple[list[str], dict[str, str]]]:
    """One ``torchrun`` command line and environment per simulated host."""
    if sc.script_fault is None:
        raise ValueError(f"scenario {sc.name} runs no script")
    hosts = max(1, sc.hosts)
    per_host = sc.world_size // hosts
    script_args = [
        "--seconds",
        str(sc.seconds),
        *sc.script_fault.flags(),
        *sc.script_args,
        "--attach",
        sc.attach,
        *(["--marker-dir", spec.marker_dir] if spec.marker_dir else []),
        # beside the logs: a killed (hung) job leaves nothing behind in the machine's temp dir
        *(["--ckpt-dir", str(Path(spec.log_dir).parent / "checkpoints")] if spec.log_dir else []),
    ]
    out = []
    for node in range(hosts):
        env = {
            **{k: v for k, v in os.environ.items() if k not in _OWN_ENV},
            "RANKSCOPE_SPOOL": str((spec.hook or {}).get("spool_dir", "")),
            "RANKSCOPE_HOST": host_of(node * per_host, spec),
            "PYTHONUNBUFFERED": "1",
        }
        if spec.switches:
            env["RANKSCOPE_SWITCH"] = switch_of(node * per_host, spec)
        # On the suite's simulated network the agent and its ranks run in their host's namespace.
        netns = spec.netns.get(node * per_host, "")
        if netns:
            env["GLOO_SOCKET_IFNAME"] = spec.ifname[node * per_host]
        cmd = [
            *(["ip", "netns", "exec", netns] if netns else []),
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(hosts),
            "--node-rank",
            str(node),
            "--nproc-per-node",
            str(per_host),
            "--master-addr",
            spec.master_addr,
            "--master-port",
            str(spec.port),
            "--rdzv-id",
            spec.job,
            str(SCRIPTS[sc.script]),
            *script_args,
        ]
        out.append((cmd, env))
    return out


def run(
    sc: Scenario, spec: JobSpec, markers: Path, start_s: float
) -> tuple[dict[str, Any] | None, str, list[str]]:
    """Run the scenario's script until it ends (or, hung, ``observe_s`` after its onset marker);
    returns (onset marker, error, cleanup errors) as the suite's own job runner does."""

    log_dir = Path(spec.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    (log_dir.parent / "checkpoints").mkdir(exist_ok=True)
    agents: list[subprocess.Popen] = []
    ranks: set[int] = set()
    error, onset = "", None
    try:
        for node, (cmd, env) in enumerate(commands(sc, spec)):
            with open(log_dir / f"node{node}.log", "wb") as log:
                agents.append(
                    subprocess.Popen(
                        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        deadline = time.monotonic() + sc.seconds + start_s
        while True:
            for p in agents:
                ranks.update(_children(p.pid))
            onset = onset or first_onset(markers)
            codes = [p.poll() for p in agents]
            if all(c is not None for c in codes):
                bad = [f"node{i} exited {c}" for i, c in enumerate(codes) if c]
                if bad:
                    error = f"{', '.join(bad)} (see {log_dir})"
                break
            if sc.observe_s and onset and time.time() >= onset["time"] + sc.observe_s:
                break  # a hung job: stop it once it has been watched long enough
            if time.monotonic() >= deadline:
                error = f"job still running {sc.seconds + start_s:.0f} s after start: stopped"
                break
            time.sleep(0.5)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    finally:
        _stop(agents, sorted(ranks))
    return onset or first_onset(markers), error, []
