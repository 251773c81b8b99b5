"""A straggler named from the heartbeats' stack samples where no window caught its function: stalls
between windows, loops at module level, stalls since mid-span; on hand-built jobs."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from rankscope.diagnosis import diagnose
from rankscope.diagnosis.detectors.straggler.cause import UNATTRIBUTED
from rankscope.wire.records import sample_key
from tests.jobdata import functions_frame, only, samples_frame, synthetic

T0_US = 1_700_000_000_000_000


def test_a_stall_no_window_caught_is_named_by_the_function_the_stack_samples_found_the_rank_in() -> None:
    """Windows profile 5 steps now and then: a read stalling one batch in 20 can fall between them
    all. The heartbeats' stack samples (every 0.5 s) still put the rank in it."""
    data = synthetic(slow={2: {"data_us": 2000}})
    read, loop = "data.py(41): read_from_storage", "train.py(10): train"

    def samples(stalled: float) -> pd.DataFrame:
        rows = [(r, loop, 60) for r in range(8)] + [(r, "", 4) for r in range(8)]
        rows += [(r, read, 2) for r in range(8) if r != 2] + [(2, read, round(60 * stalled))]
        return pd.DataFrame(rows, columns=["rank", "function", "samples"])

    f = only(diagnose(replace(data, samples=samples(0.5))).findings)
    assert (f.cause, f.ranks, f.function) == ("dataloader", [2], read)
    assert (
        f.evidence["stack_samples_in_function"] == "30/94"
        and f.evidence["peer_share_of_stack_samples"] < 0.05
    )
    # A few samples more than the peers' is noise: the loader is named, as without samples.
    f = only(diagnose(replace(data, samples=samples(0.1))).findings)
    assert (f.cause, f.ranks) == ("dataloader", [2]) and f.function != read
    assert f.function == only(diagnose(data).findings).function


def test_a_stall_in_a_loop_at_module_level_is_named_by_its_line_not_by_a_slightly_slower_operator() -> None:
    """nanoGPT's loop runs at module level: there every rank's samples fall in ``<module>``, the
    culprit's sleep and its peers' wait in the backward pass for it alike. Its lines tell them
    apart. The operator that ran a little slower on the culprit's shared core holds a tenth of
    its extra time: no compute finding."""
    # Rank 2 sleeps 2 ms a step: its own time grows, its CPU time does not.
    data = synthetic(slow={2: {"compute_us": 2000, "cpu": 5000 / 7000}})
    ops = [("op", "DistributedDataParallel.forward", 5, 9_000.0), ("op", "aten::addmm", 40, 6_000.0)]
    slower = [("op", "DistributedDataParallel.forward", 5, 10_000.0), ("op", "aten::addmm", 40, 6_100.0)]
    data = replace(data, functions=functions_frame({r: slower if r == 2 else ops for r in range(8)}))
    module = "train.py(1): <module>"
    samples = samples_frame(
        {r: {sample_key(module, 70): 6, sample_key(module, 71): 2, "": 2} for r in range(8) if r != 2}
        | {2: {sample_key(module, 70): 3, sample_key(module, 68): 4, sample_key(module, 71): 1, "": 2}}
    )
    f = only(diagnose(replace(data, samples=samples)).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [2], "train.py(68): <module>")
    assert f.evidence["stack_samples_in_function"] == "4/10"
    assert f.evidence["function_share"] >= 0.5 and "of the extra time in train.py(68)" in f.summary
    # Without the samples no function holds it, and the CPU time did not grow: it is unattributed,
    # a code path (sleeping or blocked), never compute in the operator.
    f = only(diagnose(data).findings)
    assert (f.cause, f.function, f.evidence["function_share"]) == ("code_path", UNATTRIBUTED, 0.0)
    assert "no stack sample" in f.summary
    # Its operators slowed on the shared cores while it slept may sum to half its excess (they
    # nest): with its CPU time flat, it still did no more work.
    slowed = [("op", "DistributedDataParallel.forward", 5, 15_000.0), ("op", "aten::addmm", 40, 6_100.0)]
    data = replace(data, functions=functions_frame({r: slowed if r == 2 else ops for r in range(8)}))
    f = only(diagnose(replace(data, samples=samples)).findings)
    assert (f.cause, f.function) == ("code_path", "train.py(68): <module>")
    # The peers' samples found them in the model's forward now and then, the culprit's always in
    # the loop: ``<module>`` holds more of its samples (1.0 against 0.8), but it holds most of the
    # peers' too: the line is what tells (a CI run of nanogpt_like.py, 29 of 44 samples at the sleep).
    forward = sample_key("model.py(10): forward", 12)
    samples = samples_frame(
        {r: {sample_key(module, 70): 8, forward: 2} for r in range(8) if r != 2}
        | {2: {sample_key(module, 70): 3, sample_key(module, 68): 6, sample_key(module, 71): 1}}
    )
    f = only(diagnose(replace(data, samples=samples)).findings)
    assert (f.cause, f.function) == ("code_path", "train.py(68): <module>")
    # A model's forward the culprit was found in a few more times than its peers (5 of its 47
    # samples, none of theirs) stands out less than the sleep's line does (21 of 47): the line is
    # named, not the forward, which holds too little of the extra time to be (a CI run of
    # nanogpt_like.py).
    samples = samples_frame(
        {r: {sample_key(module, 70): 45, sample_key(module, 71): 4} for r in range(8) if r != 2}
        | {
            2: {
                sample_key(module, 68): 21,
                sample_key(module, 70): 17,
                sample_key("model.py(10): forward", 12): 5,
            }
        }
    )
    f = only(diagnose(replace(data, samples=samples)).findings)
    assert (f.cause, f.function) == ("code_path", "train.py(68): <module>")


