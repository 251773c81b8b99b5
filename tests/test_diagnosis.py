"""The diagnosis on synthetic jobs (every cause, topology, hangs) and on recorded real runs."""

from __future__ import annotations

import gzip
import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from aggregator import Store, ingest
from diagnosis import CAUSES, Finding, JobData, Settings, diagnose, read_job, stragglers
from diagnosis.classify import ACROSS_OPERATORS, UNATTRIBUTED
from diagnosis.detectors import straggler
from diagnosis.findings import effect
from tests.jobdata import LINK_T0, functions_frame, only, ring_links, sched_windows, synthetic
from wire.records import sample_key

FIXTURES = Path(__file__).parent / "fixtures"


def test_healthy_synthetic_job_has_no_findings() -> None:
    for seed in range(5):
        assert diagnose(synthetic(seed=seed)).findings == []


def test_a_mild_slowdown_within_the_ranks_spread_is_found_against_the_ranks_own_past() -> None:
    """Ranks differ steadily by up to +-6% (their cores); from step 700, rank 2 (0.96x) does 15%
    more work: ~1.09x its peers, inside the spread the peer rule must tolerate, but a change point."""
    bias = {0: 1.06, 1: 0.97, 2: 0.96, 3: 1.02}
    for seed in range(3):
        healthy = synthetic(ranks=4, steps=1400, hosts_of=2, bias=bias, seed=seed)
        assert diagnose(healthy).findings == []
        data = synthetic(
            ranks=4, steps=1400, hosts_of=2, bias=bias, seed=seed, slow={2: {"compute_us": 750, "from": 700}}
        )
        assert stragglers.find(data.steps) == []  # the peer rule alone does not see it
        f = only(diagnose(data).findings)
        assert (f.cause, f.ranks) == ("compute", [2])
        assert f.evidence["ratio_before"] < 1.0 < 1.04 < f.evidence["ratio"]
        assert 650 <= f.evidence["held_since_step"] <= 760 and "until step" in f.summary


