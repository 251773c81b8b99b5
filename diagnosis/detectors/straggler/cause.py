"""What a straggler's extra time is: its cause, the function that holds it, and the evidence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...findings import Cause, ms
from . import contention, functions
from .rank import Straggler


@dataclass(frozen=True, slots=True)
class Attribution:
    cause: Cause
    function: str
    cause_share: float
    """The share of the culprit's excess time the cause accounts for."""
    function_share: float
    """The share of it ``function`` holds (the time no operator or function could be named for
    is ``UNATTRIBUTED``'s)."""
    evidence: dict[str, Any]


ATTRIBUTED = 0.5
"""The share of a culprit's excess that what is named for it must hold: the operators that got
slower, for a slower device; else a function of the job's code the stack samples found it in. Also
the share a wait (for a CPU, for data) or the garbage collector must hold to be the cause."""
WORKING = 0.25
"""A rank whose CPU time grew by this share of its excess works more (a slower device); one whose
CPU time grew less, and whose kernels did not hold it, sleeps or blocks (a code path)."""
STARVED = 0.8
"""A rank is starved when the CPU share of its own time (less its wait for data) is at most this
fraction of its peers': it got less of the CPU for the same work."""
CODE_PATH = 0.3
"""A function only the culprit runs is its code path when it holds this share of the excess..."""
RARE_CODE_PATH = 0.1
"""...or, where the windows caught fewer of its (rare) calls than the steps paid for, this share and
``RARE_OVER_WORK`` times the excess of all the operators that got slower (a garbage collection every
5 steps: 24% of the excess in 4 windows, with no operator slower)."""
RARE_OVER_WORK = 2.0
SEEN = 0.3
"""The share of a wait's excess a function must hold to be named for it: a window sees most batch
fetches, and some garbage collections, not all of them."""
SWITCHES = (2.0, 5)
"""A starved rank switched out this many times its peers' involuntary switches, plus this many, per
step is contended as a whole process."""
UNATTRIBUTED = "(unattributed: no profiled operator or function, and no stack sample, holds it)"
ACROSS_OPERATORS = "(across its operators: none holds half)"
"""A slower device's excess, spread over the operators it runs as often as its peers."""
GARBAGE_COLLECTION = "(Python garbage collection)"
"""Collections that stop the rank longer than its peers', in no function the windows or stack
samples caught."""


@dataclass(frozen=True, slots=True)
class Case:
    """What the cause rules read of one straggler, worked out once."""

    st: Straggler
    excess: list[functions.FunctionExcess]
    waits: contention.Contended | None
    sampled: functions.Sampled | None
    total: float
    """The culprit's excess time per step (us)."""
    own_eff: float
    peer_eff: float
    extra: functions.FunctionExcess | None
    """The function only the culprit runs, where it holds enough of the excess to be its code path."""
    work: float
    """The excess of the operators that got slower."""
    sampled_us: float
    """The time a sampled function holds beyond the peers' share of it: that share of the rank's steps."""
    slower: functions.FunctionExcess | None
    compute_excess: float
    """The excess of its own time less its wait for data."""

    @property
    def starved(self) -> bool:
        return self.own_eff <= STARVED * self.peer_eff

    @property
    def waited(self) -> float:
        return self.waits.wait_us - self.waits.peer_wait_us if self.waits is not None else 0.0


def case(
    st: Straggler,
    excess: list[functions.FunctionExcess],
    waits: contention.Contended | None,
    sampled: functions.Sampled | None,
) -> Case:
    total = max(st.excess_us, 1.0)
    work = functions.work_excess(excess)
    extra = functions.top_extra(excess)
    if extra is not None and (
        not (
            extra.excess_us >= CODE_PATH * total
            or (extra.excess_us >= RARE_CODE_PATH * total and extra.excess_us >= RARE_OVER_WORK * work)
        )
        or functions.stray_builtin(excess, extra)
    ):
        extra = None
    # Time waiting for data is no time the thread wanted a CPU: a rank whose reads sleep 15 ms a
    # batch uses the CPU for 40% of its own time, and is not starved.
    return Case(
        st=st,
        excess=excess,
        waits=waits,
        sampled=sampled,
        total=total,
        own_eff=st.cpu_us / max(st.own_us - st.data_us, 1.0),
        peer_eff=st.peer_cpu_us / max(st.peer_own_us - st.peer_data_us, 1.0),
        extra=extra,
        work=work,
        sampled_us=sampled.excess * (st.own_us + st.comm_us) if sampled is not None else 0.0,
        slower=functions.top_slower(excess),
        compute_excess=(st.own_us - st.data_us) - (st.peer_own_us - st.peer_data_us),
    )