def test_a_stall_no_window_saw_at_all_is_named_from_the_samples_of_the_function_it_is_in() -> None:
    """Windows lost (a release whose events the hook cannot read, a GPU whose windows failed): a
    callback sleeping on one rank is named from its heartbeats' samples, by its function."""
    data = synthetic(slow={5: {"compute_us": 2000, "cpu": 5000 / 7000}})
    loop, callback = "trainer.py(2200): _inner_training_loop", "train.py(30): on_step_end"
    samples = samples_frame(
        {r: {sample_key(loop, 2300): 16, sample_key(callback, 31): 0} for r in range(8) if r != 5}
        | {5: {sample_key(loop, 2300): 10, sample_key(callback, 31): 6, sample_key(callback, 33): 2}}
    )
    f = only(diagnose(replace(data, samples=samples)).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [5], callback)
    assert f.evidence["stack_samples_in_function"] == "8/18" and f.evidence["line"] == 31
    # A device that got slower adds CPU time: compute, though nothing names where.
    f = only(diagnose(synthetic(slow={5: {"compute_us": 2000}})).findings)
    assert (f.cause, f.function) == ("compute", UNATTRIBUTED)


def test_work_no_window_saw_is_a_slower_device_in_what_its_peers_run_and_a_code_path_in_what_they_do_not() -> (
    None
):
    """No window saw rank 5's operators (none ran yet, or none could). Its CPU time grew with its
    extra time: it works. Its stack samples find it in the model's forward beyond its peers, who
    are found there too: every rank runs it, slower on this one, a slower device's (the fault
    suite's 2x and 3x devices without windows: 16% and 29% of their samples, 4% of their peers').
    Found in a function its peers never are, it is a code path it runs and they do not."""
    data = synthetic(slow={5: {"compute_us": 2000}})
    loop = "train.py(50): train"

    def samples(function: str, peers: int) -> pd.DataFrame:
        return samples_frame(
            {
                r: {sample_key(loop, 60): 20 - peers, sample_key(function, 12): peers}
                for r in range(8)
                if r != 5
            }
            | {5: {sample_key(loop, 60): 10, sample_key(function, 12): 10}}
        )

    forward = "model.py(10): forward"
    f = only(diagnose(replace(data, samples=samples(forward, 2))).findings)
    assert (f.cause, f.ranks, f.function) == ("compute", [5], forward)
    assert f.evidence["profiled_windows"] == 0 and f.evidence["peer_share_of_stack_samples"] == 0.1
    audit = "train.py(30): audit_gradients"
    f = only(diagnose(replace(data, samples=samples(audit, 0))).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [5], audit)
    # Its samples at a line of the forward that none of its peers' are at (they wait elsewhere)
    # stand out more than the forward does: still a function they run.
    line = samples_frame(
        {r: {sample_key(loop, 60): 18, sample_key(forward, 12): 2} for r in range(8) if r != 5}
        | {5: {sample_key(loop, 60): 14, sample_key(forward, 12): 2, sample_key(forward, 15): 4}}
    )
    f = only(diagnose(replace(data, samples=line)).findings)
    assert (f.cause, f.ranks, f.function) == ("compute", [5], "model.py(15): forward")


def test_a_stall_that_began_within_the_span_is_named_from_the_samples_since_it_began() -> None:
    """Rank 5's callback starts sleeping halfway through the span read: over the whole span it
    holds a twentieth of the rank's samples, too few to name it; since the change, half. A store's
    data reads the samples since the step the straggler began at."""
    data = synthetic(slow={5: {"compute_us": 2000, "cpu": 5000 / 7000, "from": 150}})
    data = replace(data, steps=data.steps.assign(start_us=T0_US + 50_000 * data.steps["step"]))  # 15 s
    loop, callback = "trainer.py(2200): _inner_training_loop", "train.py(30): on_step_end"
    peers = {r: {sample_key(loop, 2300): 16} for r in range(8) if r != 5}
    whole = samples_frame(peers | {5: {sample_key(loop, 2300): 19, sample_key(callback, 31): 1}})
    since = samples_frame(peers | {5: {sample_key(loop, 2300): 8, sample_key(callback, 31): 8}})
    f = only(diagnose(replace(data, samples=whole)).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [5], UNATTRIBUTED)
    asked: list[int] = []
    f = only(diagnose(replace(data, samples=whole, read_samples=lambda t: asked.append(t) or since)).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [5], callback)
    began = data.steps.query(f"rank == 5 and step >= {f.evidence['held_since_step']}")["start_us"].min()
    assert asked == [began] and f.evidence["held_since_step"] >= 150
