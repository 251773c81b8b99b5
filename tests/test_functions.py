"""Which function a straggler's extra time went to: the windows' functions and operators, the
stack samples, on synthetic jobs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from rankscope.diagnosis import JobData, diagnose
from rankscope.diagnosis.detectors.straggler.cause import ACROSS_OPERATORS, UNATTRIBUTED
from rankscope.wire.records import sample_key
from tests.jobdata import functions_frame, only, synthetic

T0_US = 1_700_000_000_000_000


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
    samples = _samples(
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
    peers' windows left nothing out, they did not run it, and it is rank 6's own code path; so it
    is where its calls take more than the peers' windows could have left out."""
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
        f.loc[f["name"] == exit_[1], "p50_us"] = median_call_us
        return f

    for peers_cut, median_call_us, expected in (
        (True, 2.0, "compute"),
        (False, 2.0, "code_path"),
        (True, 480.0, "code_path"),
    ):
        f = only(diagnose(replace(data, functions=frame(peers_cut, median_call_us))).findings)
        assert (f.cause, f.ranks, f.function) == (expected, [6], "train.py(10): forward"), (
            peers_cut,
            median_call_us,
        )


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


def test_a_slower_device_names_what_holds_half_its_excess_or_its_operators_as_a_whole() -> None:
    """Rank 6's device is slower (1.5 ms a step, 7.5 ms in its 5-step window). Its forward, its
    matrix product and the product's backward each hold under half of that: none is named, the
    finding says its operators as a whole, the largest with their shares. A forward that holds two
    thirds is named; so is the function of the job's code its stack samples put it in for half."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    fwd = "train.py(10): forward"

    def frames(extra_fwd_us: float) -> dict[int, list[tuple]]:
        common = [
            ("op", "aten::mm", 15, 10_000.0),
            ("op", "AddmmBackward0", 15, 12_000.0),
            ("python", fwd, 5, 11_000.0),
        ]
        slow = [
            ("op", "aten::mm", 15, 13_000.0),
            ("op", "AddmmBackward0", 15, 15_000.0),
            ("python", fwd, 5, 11_000.0 + extra_fwd_us),
        ]
        return {r: slow if r == 6 else common for r in range(8)}

    f = only(diagnose(replace(data, functions=functions_frame(frames(2_500.0)))).findings)
    assert (f.cause, f.ranks, f.function) == ("compute", [6], ACROSS_OPERATORS)
    assert f.evidence["largest"] == pytest.approx(
        {"AddmmBackward0": 0.4, "aten::mm": 0.4, fwd: 0.333}, abs=0.01
    )
    assert "across the board, none holding half the extra time (" in f.summary
    assert "aten::mm 40%" in f.summary and "train.py(10): forward 33%)" in f.summary
    f = only(diagnose(replace(data, functions=functions_frame(frames(5_000.0)))).findings)
    assert (f.cause, f.function) == ("compute", fwd)
    assert f.evidence["function_share"] == pytest.approx(0.667, abs=0.01)
    step = "train.py(40): train_step"
    samples = _samples(
        {r: {sample_key(step, 41): 16, sample_key(fwd, 12): 8} for r in range(8) if r != 6}
        | {6: {sample_key(step, 41): 12, sample_key(fwd, 12): 20}}
    )
    f = only(diagnose(replace(data, functions=functions_frame(frames(2_500.0)), samples=samples)).findings)
    assert (f.cause, f.function) == ("compute", fwd)
    assert f.evidence["stack_samples_in_function"] == "20/32"


@pytest.mark.parametrize("padded", [False, True])
def test_a_slower_model_is_named_by_its_innermost_forward_not_the_module_around_it(padded: bool) -> None:
    """The frames of a transformer under DDP, as torch.profiler records them (3 callers each):
    ``module.py: _call_impl`` runs every module, so it is a caller of each model function and
    called by each. Callers are followed along each frame's own path, not through every path of a
    frame of the same name, or every model function would enclose every other one and the module
    event around the block (a few µs longer than its forward) would be named.

    ``padded``: the slower rank's batch is padded (the demo's degraded device), which takes one
    ``aten::reshape`` more a step than its peers', 52 against 51, each of them slower: its reshapes
    hold a third of the excess, but the call more holds ~2% of it. No code path of its own."""
    data = synthetic(slow={6: {"compute_us": 1500}})
    call, gpt, block = (
        "torch/nn/modules/module.py(1782): _call_impl",
        "gpt.py(170): forward",
        "gpt.py(156): forward",
    )

    def frames(scale: float) -> list[tuple]:
        return [
            ("op", "aten::addmm", 40, 10_000.0 * scale),
            ("python", "nn.Module: GPT_0", 5, 16_000.0 * scale, "distributed.py(1710): _run_ddp_forward"),
            (
                "python",
                gpt,
                5,
                15_990.0 * scale,
                f"distributed.py(1710): _run_ddp_forward > nn.Module: GPT_0 > {call}",
            ),
            ("python", "nn.Module: Block_0", 5, 15_000.0 * scale, f"nn.Module: GPT_0 > {call} > {gpt}"),
            ("python", block, 5, 14_990.0 * scale, f"{gpt} > nn.Module: Block_0 > {call}"),
            ("pylib", "nn.Module: Linear_0", 5, 2_000.0 * scale, f"nn.Module: Block_0 > {call} > {block}"),
            ("pylib", call, 5, 1_990.0 * scale, f"{call} > {block} > nn.Module: Linear_0"),
            (
                "pylib",
                "linear.py(130): forward",
                5,
                1_980.0 * scale,
                f"{block} > nn.Module: Linear_0 > {call}",
            ),
        ]

    # 51 and 52 calls a step over the window's 5 steps, each of the culprit's 1.5x as long.
    reshape = {
        r: [("op", "aten::reshape", 260, 7_650.0) if r == 6 else ("op", "aten::reshape", 255, 5_000.0)]
        for r in range(8)
    }
    data = replace(
        data,
        functions=functions_frame(
            {r: frames(1.5 if r == 6 else 1.0) + (reshape[r] if padded else []) for r in range(8)}
        ),
    )
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("compute", [6], block)
    assert f.evidence["stack"] == f"{gpt} > nn.Module: Block_0 > {call}"


def test_a_slow_dataset_is_named_by_its_own_function_with_the_loader_above_it() -> None:
    data = synthetic(slow={2: {"data_us": 2000}})
    loader = ("dataloader", "enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 5, 1_000.0)
    get = "data.py(30): __getitem__"
    peers = [loader, ("python", get, 320, 500.0, "torch/utils/data/_utils/fetch.py(50): fetch")]
    slow = [
        (*loader[:3], 11_000.0),
        ("python", get, 320, 10_400.0, "torch/utils/data/_utils/fetch.py(50): fetch"),
        (
            "pylib",
            "<built-in function sleep>",
            320,
            10_000.0,
            f"torch/utils/data/_utils/fetch.py(50): fetch > {get}",
        ),
    ]
    data = replace(data, functions=functions_frame({r: slow if r == 2 else peers for r in range(8)}))
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("dataloader", [2], get)
    assert f.evidence["loader"] == loader[1]


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


def _samples(per_rank: dict[int, dict[str, int]]) -> pd.DataFrame:
    rows = [(r, key, n) for r, keys in per_rank.items() for key, n in keys.items()]
    return pd.DataFrame(rows, columns=["rank", "function", "samples"])


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
    samples = _samples(
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
    samples = _samples(
        {r: {sample_key(module, 70): 8, forward: 2} for r in range(8) if r != 2}
        | {2: {sample_key(module, 70): 3, sample_key(module, 68): 6, sample_key(module, 71): 1}}
    )
    f = only(diagnose(replace(data, samples=samples)).findings)
    assert (f.cause, f.function) == ("code_path", "train.py(68): <module>")
    # A model's forward the culprit was found in a few more times than its peers (5 of its 47
    # samples, none of theirs) stands out less than the sleep's line does (21 of 47): the line is
    # named, not the forward, which holds too little of the extra time to be (a CI run of
    # nanogpt_like.py).
    samples = _samples(
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
    samples = _samples(
        {r: {sample_key(loop, 2300): 16, sample_key(callback, 31): 0} for r in range(8) if r != 5}
        | {5: {sample_key(loop, 2300): 10, sample_key(callback, 31): 6, sample_key(callback, 33): 2}}
    )
    f = only(diagnose(replace(data, samples=samples)).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [5], callback)
    assert f.evidence["stack_samples_in_function"] == "8/18" and f.evidence["line"] == 31
    # A device that got slower adds CPU time: compute, though nothing names where.
    f = only(diagnose(synthetic(slow={5: {"compute_us": 2000}})).findings)
    assert (f.cause, f.function) == ("compute", UNATTRIBUTED)


def test_a_stall_that_began_within_the_span_is_named_from_the_samples_since_it_began() -> None:
    """Rank 5's callback starts sleeping halfway through the span read: over the whole span it
    holds a twentieth of the rank's samples, too few to name it; since the change, half. A store's
    data reads the samples since the step the straggler began at."""
    data = synthetic(slow={5: {"compute_us": 2000, "cpu": 5000 / 7000, "from": 150}})
    data = replace(data, steps=data.steps.assign(start_us=T0_US + 50_000 * data.steps["step"]))  # 15 s
    loop, callback = "trainer.py(2200): _inner_training_loop", "train.py(30): on_step_end"
    peers = {r: {sample_key(loop, 2300): 16} for r in range(8) if r != 5}
    whole = _samples(peers | {5: {sample_key(loop, 2300): 19, sample_key(callback, 31): 1}})
    since = _samples(peers | {5: {sample_key(loop, 2300): 8, sample_key(callback, 31): 8}})
    f = only(diagnose(replace(data, samples=whole)).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [5], UNATTRIBUTED)
    asked: list[int] = []
    f = only(diagnose(replace(data, samples=whole, read_samples=lambda t: asked.append(t) or since)).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [5], callback)
    began = data.steps.query(f"rank == 5 and step >= {f.evidence['held_since_step']}")["start_us"].min()
    assert asked == [began] and f.evidence["held_since_step"] >= 150


def _gpu_job(slow: dict[int, dict[str, float]]) -> JobData:
    """A GPU job's step rows: the training thread's CPU time is the launching of kernels, the same
    on every rank whatever the kernels take (its time waiting on the GPU, in ``loss.item()``,
    costs none), and the collectives' time is their GPU time (``profiler_hook.nccl``)."""
    data = synthetic(ranks=8, steps=600, slow=slow)
    rng = np.random.default_rng(1)
    return replace(data, steps=data.steps.assign(cpu_us=1500 * rng.lognormal(0, 0.05, len(data.steps))))


