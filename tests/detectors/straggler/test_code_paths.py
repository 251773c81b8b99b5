"""Which function of the job's code a straggler's extra time went to (cause code_path): the windows'
functions and operators, on hand-built jobs."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd

from rankscope.diagnosis import diagnose
from rankscope.wire.records import sample_key
from tests.jobdata import functions_frame, only, samples_frame, synthetic


def test_code_path_straggler_names_the_extra_function() -> None:
    data = synthetic(slow={6: {"compute_us": 1500}})
    common = [("op", "aten::addmm", 15, 10_000.0), ("python", "train.py(10): forward", 5, 20_000.0)]
    extra = [
        *common,
        ("python", "train.py(50): audit_gradients", 5, 7_500.0),
        ("op", "aten::norm", 100, 6000.0),
    ]
    data = replace(data, functions=functions_frame({r: extra if r == 6 else common for r in range(8)}))
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [6], "train.py(50): audit_gradients")
    assert f.evidence["calls_per_step"] == 1.0 and f.evidence["peer_calls_per_step"] == 0.0


def test_a_code_path_windows_saw_as_an_operator_only_is_named_by_the_function_its_samples_found() -> None:
    """Windows without Python stacks (the budget had no room for them) see the operator only the
    culprit runs; its stack samples put it in the function of its code that calls it."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    common = [("op", "aten::addmm", 15, 10_000.0)]
    extra = [*common, ("op", "aten::norm", 100, 6000.0)]
    data = replace(data, functions=functions_frame({r: extra if r == 6 else common for r in range(8)}))
    step, audit = "train.py(10): train_step", "train.py(50): audit_gradients"
    samples = samples_frame(
        {r: {sample_key(step, 12): 20} for r in range(8) if r != 6}
        | {6: {sample_key(step, 12): 12, sample_key(audit, 52): 8}}
    )
    f = only(diagnose(replace(data, samples=samples)).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [6], audit)
    assert f.evidence["operator"] == "aten::norm" and f.evidence["stack_samples_in_function"] == "8/20"
    # Without samples the operator is all there is to name.
    assert only(diagnose(data).findings).function == "aten::norm"


