"""What a straggler's extra time is: its cause, the function that holds it, and the evidence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import contention, functions, stragglers
from .findings import Cause, ms


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
slower, for a slower device; else a function of the job's code the stack samples found it in."""
WORKING = 0.25
"""A rank whose CPU time grew by this share of its excess works more (a slower device); one whose
CPU time grew less, and whose kernels did not hold it, sleeps or blocks (a code path)."""
UNATTRIBUTED = "(unattributed: no profiled operator or function, and no stack sample, holds it)"
ACROSS_OPERATORS = "(across its operators: none holds half)"
GARBAGE_COLLECTION = "(Python garbage collection)"
"""Collections that stop the rank longer than its peers', in no function the windows or stack
samples caught."""
"""A slower device's excess, spread over the operators it runs as often as its peers."""


def classify(
    st: stragglers.Straggler,
    excess: list[functions.FunctionExcess],
    waits: contention.Contended | None,
    sampled: functions.Sampled | None = None,
) -> Attribution:
    """Cause, function and evidence of one straggler's extra time; ``sampled``: where its stack
    samples put it beyond its peers, for time no window caught."""
    total = max(st.excess_us, 1.0)
    # Starved: the rank got a smaller share of the CPU for its own time than its peers. (A rank with
    # more work queues longer on a busy host too, behind its own threads, at the same share.) Own
    # time is less the main thread's run-queue wait already where the hook measured it (wire v3);
    # this is for the rest: its other threads' wait that it waited on, and older hooks' data.
    # Time waiting for data is no time the thread wanted a CPU: a rank whose reads sleep 15 ms a
    # batch uses the CPU for 40% of its own time, and is not starved.
    own_eff = st.cpu_us / max(st.own_us - st.data_us, 1.0)
    peer_eff = st.peer_cpu_us / max(st.peer_own_us - st.peer_data_us, 1.0)
    starved = own_eff <= 0.8 * peer_eff
    extra = functions.top_extra(excess)
    work = functions.work_excess(excess)
    # A code path the culprit alone runs: it holds a third of the excess, or, where the windows
    # caught fewer of its (rare) calls than the steps paid for, a tenth and at least twice the
    # excess of all the operators that got slower (a garbage collection every 5 steps: 24% of the
    # excess in 4 windows, with no operator slower).
    if extra is not None and (
        not (
            extra.excess_us >= 0.3 * total or (extra.excess_us >= 0.1 * total and extra.excess_us >= 2 * work)
        )
        or functions.stray_builtin(excess, extra)
    ):
        extra = None
    waited = waits.wait_us - waits.peer_wait_us if waits is not None else 0.0
    # Of a starved rank that also runs a code path of its own, the larger account: a rank whose
    # metrics upload sleeps 15 ms a step uses the CPU for under half its own time, and its threads
    # wait ~9.5 ms a step longer than its peers' (the others run meanwhile), the upload ~15.5. The
    # wait is summed over the rank's threads, the code path's time is the training thread's: a
    # code path that holds half the excess explains it as it would name it (a gradient audit of
    # 8.9 ms a step, 1.4x the excess, on 8 ranks sharing 2 cores, made its threads wait 78 ms a
    # step longer: work queues for a CPU).
    ev: dict[str, Any]
    if (
        starved
        and waits is not None
        and waited >= 0.5 * total
        and not (extra and extra.excess_us > min(waited, ATTRIBUTED * total))
    ):
        ev = {
            **wait_evidence(waits),
            "cpu_share_of_own_time_less_data_wait": round(own_eff, 3),
            "peer_cpu_share_of_own_time_less_data_wait": round(peer_eff, 3),
        }
        return Attribution("host_contention", CPU_WAIT, 1.0, waited / total, ev)
    # The time a sampled function holds beyond the peers' share of it: that share of the rank's steps.
    sampled_us = sampled.excess * (st.own_us + st.comm_us) if sampled is not None else 0.0
    data_excess = st.data_us - st.peer_data_us
    if data_excess >= 0.5 * total:
        fn = functions.top_of_kind(excess, "dataloader")
        loader = fn.name if fn else "DataLoader.__next__"
        ev = {"data_wait_ms": ms(st.data_us), "peer_data_wait_ms": ms(st.peer_data_us)}
        share = data_excess / total
        code = functions.innermost_code(excess, 0.3 * data_excess)  # a window sees most fetches, not all
        if code is not None:
            ev = {**ev, **code_evidence(code), "loader": loader}
            return Attribution("dataloader", code.name, share, code.excess_us / total, ev)
        if sampled is not None:
            ev = {**ev, **sampled_evidence(sampled), "loader": loader}
            return Attribution("dataloader", sampled.name, share, sampled_us / total, ev)
        return Attribution("dataloader", loader, share, share, ev)
    collected = st.gc_us - st.peer_gc_us
    if collected >= ATTRIBUTED * total and not (extra and extra.excess_us > collected):
        # The garbage collector stops it longer than its peers (the hook times every collection):
        # a clean-up the job's code calls, or more objects to traverse. Where the windows or the
        # stack samples caught the function its collections run in, that function.
        ev = {"gc_ms_per_step": ms(st.gc_us), "peer_gc_ms_per_step": ms(st.peer_gc_us)}
        share = collected / total
        code = functions.innermost_code(excess, 0.3 * collected)  # a window sees some collections
        if code is not None:
            return Attribution(
                "code_path", code.name, share, code.excess_us / total, {**ev, **code_evidence(code)}
            )
        if sampled is not None and sampled_us >= ATTRIBUTED * collected:
            ev = {**ev, **sampled_evidence(sampled)}
            return Attribution("code_path", sampled.name, share, sampled_us / total, ev)
        return Attribution("code_path", GARBAGE_COLLECTION, share, share, ev)
    if extra is not None:
        code = functions.innermost_code(excess, 0.5 * extra.excess_us)
        counts = {
            "calls_per_step": round(extra.rank_count, 2),
            "peer_calls_per_step": round(extra.peer_count, 2),
        }
        if code is None and extra.kind not in functions.PYTHON_KINDS and sampled is not None:
            # Windows without Python stacks saw an operator only the culprit runs; the function of
            # its code that calls it is where its stack samples put it beyond its peers.
            ev = {**sampled_evidence(sampled), "operator": extra.name, **counts}
            return Attribution("code_path", sampled.name, extra.excess_us / total, sampled_us / total, ev)
        code = code or extra
        ev = {**code_evidence(code), **counts}
        if code is not extra:
            ev["entered_through"] = extra.name
        op = functions.top_of_kinds(excess, functions.WORK_KINDS)
        if op is not None:
            ev["operator"] = op.name
        share = extra.excess_us / total
        return Attribution("code_path", code.name, share, code.excess_us / total, ev)
    slower = functions.top_slower(excess)
    slow_code = functions.innermost_code(excess, 0.5 * total)
    if slow_code is not None and work < 0.5 * slow_code.excess_us:
        # The job's own function takes longer on this rank, but not in operators: it blocks or
        # waits (a synchronous upload, a lock, I/O). A slower device slows the operators under it.
        ev = {**code_evidence(slow_code), "calls_per_step": round(slow_code.rank_count, 2)}
        share = slow_code.excess_us / total
        return Attribution("code_path", slow_code.name, share, share, ev)
    if starved and st.nivcsw >= 2 * st.peer_nivcsw + 5:
        ev = {
            "involuntary_switches_per_step": st.nivcsw,
            "peer_involuntary_switches_per_step": st.peer_nivcsw,
            "cpu_share_of_own_time_less_data_wait": round(own_eff, 3),
            "peer_cpu_share_of_own_time_less_data_wait": round(peer_eff, 3),
        }
        return Attribution("host_contention", "(whole process)", 1.0, 1.0, ev)
    ev = {}
    if slower is not None:
        ev = {
            "operator_ms_per_step": ms(slower.rank_us),
            "operator_peer_ms_per_step": ms(slower.peer_us),
            "operator_ratio": round(slower.rank_us / max(slower.peer_us, 1e-9), 3),
            "calls_per_step": round(slower.rank_count, 2),
        }
        if slower.kind in functions.DEVICE_KINDS and slower.stack:
            ev["launched_by"] = slower.stack  # the operator a GPU kernel or copy was launched in
    compute_excess = (st.own_us - st.data_us) - (st.peer_own_us - st.peer_data_us)
    cpu_excess = st.cpu_us - st.peer_cpu_us
    # Work is CPU time on the training thread, or a device's: its kernels and copies. A rank whose
    # own time grew with neither sleeps or blocks, outside any operator: a rank that sleeps in its
    # loop keeps its CPU time, while its operators, nested in each other and slowed on the shared
    # cores while it sleeps and its peers run, can add up to more than its peers'. A slower
    # device's CPU time grows by a good part of its excess (~35%, even with the run-queue wait
    # still in own time, as older hooks record it). (Records without CPU time tell nothing.)
    working = (
        (st.cpu_us <= 0 and st.peer_cpu_us <= 0)
        or cpu_excess >= WORKING * compute_excess
        or functions.work_excess(excess, functions.DEVICE_KINDS) >= ATTRIBUTED * compute_excess
    )
    if not working or work < ATTRIBUTED * compute_excess:
        # Not working, or working outside the operators (they do not hold the time): a code path,
        # where its stack samples put it, a line of a loop at module level included. Not working,
        # all its excess is the code path's, whatever share of it the samples name.
        share = compute_excess / total if not working else sampled_us / total
        if sampled is not None and sampled_us >= ATTRIBUTED * total:
            ev = {**sampled_evidence(sampled), **ev}
            return Attribution("code_path", sampled.name, share, sampled_us / total, ev)
        if not working:
            ev = {**ev, "cpu_ms_per_step": ms(st.cpu_us), "peer_cpu_ms_per_step": ms(st.peer_cpu_us)}
            return Attribution("code_path", UNATTRIBUTED, compute_excess / total, 0.0, ev)
    # What it names must hold half of the excess: the job's own function whose operators got slower
    # (the innermost), else one operator, else the function of its code the stack samples put it in.
    # A slower device slows every operator, forward and backward, and none may hold half (its
    # forward a third, ``aten::mm`` 45% on a device 2x slower): then the finding names its
    # operators as a whole, the largest of them in the evidence.
    held = ATTRIBUTED * compute_excess
    share = compute_excess / total
    if slower is not None and (code := functions.innermost_code(excess, held)) is not None:
        ev = {**ev, **code_evidence(code), "operator": slower.name}  # the function, and the operator
        return Attribution("compute", code.name, share, code.excess_us / total, ev)
    if slower is not None and slower.excess_us >= held:
        return Attribution("compute", slower.name, share, slower.excess_us / total, ev)
    if sampled is not None and sampled_us >= held:
        return Attribution(
            "compute", sampled.name, share, sampled_us / total, {**sampled_evidence(sampled), **ev}
        )
    if slower is None:
        return Attribution("compute", UNATTRIBUTED, share, 0.0, ev)
    ev["largest"] = {e.name: round(e.excess_us / total, 3) for e in functions.largest(excess, 3)}
    return Attribution("compute", ACROSS_OPERATORS, share, slower.excess_us / total, ev)


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