def _efficiency(c: Case) -> dict[str, Any]:
    return {
        "cpu_share_of_own_time_less_data_wait": round(c.own_eff, 3),
        "peer_cpu_share_of_own_time_less_data_wait": round(c.peer_eff, 3),
    }


def waits_for_a_cpu(c: Case) -> Attribution | None:
    """Starved, its threads waiting for a CPU longer than its peers' for half its excess. (A rank with
    more work queues longer on a busy host too, behind its own threads, at the same share.) Own time
    is less the main thread's run-queue wait already where the hook measured it (wire v3); this is
    for the rest: its other threads' wait that it waited on, and older hooks' data.

    Of a starved rank that also runs a code path of its own, the larger account: a rank whose metrics
    upload sleeps 15 ms a step uses the CPU for under half its own time, and its threads wait ~9.5 ms
    a step longer than its peers' (the others run meanwhile), the upload ~15.5. The wait is summed
    over the rank's threads, the code path's time is the training thread's: a code path that holds
    half the excess explains it as it would name it (a gradient audit of 8.9 ms a step, 1.4x the
    excess, on 8 ranks sharing 2 cores, made its threads wait 78 ms a step longer: work queues for
    a CPU)."""
    if not (c.starved and c.waits is not None and c.waited >= ATTRIBUTED * c.total):
        return None
    if c.extra and c.extra.excess_us > min(c.waited, ATTRIBUTED * c.total):
        return None
    ev = {**wait_evidence(c.waits), **_efficiency(c)}
    return Attribution("host_contention", CPU_WAIT, 1.0, c.waited / c.total, ev)


def waits_for_data(c: Case) -> Attribution | None:
    """Its wait for batches holds half its excess: the loader, or the job's function it reads in."""
    st = c.st
    data_excess = st.data_us - st.peer_data_us
    if data_excess < ATTRIBUTED * c.total:
        return None
    fn = functions.top_of_kind(c.excess, "dataloader")
    loader = fn.name if fn else "DataLoader.__next__"
    ev: dict[str, Any] = {"data_wait_ms": ms(st.data_us), "peer_data_wait_ms": ms(st.peer_data_us)}
    share = data_excess / c.total
    code = functions.innermost_code(c.excess, SEEN * data_excess)
    if code is not None:
        ev = {**ev, **code_evidence(code), "loader": loader}
        return Attribution("dataloader", code.name, share, code.excess_us / c.total, ev)
    if c.sampled is not None:
        ev = {**ev, **sampled_evidence(c.sampled), "loader": loader}
        return Attribution("dataloader", c.sampled.name, share, c.sampled_us / c.total, ev)
    return Attribution("dataloader", loader, share, share, ev)


def collects_garbage(c: Case) -> Attribution | None:
    """The garbage collector stops it longer than its peers (the hook times every collection), for
    half its excess: a clean-up the job's code calls, or more objects to traverse. Where the windows
    or the stack samples caught the function its collections run in, that function."""
    st = c.st
    collected = st.gc_us - st.peer_gc_us
    if collected < ATTRIBUTED * c.total or (c.extra and c.extra.excess_us > collected):
        return None
    ev = {"gc_ms_per_step": ms(st.gc_us), "peer_gc_ms_per_step": ms(st.peer_gc_us)}
    share = collected / c.total
    code = functions.innermost_code(c.excess, SEEN * collected)
    if code is not None:
        return Attribution(
            "code_path", code.name, share, code.excess_us / c.total, {**ev, **code_evidence(code)}
        )
    if c.sampled is not None and c.sampled_us >= ATTRIBUTED * collected:
        ev = {**ev, **sampled_evidence(c.sampled)}
        return Attribution("code_path", c.sampled.name, share, c.sampled_us / c.total, ev)
    return Attribution("code_path", GARBAGE_COLLECTION, share, share, ev)