def test_a_slower_gpu_is_named_compute_by_its_kernels_while_its_cpu_time_stays_flat() -> None:
    """Rank 2's GPU runs the same GEMM kernels 1.75x as long (its CPU launches them in the same
    time as its peers'): a slower device, named by the kernel that holds the extra time, with the
    operator that launched it in the evidence — not a code path, for want of CPU time."""
    gemm = "sm90_xmma_gemm_bf16bf16_bf16f32"
    launch = "train.py(10): forward > aten::mm"

    def window(kernel_us: float) -> list[tuple]:
        return [
            ("op", "aten::mm", 15, 1500.0),
            ("python", "train.py(10): forward", 5, 3000.0),
            ("kernel", gemm, 15, kernel_us, launch),
            ("kernel", "elementwise_kernel", 30, 2000.0, "aten::add"),
            ("collective", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 5, 4000.0, "record_param_comms"),
        ]

    data = _gpu_job({2: {"compute_us": 1500}})
    data = replace(
        data, functions=functions_frame({r: window(17_500.0 if r == 2 else 10_000.0) for r in range(8)})
    )
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("compute", [2], gemm), f.summary
    assert f.evidence["launched_by"] == "aten::mm"
    assert f.evidence["operator_ratio"] == pytest.approx(1.75)


def test_a_cpu_side_stall_in_a_gpu_job_is_named_by_its_function() -> None:
    """Rank 3 blocks 7.5 ms a step in a metrics upload while its GPU idles; its kernels take what
    its peers' take: a code path, named by the function."""
    common = [
        ("op", "aten::mm", 15, 1500.0),
        ("python", "train.py(10): forward", 5, 3000.0),
        ("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32", 15, 10_000.0, "train.py(10): forward > aten::mm"),
    ]
    stall = [*common, ("python", "train.py(80): upload_metrics", 5, 7500.0)]
    data = _gpu_job({3: {"compute_us": 1500}})
    data = replace(data, functions=functions_frame({r: stall if r == 3 else common for r in range(8)}))
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.function) == ("code_path", [3], "train.py(80): upload_metrics"), f.summary