def test_a_function_only_the_culprit_calls_every_few_steps_is_its_code_path() -> None:
    """A clean-up every 5 steps (a forced garbage collection): once in the 5-step window, less than
    once a step, and never on the peers. A different code path, not a slower device."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    common = [("op", "aten::addmm", 15, 10_000.0), ("python", "train.py(10): forward", 5, 20_000.0)]
    extra = [
        *common,
        ("python", "train.py(70): free_memory", 1, 7_400.0),
        ("pylib", "gc.collect", 1, 7_350.0),
    ]
    data = replace(data, functions=functions_frame({r: extra if r == 6 else common for r in range(8)}))
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [6], "train.py(70): free_memory")
    assert f.evidence["calls_per_step"] == 0.2 and f.evidence["peer_calls_per_step"] == 0.0


def test_a_code_path_taken_since_mid_run_is_judged_on_the_windows_that_caught_the_rank_slow() -> None:
    """Rank 6 audits its gradients from step 150 on: in the window before (steps 100-105) it ran
    what its peers ran; in the two after, the audit too. The function comparison is over the two
    (the first would halve the audit's calls per step, and one window of three is no code path);
    and one slow call in one window of them is no code path either."""
    data = synthetic(slow={6: {"compute_us": 1500, "from": 150}})
    common = [("op", "aten::addmm", 15, 10_000.0), ("python", "train.py(10): forward", 5, 20_000.0)]
    audit = [*common, ("python", "train.py(50): audit_gradients", 5, 7_500.0)]
    windows = []
    for w, lo in ((0, 100), (1, 200), (2, 250)):
        frame = functions_frame({r: audit if r == 6 and w > 0 else common for r in range(8)})
        windows.append(frame.assign(window=w, step_lo=lo, step_hi=lo + 5))
    f = only(diagnose(replace(data, functions=pd.concat(windows))).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [6], "train.py(50): audit_gradients")
    assert f.evidence["calls_per_step"] == 1.0
    # A function only the culprit ran, but in one window of two: a preempted call, not a path.
    once = functions_frame(
        {r: [*common, ("pylib", "hasattr", 1, 7_000.0)] if r == 6 else common for r in range(8)}
    )
    again = functions_frame({r: common for r in range(8)}).assign(window=1, step_lo=200, step_hi=205)
    f = only(
        diagnose(
            replace(synthetic(slow={6: {"compute_us": 1500}}), functions=pd.concat([once, again]))
        ).findings
    )
    assert f.cause == "compute"


def test_python_functions_are_judged_on_the_windows_with_stacks_operators_on_all() -> None:
    """Periodic windows record operators only (``profiler_hook.schedule``): a code path in the one
    window with stacks is not diluted by two without, nor is a Python function seen in one window
    of one taken for a preempted call."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    ops = [("op", "aten::addmm", 15, 10_000.0)]
    common = [*ops, ("python", "train.py(10): forward", 5, 20_000.0)]
    audit = [*common, ("python", "train.py(50): audit_gradients", 5, 7_500.0)]
    windows = [functions_frame({r: audit if r == 6 else common for r in range(8)})]
    for w, lo in ((1, 200), (2, 250)):
        frame = functions_frame(
            {r: [*ops, ("op", "aten::norm", 100, 6000.0)] if r == 6 else ops for r in range(8)}
        )
        windows.append(frame.assign(window=w, step_lo=lo, step_hi=lo + 5))
    f = only(diagnose(replace(data, functions=pd.concat(windows))).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [6], "train.py(50): audit_gradients")
    assert f.evidence["calls_per_step"] == 1.0 and f.evidence["peer_calls_per_step"] == 0.0


def test_a_code_path_found_at_a_change_is_judged_on_the_windows_since_though_one_before_was_slow() -> None:
    """Rank 2 (0.96x its peers: its cores) audits its gradients from step 700: found by the change-
    point rule. A window at step 600 caught it slow by chance (a preempted forward), before the
    audit began; the one at step 1000 holds the audit, and it is what names the cause."""
    bias = {0: 1.06, 1: 0.97, 2: 0.96, 3: 1.02}
    data = synthetic(ranks=4, steps=1400, hosts_of=2, bias=bias, slow={2: {"compute_us": 750, "from": 700}})
    steps = data.steps.copy()
    steps.loc[(steps["rank"] == 2) & steps["step"].between(600, 604), "dur_us"] += 3000.0
    common = [("op", "aten::addmm", 15, 10_000.0), ("python", "train.py(10): forward", 5, 20_000.0)]
    preempted = [("op", "aten::addmm", 15, 10_000.0), ("python", "train.py(10): forward", 5, 35_000.0)]
    audit = [*common, ("python", "train.py(50): audit_gradients", 5, 3_750.0)]
    before = functions_frame({r: preempted if r == 2 else common for r in range(4)})
    after = functions_frame({r: audit if r == 2 else common for r in range(4)})
    windows = pd.concat(
        [
            before.assign(window=0, step_lo=600, step_hi=605),
            after.assign(window=1, step_lo=1000, step_hi=1005),
        ]
    )
    f = only(diagnose(replace(data, steps=steps, functions=windows)).findings)
    assert f.evidence["held_since_step"] > 605
    assert (f.cause, f.ranks, f.function) == ("code_path", [2], "train.py(50): audit_gradients")


def test_a_built_in_that_no_code_path_holds_is_where_a_slower_rank_lost_the_cpu_not_a_path() -> None:
    """Rank 6's device is slower; in its window a ``getattr`` under a torch wrapper that every rank
    runs took 0.66 ms a step, and ~0 on the peers (the thread lost the CPU or the GIL there). No
    caller of it runs only on rank 6 and none of the job's own code holds it: its operators are
    the account. Under a function of the job's own that only rank 6 runs, it is that code path."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    wrapper = ("pylib", "torch/_compile.py(42): inner", 5, 600.0, "train.py(80): train_step")
    common = [("op", "aten::addmm", 15, 10_000.0), wrapper]
    getattr_ = (
        "pylib",
        "<built-in function getattr>",
        5,
        3_300.0,
        "train.py(80): train_step > torch/_compile.py(42): inner",
    )
    slow = [("op", "aten::addmm", 15, 17_000.0), (*wrapper[:3], 3_900.0, wrapper[4]), getattr_]
    f = only(
        diagnose(
            replace(data, functions=functions_frame({r: slow if r == 6 else common for r in range(8)}))
        ).findings
    )
    assert (f.cause, f.ranks, f.function) == ("compute", [6], "aten::addmm")
    check = ("python", "train.py(60): check_grads", 5, 3_400.0, "train.py(80): train_step")
    under = (
        "pylib",
        "<built-in function getattr>",
        5,
        3_300.0,
        "train.py(80): train_step > train.py(60): check_grads",
    )
    path = [*common, check, under]
    f = only(
        diagnose(
            replace(data, functions=functions_frame({r: path if r == 6 else common for r in range(8)}))
        ).findings
    )
    assert (f.cause, f.ranks, f.function) == ("code_path", [6], "train.py(60): check_grads")


def test_what_the_profiler_calls_as_its_window_starts_or_stops_is_no_code_path() -> None:
    """Rank 6's device is slower; its one window caught the profiler reading the process group's
    size as it stopped, 4 ms (the thread lost the CPU there), a call its peers' windows did not
    catch. That is the window's own work, not a path of the job's: its operators are the account."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    common = [("op", "aten::addmm", 15, 10_000.0)]
    stop = "train.py(80): train_step > torch/profiler/profiler.py(1262): _transit_action"
    size = ("pylib", "torch/distributed/distributed_c10d.py(1191): _get_group_size", 1, 4_000.0, stop)
    slow = [("op", "aten::addmm", 15, 17_000.0), size]
    f = only(
        diagnose(
            replace(data, functions=functions_frame({r: slow if r == 6 else common for r in range(8)}))
        ).findings
    )
    assert (f.cause, f.ranks, f.function) == ("compute", [6], "aten::addmm")


def test_a_function_the_peers_windows_left_out_may_have_run_there_and_makes_no_code_path() -> None:
    """Rank 6's device is slower. In its window a context manager's ``__exit__`` that every rank
    runs once a step took 2.4 ms (one call preempted; the median call 2 µs); the peers' windows, at
    their ``max_functions``, left it out with the rest of their smallest functions (the largest
    left out: 12 µs). It may have run there: the account is the slower device under the job's
    forward. (A CI run called such a 2x slower device a code path through its forward.) Where the
    peers' windows left nothing out, they did not run it, but its median call still holds next to
    none of the excess: no code path either. Where its calls take more than the peers' windows
    could have left out, it is rank 6's own code path."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    forward = ("python", "train.py(10): forward", 5, 20_000.0)
    exit_ = ("pylib", "contextlib.py(141): __exit__", 5, 2_400.0, "train.py(10): forward")
    cut = ("cut", "left_out@window", 40, 90.0)
    slow = [("op", "aten::addmm", 15, 17_000.0), (*forward[:3], 27_000.0), exit_, cut]
    common = [("op", "aten::addmm", 15, 10_000.0), forward]

    def frame(peers_cut: bool, median_call_us: float) -> pd.DataFrame:
        f = functions_frame(
            {r: slow if r == 6 else [*common, cut] if peers_cut else common for r in range(8)}
        )
        f.loc[f["kind"] == "cut", "max_us"] = 12.0
        f.loc[f["name"] == exit_[1], ["p50_us", "max_us"]] = [median_call_us, 2_400.0 - 4 * median_call_us]
        return f

    for peers_cut, median_call_us, expected in (
        (True, 2.0, "compute"),
        (False, 2.0, "compute"),
        (True, 480.0, "code_path"),
        (False, 480.0, "code_path"),
    ):
        f = only(diagnose(replace(data, functions=frame(peers_cut, median_call_us))).findings)
        assert (f.cause, f.ranks, f.function) == (expected, [6], "train.py(10): forward"), (
            peers_cut,
            median_call_us,
        )


def test_an_operator_only_the_culprit_runs_whose_time_is_one_preempted_call_is_no_code_path() -> None:
    """Rank 6's device is slower, and the fault that makes it so pads its batch: an ``aten::index``
    its peers never run, 22 µs a call, but one of its 3 calls in the one window lost the CPU for
    4.2 ms (a demo run in CI called the slower device a code path through it). Without that one
    call it holds next to none of the excess: the account is the slower device's operators. Where
    every call takes that long, it is a path of its own; so it is where its calls differ in size,
    the median far below the mean, none of them holding the time (a gradient audit's
    ``aten::abs`` over weights and biases: 96 calls, 3.5 µs at the median, 18 µs on average, the
    longest 267 µs)."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    common = [("op", "aten::addmm", 15, 10_000.0)]
    index = ("op", "aten::index", 3, 4_268.0)
    slow = [("op", "aten::addmm", 15, 17_000.0), index]

    def frame(op: tuple, median_call_us: float, longest_call_us: float) -> pd.DataFrame:
        f = functions_frame({r: [slow[0], op] if r == 6 else common for r in range(8)})
        f.loc[f["name"] == op[1], ["p50_us", "max_us"]] = [median_call_us, longest_call_us]
        return f

    audit = ("op", "aten::abs", 480, 8_736.0)
    for op, median_call_us, longest_call_us, expected in (
        (index, 22.7, 4_230.0, ("compute", "aten::addmm")),
        (index, 1_423.0, 1_423.0, ("code_path", "aten::index")),
        (audit, 3.5, 267.0, ("code_path", "aten::abs")),
    ):
        f = only(diagnose(replace(data, functions=frame(op, median_call_us, longest_call_us))).findings)
        assert (f.cause, f.function) == expected, (op, median_call_us)


def test_a_slower_devices_operator_is_one_its_calls_are_slower_in_not_one_a_preempted_call_holds() -> None:
    """Rank 6's device is slower: its ``aten::addmm`` calls take 1.7x its peers'. In its window two
    of the optimizer's 28 ``aten::sqrt`` calls (10 µs at the median, as on the peers) lost the CPU
    for milliseconds: more time than the slower matmuls' excess. The slower operator is the one
    whose calls got slower."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    common = [("op", "aten::addmm", 15, 10_000.0), ("op", "aten::sqrt", 140, 1_400.0)]
    slow = [("op", "aten::addmm", 15, 17_000.0), ("op", "aten::sqrt", 140, 14_400.0)]
    f = functions_frame({r: slow if r == 6 else common for r in range(8)})
    f.loc[f["name"] == "aten::sqrt", "p50_us"] = 10.0
    found = only(diagnose(replace(data, functions=f)).findings)
    assert (found.cause, found.function) == ("compute", "aten::addmm")


def test_code_path_names_the_innermost_function_of_the_jobs_own_code_and_the_operator_under_it() -> None:
    data = synthetic(slow={6: {"compute_us": 1500}})
    common = [("op", "aten::addmm", 15, 10_000.0), ("python", "train.py(80): train_step", 5, 20_000.0)]
    step, log = "train.py(80): train_step", "train.py(40): log_metrics"
    extra = [
        ("op", "aten::addmm", 15, 10_000.0),
        ("python", step, 5, 29_000.0),
        ("python", log, 5, 9_000.0, step),
        ("python", "metrics.py(12): upload", 5, 8_800.0, f"{step} > {log}"),
        ("pylib", "enum.py(686): __call__", 500, 8_000.0, f"{step} > {log} > metrics.py(12): upload"),
        ("op", "aten::copy_", 500, 600.0),
    ]
    data = replace(data, functions=functions_frame({r: extra if r == 6 else common for r in range(8)}))
    f = only(diagnose(data).findings)
    # Not the library frame that holds the time (enum), nor the callers that merely contain it.
    assert (f.cause, f.ranks, f.function) == ("code_path", [6], "metrics.py(12): upload")
    assert f.evidence["stack"] == f"{step} > {log}"
    assert f.evidence["operator"] == "aten::copy_"
    assert f.evidence["entered_through"] == log


def test_a_function_that_blocks_on_one_rank_is_a_code_path_not_a_slower_device() -> None:
    data = synthetic(slow={3: {"compute_us": 1500}})
    up = "train.py(40): upload_metrics"
    peers = [("op", "aten::addmm", 15, 10_000.0), ("python", up, 5, 500.0, "train.py(80): train_step")]
    slow = [
        ("op", "aten::addmm", 15, 10_100.0),
        ("python", up, 5, 8_000.0, "train.py(80): train_step"),
        ("pylib", "<built-in function sleep>", 5, 7_400.0, f"train.py(80): train_step > {up}"),
    ]
    data = replace(data, functions=functions_frame({r: slow if r == 3 else peers for r in range(8)}))
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [3], up)


def test_a_frame_that_waits_in_a_collective_is_not_where_the_work_is() -> None:
    data = synthetic(slow={6: {"compute_us": 1500}})
    sync, fwd = "train.py(60): sync_flags", "train.py(88): forward"
    c10d = ("pylib", "torch/distributed/distributed_c10d.py(2950): all_reduce", 5, 500.0, sync)
    peers = [
        ("op", "aten::addmm", 15, 10_000.0),
        ("python", fwd, 5, 12_000.0),
        ("python", sync, 5, 600.0),
        c10d,
    ]
    slow = [
        ("op", "aten::addmm", 15, 20_000.0),
        ("python", fwd, 5, 19_000.0),
        ("python", sync, 5, 9_000.0),  # it waited longer in this step's all-reduce, as it happened
        (*c10d[:3], 8_800.0, sync),
    ]
    data = replace(data, functions=functions_frame({r: slow if r == 6 else peers for r in range(8)}))
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("compute", [6], fwd)
    assert f.evidence["operator"] == "aten::addmm"
    # torch.distributed's other functions wait for nobody: a forward that asks the world size (to
    # shard or pad its batch) is still where the work is.
    size = ("pylib", "torch/distributed/distributed_c10d.py(2579): get_world_size", 5, 5.0, fwd)
    data = replace(
        data, functions=functions_frame({r: [*(slow if r == 6 else peers), size] for r in range(8)})
    )
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("compute", [6], fwd)