def runs_code_its_peers_do_not(c: Case) -> Attribution | None:
    """A function only the culprit runs (``Case.extra``): the innermost function of the job's code
    under it that holds half its excess, or, where the windows saw only an operator (no Python
    stacks), the function its stack samples put it in beyond its peers."""
    extra = c.extra
    if extra is None:
        return None
    code = functions.innermost_code(c.excess, ATTRIBUTED * extra.excess_us)
    counts = {"calls_per_step": round(extra.rank_count, 2), "peer_calls_per_step": round(extra.peer_count, 2)}
    if code is None and extra.kind not in functions.PYTHON_KINDS and c.sampled is not None:
        ev = {**sampled_evidence(c.sampled), "operator": extra.name, **counts}
        return Attribution("code_path", c.sampled.name, extra.excess_us / c.total, c.sampled_us / c.total, ev)
    code = code or extra
    ev = {**code_evidence(code), **counts}
    if code is not extra:
        ev["entered_through"] = extra.name
    op = functions.top_of_kinds(c.excess, functions.WORK_KINDS)
    if op is not None:
        ev["operator"] = op.name
    return Attribution("code_path", code.name, extra.excess_us / c.total, code.excess_us / c.total, ev)


def blocks_in_its_code(c: Case) -> Attribution | None:
    """The job's own function takes longer on this rank, but not in operators: it blocks or waits (a
    synchronous upload, a lock, I/O). A slower device slows the operators under it."""
    slow_code = functions.innermost_code(c.excess, ATTRIBUTED * c.total)
    if slow_code is None or c.work >= ATTRIBUTED * slow_code.excess_us:
        return None
    ev = {**code_evidence(slow_code), "calls_per_step": round(slow_code.rank_count, 2)}
    share = slow_code.excess_us / c.total
    return Attribution("code_path", slow_code.name, share, share, ev)


def switched_out(c: Case) -> Attribution | None:
    """Starved and switched out far more often than its peers: its whole process contended."""
    st, (factor, plus) = c.st, SWITCHES
    if not (c.starved and st.nivcsw >= factor * st.peer_nivcsw + plus):
        return None
    ev = {
        "involuntary_switches_per_step": st.nivcsw,
        "peer_involuntary_switches_per_step": st.peer_nivcsw,
        **_efficiency(c),
    }
    return Attribution("host_contention", "(whole process)", 1.0, 1.0, ev)


def _operator_evidence(c: Case) -> dict[str, Any]:
    slower = c.slower
    if slower is None:
        return {}
    ev: dict[str, Any] = {
        "operator_ms_per_step": ms(slower.rank_us),
        "operator_peer_ms_per_step": ms(slower.peer_us),
        "operator_ratio": round(slower.rank_us / max(slower.peer_us, 1e-9), 3),
        "calls_per_step": round(slower.rank_count, 2),
    }
    if slower.kind in functions.DEVICE_KINDS and slower.stack:
        ev["launched_by"] = slower.stack  # the operator a GPU kernel or copy was launched in
    return ev


def _working(c: Case) -> bool:
    """Work is CPU time on the training thread, or a device's: its kernels and copies. A rank whose
    own time grew with neither sleeps or blocks, outside any operator: a rank that sleeps in its loop
    keeps its CPU time, while its operators, nested in each other and slowed on the shared cores
    while it sleeps and its peers run, can add up to more than its peers'. A slower device's CPU time
    grows by a good part of its excess (~35%, even with the run-queue wait still in own time, as older
    hooks record it). (Records without CPU time tell nothing.)"""
    st = c.st
    return (
        (st.cpu_us <= 0 and st.peer_cpu_us <= 0)
        or st.cpu_us - st.peer_cpu_us >= WORKING * c.compute_excess
        or functions.work_excess(c.excess, functions.DEVICE_KINDS) >= ATTRIBUTED * c.compute_excess
    )