def _queue_waves(data: JobData, seed: int, amplitude: float = 0.05) -> JobData:
    """Own time as it is on shared cores: each rank's steps wait for a CPU in waves (+-5% over
    70 steps) that its main thread's CPU time does not carry."""
    rng = np.random.default_rng(seed)
    st = data.steps.copy()
    waves = rng.normal(0, amplitude, size=(int(st["rank"].max()) + 1, int(st["step"].max()) // 70 + 1))
    own = (st["dur_us"] - st["comm_us"]) * (1 + waves[st["rank"], st["step"] // 70])
    st["dur_us"] = np.maximum(st["dur_us"], own + 50)
    st["comm_us"] = st["dur_us"] - own
    return replace(data, steps=st)


def test_a_mild_slowdown_lost_in_queueing_noise_is_found_by_the_cpu_time_that_rose_with_it() -> None:
    """From step 700 rank 2 does 8% more work. Its own time's rise is lost in the waves of CPU
    waits; its main thread's CPU time rose cleanly, and names it."""
    found = 0
    for seed in range(6):
        mild = {2: {"compute_us": 400, "from": 700}}
        data = _queue_waves(synthetic(ranks=4, steps=1400, hosts_of=2, seed=seed, slow=mild), seed)
        without_cpu = data.steps.assign(cpu_us=0.0)
        assert stragglers.shifted(without_cpu) == [], "the own-time series alone must not see it"
        by_cpu = stragglers.shifted(data.steps)
        assert [x.rank for x in by_cpu] in ([], [2])
        # Of one rank alone (its peers still its peers), as of all ranks.
        assert (
            stragglers.shifted(data.steps, only=2) == by_cpu and stragglers.shifted(data.steps, only=1) == []
        )
        found += bool(by_cpu)
        assert (
            diagnose(_queue_waves(synthetic(ranks=4, steps=1400, hosts_of=2, seed=seed), seed)).findings == []
        )
    assert found >= 4, found


def test_a_certain_rise_a_hair_short_in_own_time_is_judged_on_the_cpu_time_too() -> None:
    """From step 700 rank 2 does 5.5% more work: its own time rises by 0.040-0.044 (relative to the
    step's median) at a t of 17-20, short of the 0.05 the own-time series asks; its CPU time by
    0.043-0.047. The rise is certain in both: the CPU time's test names it."""
    for seed in range(4):
        data = synthetic(
            ranks=4, steps=1400, hosts_of=2, seed=seed, slow={2: {"compute_us": 290, "from": 700}}
        )
        assert stragglers.shifted(data.steps.assign(cpu_us=0.0)) == [], "own time alone: too small a rise"
        (st,) = stragglers.shifted(data.steps)
        assert st.rank == 2 and 650 <= st.since_step <= 760 and st.ratio > 1.04
        assert stragglers.shifted(data.steps, only=2) == [st]
        assert stragglers.shifted(synthetic(ranks=4, steps=1400, hosts_of=2, seed=seed).steps) == []


def test_a_rise_in_own_time_that_is_run_queue_wait_moving_into_the_collectives_is_no_change() -> None:
    """Every rank waits 800 µs a step for a CPU outside the collectives; from step 700 rank 2's wait
    falls inside them instead (the order the ranks leave a collective in decides who queues where).
    Its own time rises 1.18x against its peers', but its time outside the collectives and its CPU
    time do not: it works no longer and holds nobody back."""
    for seed in range(3):
        healthy = synthetic(ranks=4, steps=1400, hosts_of=2, seed=seed).steps.assign(wait_us=800.0)
        since = (healthy["rank"] == 2) & (healthy["step"] >= 700)
        moved = healthy.copy()
        moved.loc[since, "wait_us"] = 0.0
        assert stragglers.shifted(moved) == []
        # Its time outside the collectives grows too, but not its CPU time: its own time is CPU
        # work (a CPU-bound rank), and a rise in it that is no more work is no change either.
        longer = healthy.copy()
        longer.loc[since, "dur_us"] += 800.0
        assert stragglers.shifted(longer) == []
        # The same rise as work: its CPU time grows with it.
        slower = longer.copy()
        slower.loc[since, "cpu_us"] += 800.0
        (found,) = stragglers.shifted(slower)
        assert found.rank == 2 and 650 <= found.since_step <= 760
        # Where its own time is not CPU work (it waits off the CPU for a device), the longer steps
        # are the change.
        (found,) = stragglers.shifted(longer.assign(cpu_us=longer["cpu_us"] / 4))
        assert found.rank == 2


def test_a_straggler_in_bursts_stands_out_in_cpu_time_where_its_own_time_is_lost_in_the_spread() -> None:
    """Rank 2 works 1.25x in bursts of 150 steps (its peers lose CPU to it too, so its own time
    rises less, 1.15x): in own time it stands out in too few chunks; in CPU time in most."""
    own_only = with_cpu = 0
    for seed in range(6):
        bursts = {2: {"compute_us": 900, "cpu": 1.25, "on": 150, "off": 150}}
        data = _queue_waves(synthetic(ranks=4, steps=1200, hosts_of=2, seed=seed, slow=bursts), seed)
        own_only += bool(stragglers.find(data.steps.assign(cpu_us=0.0)))
        found = stragglers.find(data.steps)
        assert [x.rank for x in found] in ([], [2])
        with_cpu += bool(found)
        healthy = _queue_waves(synthetic(ranks=4, steps=1200, hosts_of=2, seed=seed), seed)
        assert stragglers.find(healthy.steps) == []
    assert own_only <= 1 and with_cpu >= 5, (own_only, with_cpu)


def _change(ratio: float, before_ratio: float) -> stragglers.Straggler:
    """A rank the change-point rule found, held in 15 of 15 chunks (its values per step all 0)."""
    parts = ("own_us", "data_us", "comm_us", "cpu_us", "nivcsw")
    zero = dict.fromkeys((*parts, *(f"peer_{p}" for p in parts)), 0.0)
    return stragglers.Straggler(
        rank=3, chunks_flagged=15, chunks=15, ratio=ratio, before_ratio=before_ratio, **zero
    )


def test_a_change_found_on_cpu_time_is_as_large_as_the_larger_of_its_two_growths() -> None:
    """A 1.15x slower device found on CPU time grew 1.045x there and 1.083x in own time (the CPU
    time holds none of its other waits): its confidence follows the larger; another run's grew
    1.10x in CPU time and 1.04x in own time."""
    mild = _change(ratio=1.083, before_ratio=1.0)
    assert replace(mild, cpu_growth=1.045).growth == pytest.approx(1.083)
    assert replace(mild, ratio=1.04, cpu_growth=1.10).growth == pytest.approx(1.10)


def test_a_rank_that_was_faster_than_its_peers_has_grown_only_by_how_far_it_now_exceeds_them() -> None:
    """A healthy rank of the demo (4 ranks on 2 shared cores) was 0.90x its peers for 10 s, then
    1.045x: its own time grew 1.16x, but the job waits for it 4.5% longer, too little to report."""
    was_fast = _change(ratio=1.045, before_ratio=0.90)
    assert was_fast.growth == pytest.approx(1.045)
    assert effect(was_fast.growth) < Settings().min_confidence
    assert replace(was_fast, before_ratio=1.0).growth == pytest.approx(1.045)
    assert replace(was_fast, before_ratio=1.02).growth == pytest.approx(1.045 / 1.02)


def test_a_straggler_slow_half_the_time_is_told_in_bursts_not_diluted_over_the_chunks() -> None:
    """Rank 1 works ~1.25x for 200 steps in every 400: slow in 12-14 of 24 fine chunks and 4 of 6
    chunks. Over the chunks its ratio is diluted to ~1.1x (a finding at 0.3-0.4, at the edge of
    being dropped: a device 2x slower in bursts was lost so); in bursts it is told as it is."""
    for seed in range(4):
        bursts = {1: {"compute_us": 1200, "cpu": 1.1, "on": 200, "off": 200}}
        data = _queue_waves(synthetic(ranks=4, steps=1210, hosts_of=2, seed=seed, slow=bursts), seed)
        (st,) = stragglers.find(data.steps)
        assert st.rank == 1 and st.bursts and 12 <= st.chunks_flagged < 18 and st.ratio > 1.15
        f = only(diagnose(data).findings)
        assert f.cause == "compute" and f.confidence > 0.6 and "in bursts" in f.summary


def test_a_straggler_in_short_rare_bursts_is_found_in_fine_chunks_where_half_the_chunks_miss_it() -> None:
    """Rank 6 of 8 works 1.18x for 100 steps in every 300: slow in a third of the time, it fills no
    half of 6 chunks; in 24 finer ones it is slow (in CPU and own time) in 6 or more, where a
    healthy job has at most 1 or 2 by chance. Own time waits in waves of +-10% (8 ranks on shared
    cores)."""
    found = coarse_found = 0
    chunks = replace(stragglers.StragglerSettings(), burst_min_chunks=25)
    coarse = replace(Settings(), straggler=replace(straggler.Settings(), steps=chunks))
    for seed in range(6):
        bursts = {6: {"compute_us": 900, "cpu": 1.18, "on": 100, "off": 200}}
        data = _queue_waves(synthetic(ranks=8, steps=1000, seed=seed, slow=bursts), seed, 0.1)
        coarse_found += bool(diagnose(data, coarse).findings)
        fs = diagnose(data).findings
        assert all(f.ranks == [6] for f in fs), fs
        found += bool(fs)
        assert diagnose(_queue_waves(synthetic(ranks=8, steps=1000, seed=seed), seed, 0.1)).findings == []
    assert found >= 5 and coarse_found <= 2, (found, coarse_found)
    assert "in bursts: slow in" in fs[0].summary


def test_dataloader_straggler() -> None:
    f = only(diagnose(synthetic(slow={2: {"data_us": 2000}})).findings)
    assert (f.cause, f.ranks) == ("dataloader", [2])
    assert f.evidence["data_wait_ms"] > 2 * f.evidence["peer_data_wait_ms"]


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


T0_US = 1_700_000_000_000_000


def test_a_stall_that_began_within_the_span_is_named_from_the_samples_since_it_began() -> None:
    """Rank 5's callback starts sleeping halfway through the span read: over the whole span it
    holds a twentieth of the rank's samples, too few to name it; since the change, half. A store's
    data reads the samples since the step the straggler began at."""
    data = synthetic(slow={5: {"compute_us": 2000, "cpu": 5000 / 7000, "from": 150}})
    data = replace(data, steps=data.steps.assign(start_us=T0_US + 10_000 * data.steps["step"]))
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


def test_intermittent_stalls_and_bursts_are_stragglers_though_their_median_step_is_healthy() -> None:
    # A 20 ms data-loader stall on every 20th step: the median step of rank 4 is its peers'.
    f = only(diagnose(synthetic(slow={4: {"data_us": 20_000, "on": 1, "off": 19}})).findings)
    assert (f.cause, f.ranks) == ("dataloader", [4])
    assert f.evidence["data_wait_ms"] == pytest.approx(1.3, abs=0.2)  # mean per step: 20 ms / 20 + 0.3
    # Compute 1.5x slower in bursts of 25 steps, 25 steps apart.
    f = only(diagnose(synthetic(slow={2: {"compute_us": 2500, "on": 25, "off": 25}})).findings)
    assert (f.cause, f.ranks) == ("compute", [2])
    assert f.evidence["ratio"] == pytest.approx(1.23, abs=0.05)


def test_a_rank_whose_threads_queue_for_the_cpu_is_named_though_it_works_no_longer() -> None:
    data = synthetic()  # no rank works longer: the contended rank's collective threads fall behind
    f = only(diagnose(replace(data, functions=sched_windows({3: 4.0}))).findings)
    assert (f.cause, f.ranks, f.hosts, f.function) == (
        "host_contention",
        [3],
        ["node1"],
        "(threads waiting for a CPU)",
    )
    assert f.evidence["cpu_wait_ms_per_step"] == 4.0 and f.evidence["windows_flagged"] == "4/4"
    # A wait that stands out (3x) but is a small part of a ~5.3 ms step cannot hold the job back.
    assert diagnose(replace(data, functions=sched_windows({3: 0.6}, base_ms=0.2))).findings == []
    # A straggler whose extra own time is CPU wait, not CPU work, is contended, not a slow device.
    waits = sched_windows({5: 3.0})
    f = only(
        diagnose(replace(synthetic(slow={5: {"compute_us": 1500, "cpu": 0.5}}), functions=waits)).findings
    )
    assert (f.cause, f.ranks) == ("host_contention", [5])
    # With the extra time spent computing, the wait is its threads queueing behind its own work.
    f = only(diagnose(replace(synthetic(slow={5: {"compute_us": 1500}}), functions=waits)).findings)
    assert (f.cause, f.ranks) == ("compute", [5])
    # A rank whose threads wait 4 ms a step for a CPU and that works a little longer too (1.14x: a
    # hogged host slows its work as well) is contended: the surer of its two accounts.
    mild = synthetic(slow={3: {"compute_us": 700}})
    assert [st.rank for st in stragglers.find(mild.steps)] == [3]
    f = only(diagnose(replace(mild, functions=sched_windows({3: 4.0}))).findings)
    assert (f.cause, f.ranks) == ("host_contention", [3])
    # A rank whose reads sleep 10 ms a batch uses the CPU for a third of its own time, and on
    # shared cores its threads may queue longer in some windows: it waits for data, not for a CPU.
    reads = synthetic(slow={5: {"data_us": 10_000}})
    f = only(diagnose(replace(reads, functions=sched_windows({5: 9.0}))).findings)
    assert (f.cause, f.ranks) == ("dataloader", [5])


def test_a_rank_that_sleeps_in_its_own_code_is_that_code_path_though_its_threads_queue_too() -> None:
    """Rank 5 sleeps 3 ms a step in a metrics upload only it makes: it uses the CPU for half its own
    time, and its threads queue 2 ms a step longer than its peers' (the others run meanwhile). The
    upload holds more of its excess than the queueing: a code path. Rank 0's threads queue 3 ms
    longer too, but rank 0 waits in the collectives as long as the others: nobody waits for it."""
    data = synthetic(slow={5: {"compute_us": 3000, "cpu": 0.5}})
    up = "train.py(40): upload_metrics"
    upload = pd.DataFrame(
        [
            {"rank": 5, "window": w, "step_lo": 50 + 50 * w, "step_hi": 60 + 50 * w, "kind": "python"}
            | {"name": up, "stack": "train.py(80): train_step", "count": 10, "total_us": 30_000.0}
            | {"mean_us": 3000.0, "p50_us": 3000.0, "max_us": 3000.0}
            for w in range(4)
        ]
    )
    # Its threads' wait, summed over them, can exceed the time the upload holds (a code path
    # that works, on shared cores, queues its threads): here ~4 ms a step beyond its peers', the
    # upload 3. An upload that holds half the excess or more is the account.
    for waits in ({5: 3.0}, {5: 3.0, 0: 4.0}, {5: 5.0}):
        functions = pd.concat([sched_windows(waits), upload], ignore_index=True)
        f = only(diagnose(replace(data, functions=functions)).findings)
        assert (f.cause, f.ranks, f.function) == ("code_path", [5], up)
    # Without the upload in its windows, the queueing is the account of its excess.
    f = only(diagnose(replace(data, functions=sched_windows({5: 3.0}))).findings)
    assert (f.cause, f.ranks) == ("host_contention", [5])


def test_both_ranks_of_a_contended_host_of_two_are_named_though_they_lift_the_median() -> None:
    """Two of four ranks contended (one host of two): the median of all four sits between them and
    the others, so one of them stands out by less than ``min_ratio``; measured against the ranks
    not found, both do, and they make up the host."""
    data = synthetic(ranks=4, hosts_of=2)
    waits = sched_windows({0: 3.2, 1: 3.4}, base_ms=1.4, ranks=4)
    f = only(diagnose(replace(data, functions=waits)).findings)
    assert (f.cause, f.ranks, f.hosts) == ("host_contention", [0, 1], ["node0"])
    # One contended rank of four: the others are not measured against each other and named.
    f = only(diagnose(replace(data, functions=sched_windows({1: 3.4}, base_ms=1.4, ranks=4))).findings)
    assert (f.cause, f.ranks) == ("host_contention", [1])


def test_an_older_hooks_windows_with_their_link_sends_still_name_the_slow_nic() -> None:
    """Hooks before the heartbeats carried link sends measured them per profiling window, as the
    ``net_send@tcp`` pattern with the link as its stack."""
    links = ring_links(4, {(2, 3): 6.0, (3, 0): 6.0}, spans=3)
    windows = pd.DataFrame(
        {
            "rank": links["rank"],
            "window": (links["time_us"] - LINK_T0) // 5_000_000 * 50,
            "kind": "collective",
            "name": "net_send@tcp",
            "stack": links["link"],
            "count": 1,
            "total_us": links["send_us"].astype(float),
            "mean_us": links["send_us"].astype(float),
            "nbytes": links["nbytes"],
        }
    )
    f = only(diagnose(replace(synthetic(ranks=4, hosts_of=4), functions=windows)).findings)
    assert (f.cause, f.ranks, f.evidence["windows_flagged"]) == ("communication", [3], "3/3")


def test_a_slow_switch_uplink_is_the_switch_whose_links_to_the_rest_are_slow() -> None:
    # Six hosts, two per switch; sw1's uplink (hosts 2 and 3) is slow: 1 -> 2 and 3 -> 4 cross it.
    links = ring_links(6, {(1, 2): 5.0, (3, 4): 5.0})
    data = synthetic(ranks=6, hosts_of=6)
    ranks = data.ranks.assign(switch=[f"sw{r // 2}" for r in range(6)])
    f = only(diagnose(replace(data, ranks=ranks, links=links)).findings)
    assert (f.cause, f.scope, f.ranks, f.evidence["switch"]) == ("communication", "switch", [2, 3], "sw1")


def test_stragglers_that_make_up_a_spine_become_one_finding_naming_it() -> None:
    # 16 hosts of one rank, two hosts per leaf switch, two leaves per spine; spine s1's 4 ranks slow.
    data = synthetic(ranks=16, hosts_of=16, slow={r: {"compute_us": 3000} for r in range(4, 8)})
    leaves = data.ranks.assign(switch=[f"sw{r // 2}" for r in range(16)])
    assert [(f.scope, f.ranks) for f in diagnose(replace(data, ranks=leaves)).findings] == [
        ("switch", [4, 5]),
        ("switch", [6, 7]),
    ]
    spines = leaves.assign(spine=[f"s{r // 4}" for r in range(16)])
    f = only(diagnose(replace(data, ranks=spines)).findings)
    assert (f.cause, f.scope, f.ranks, f.evidence["spine"]) == ("compute", "spine", [4, 5, 6, 7], "s1")


def test_host_contention_from_preemption_signals() -> None:
    data = synthetic(slow={1: {"compute_us": 1500, "nivcsw": 40, "cpu": 0.5}})
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks) == ("host_contention", [1])


def test_all_ranks_of_a_host_become_one_host_finding() -> None:
    data = synthetic(slow={2: {"compute_us": 1500}, 3: {"compute_us": 1500}})
    f = only(diagnose(data).findings)
    assert (f.cause, f.ranks, f.hosts, f.scope) == ("compute", [2, 3], ["node1"], "host")


def test_findings_validate_their_contract() -> None:
    with pytest.raises(ValueError, match="unknown cause"):
        Finding(cause="gremlins", ranks=[1], hosts=[], function="x", confidence=0.5, summary="")
    with pytest.raises(ValueError, match="confidence"):
        Finding(cause="compute", ranks=[1], hosts=[], function="x", confidence=1.5, summary="")
    assert CAUSES == (
        "compute",
        "communication",
        "dataloader",
        "host_contention",
        "code_path",
        "hang",
        "job_wide",
        "failure",
    )


# --- recorded real runs: 4 gloo ranks, 15 s each (tests/fixtures/record.py) ----------------------

RECORDED = {
    "compute-r2": ("compute", [2]),
    "dataloader-r1": ("dataloader", [1]),
    "code_path-r3": ("code_path", [3]),
    "healthy": None,
}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, JobData]]:
    """The recorded spools, ingested through the real store (chDB) and read back (the store open:
    the diagnosis reads the functions of the ranks it names)."""
    root = tmp_path_factory.mktemp("recorded")
    spool = root / "spool"
    for job in RECORDED:
        (spool / job).mkdir(parents=True)
        for gz in (FIXTURES / job).glob("*.jsonl.gz"):
            (spool / job / gz.name.removesuffix(".gz")).write_bytes(gzip.decompress(gz.read_bytes()))
    with Store.embedded(root / "store") as store:
        stats = ingest(spool, store)
        assert stats.dead_letters == 0
        shutil.rmtree(spool)
        yield {job: read_job(store, job) for job in RECORDED}


@pytest.mark.parametrize("job", list(RECORDED))
def test_recorded_runs(recorded: dict[str, JobData], job: str) -> None:
    data = recorded[job]
    assert data.steps["rank"].nunique() == 4 and not data.spans().empty
    d = diagnose(data)
    json.dumps(d.to_dict())  # the JSON contract: serializable as is
    if RECORDED[job] is None:
        assert d.findings == []
        return
    top = d.findings[0]
    assert (top.cause, top.ranks) == RECORDED[job]
    assert top.hosts == ["node1" if top.ranks[0] >= 2 else "node0"]
    assert len(d.findings) == 1


def test_what_some_ranks_hooks_do_not_see_is_said_in_one_line_with_the_ranks() -> None:
    from renderers.text import format_diagnosis

    full = "torch.distributed calls (plain, FSDP, FSDP2, pipelining, DTensor): timed; DDP Net on world: timed per backward pass"
    untested = "backend mpi: untested (counts and waits as the CPU sees them)"
    untimed = "DDP Head on 3: not tracked (RuntimeError: no engine)"
    ranks = pd.DataFrame(
        {
            "rank": [0, 1, 2],
            "host": ["h"] * 3,
            "coverage": [full, f"{full}; {untested}", f"{full}; {untimed}; {untested}"],
        }
    )
    d = diagnose(JobData(job="j", ranks=ranks))
    assert d.analyzed["coverage_gaps"] == [f"{untimed} (rank 2)", f"{untested} (ranks 1, 2)"]
    assert d.findings == []
    said = [line for line in format_diagnosis(d).splitlines() if "not seen" in line]
    assert said == [f"  not seen by the hook: {untimed} (rank 2); {untested} (ranks 1, 2)"]
    assert "coverage_gaps" not in diagnose(JobData(job="j", ranks=ranks.assign(coverage=full))).analyzed


def test_records_that_never_reached_the_store_are_said_in_one_line_with_the_ranks(tmp_path: Path) -> None:
    from renderers.html import write_report
    from renderers.text import format_diagnosis

    missing = pd.DataFrame({"rank": [2, 5], "pid": [40, 41], "made": [1000, 200], "stored": [990, 199]})
    d = diagnose(JobData(job="j", missing=missing))
    assert d.analyzed["records_missing"] == "11 of 1,200 records (ranks 2, 5)"
    said = [line for line in format_diagnosis(d).splitlines() if "never stored" in line]
    assert said == [
        "  never stored (dropped by the hook or lost on the way): 11 of 1,200 records (ranks 2, 5)"
    ]
    page = write_report(tmp_path / "report.html", d, JobData(job="j", missing=missing)).read_text()
    assert "Never stored (dropped by the hook or lost on the way): 11 of 1,200 records (ranks 2, 5)" in page
    assert "records_missing" not in diagnose(JobData(job="j")).analyzed


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


def test_a_two_rank_job_names_the_rank_that_turned_slower_against_the_other() -> None:
    """Two ranks cannot outvote each other, so the peer rule leaves them be; but a rank that turned
    slower at some step rose against the other there, and is named (not "both ranks slowed down
    together"). A steady difference (rank 0 works 1.2x throughout: its logging) and a healthy pair
    give nothing."""
    for seed in range(4):
        turned = synthetic(
            ranks=2, steps=1400, hosts_of=1, seed=seed, slow={1: {"compute_us": 1500, "from": 700}}
        )
        f = only(diagnose(turned).findings)
        assert (f.cause, f.ranks) == ("compute", [1]), f.summary
        assert 600 <= f.evidence["held_since_step"] <= 780, f.evidence
        assert diagnose(synthetic(ranks=2, steps=1400, hosts_of=1, seed=seed)).findings == []
        assert diagnose(synthetic(ranks=2, steps=1400, hosts_of=1, seed=seed, bias={0: 1.2})).findings == []


def test_pipeline_stages_are_compared_only_with_their_own_replicas() -> None:
    """A (dp=2, pp=4) mesh: the last stage carries the loss head, 1.5x the others' work by design.
    Compared across stages, its ranks stand out; each measured against its stage's replica, they
    do not, and a slower device on a rank of another stage is named alone: its own time over its
    stage's, judged with every stage's ranks (two replicas cannot outvote each other)."""
    bias = {3: 1.5, 7: 1.5}
    mesh = [{"dp": r // 4, "pp": r % 4} for r in range(8)]
    healthy = synthetic(bias=bias)
    assert {f.ranks[0] for f in diagnose(healthy).findings} == {3, 7}  # without roles: the split
    staged = replace(healthy, ranks=healthy.ranks.assign(mesh=mesh))
    assert staged.roles() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert diagnose(staged).findings == []
    for culprit in (5, 7):
        slow = synthetic(bias=bias, slow={culprit: {"compute_us": 3000}})
        f = only(diagnose(replace(slow, ranks=slow.ranks.assign(mesh=mesh))).findings)
        assert (f.cause, f.ranks) == ("compute", [culprit])
        # Measured against its stage's replica: the last stage's is 1.5x the others'.
        assert (f.evidence["peer_median_ms"] > 7) == (culprit == 7), f.evidence