def works_outside_operators(c: Case) -> Attribution | None:
    """Not working, or working outside the operators (they do not hold the time): a code path, where
    its stack samples put it, a line of a loop at module level included. Not working, all its excess
    is the code path's, whatever share of it the samples name. Working where no window saw its
    operators, in a function its peers' samples find them in too (at any of its lines: the demo's
    slower device, 3 of its 42 samples at a line of its attention that none of its peers' were at,
    was once called a code path), it is not outside them: a slower device slows what every rank
    runs, where a code path runs what its peers do not."""
    working = _working(c)
    if working and c.work >= ATTRIBUTED * c.compute_excess:
        return None
    if working and not c.excess and c.sampled is not None and c.sampled.peer_function_share > 0:
        return None
    ev = _operator_evidence(c)
    if c.sampled is not None and c.sampled_us >= ATTRIBUTED * c.total:
        share = c.compute_excess / c.total if not working else c.sampled_us / c.total
        return Attribution(
            "code_path", c.sampled.name, share, c.sampled_us / c.total, {**sampled_evidence(c.sampled), **ev}
        )
    if not working:
        ev = {**ev, "cpu_ms_per_step": ms(c.st.cpu_us), "peer_cpu_ms_per_step": ms(c.st.peer_cpu_us)}
        return Attribution("code_path", UNATTRIBUTED, c.compute_excess / c.total, 0.0, ev)
    return None


def slower_device(c: Case) -> Attribution:
    """What it names must hold half of the excess: the job's own function whose operators got slower
    (the innermost), else one operator, else the function of its code the stack samples put it in. A
    slower device slows every operator, forward and backward, and none may hold half (its forward a
    third, ``aten::mm`` 45% on a device 2x slower): then the finding names its operators as a whole,
    the largest of them in the evidence."""
    slower, ev = c.slower, _operator_evidence(c)
    held = ATTRIBUTED * c.compute_excess
    share = c.compute_excess / c.total
    if slower is not None and (code := functions.innermost_code(c.excess, held)) is not None:
        ev = {**ev, **code_evidence(code), "operator": slower.name}  # the function, and the operator
        return Attribution("compute", code.name, share, code.excess_us / c.total, ev)
    if slower is not None and slower.excess_us >= held:
        return Attribution("compute", slower.name, share, slower.excess_us / c.total, ev)
    if c.sampled is not None and c.sampled_us >= held:
        ev = {**sampled_evidence(c.sampled), **ev}
        return Attribution("compute", c.sampled.name, share, c.sampled_us / c.total, ev)
    if slower is None:
        return Attribution("compute", UNATTRIBUTED, share, 0.0, ev)
    # At their median call's time, as the rule weighs them: a mean counts the calls preempted on
    # shared cores, and read "none holding half (aten::linear 84%, ...)" in the demo.
    ev["largest"] = {e.name: round(e.typical_excess_us / c.total, 3) for e in functions.largest(c.excess, 3)}
    return Attribution("compute", ACROSS_OPERATORS, share, slower.excess_us / c.total, ev)


RULES = (
    waits_for_a_cpu,
    waits_for_data,
    collects_garbage,
    runs_code_its_peers_do_not,
    blocks_in_its_code,
    switched_out,
    works_outside_operators,
)
"""The cause rules, in order: the first that explains the excess names its cause; else a slower device."""


def classify(
    st: Straggler,
    excess: list[functions.FunctionExcess],
    waits: contention.Contended | None,
    sampled: functions.Sampled | None = None,
) -> Attribution:
    """Cause, function and evidence of one straggler's extra time; ``sampled``: where its stack
    samples put it beyond its peers, for time no window caught."""
    c = case(st, excess, waits, sampled)
    for rule in RULES:
        if (found := rule(c)) is not None:
            return found
    return slower_device(c)


def code_evidence(code: functions.FunctionExcess) -> dict[str, Any]:
    return {
        "stack": code.stack,
        "function_ms_per_step": ms(code.rank_us),
        "function_peer_ms_per_step": ms(code.peer_us),
    }


def sampled_evidence(s: functions.Sampled) -> dict[str, Any]:
    return {
        "stack_samples_in_function": f"{s.samples}/{s.of}",
        **({"line": s.line} if s.line is not None else {}),
        "share_of_stack_samples": round(s.share, 3),
        "peer_share_of_stack_samples": round(s.peer_share, 3),
    }


CPU_WAIT = "(threads waiting for a CPU)"


def wait_evidence(c: contention.Contended) -> dict[str, Any]:
    return {
        "cpu_wait_ms_per_step": ms(c.wait_us),
        "peer_cpu_wait_ms_per_step": ms(c.peer_wait_us),
        "wait_ratio": round(c.ratio, 3),
        "step_ms": ms(c.step_us),
        f"{'windows' if c.measured == 'windows' else 'chunks'}_flagged": f"{c.windows_flagged}/{c.windows}",
    }
