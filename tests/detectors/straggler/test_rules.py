"""The straggler rules on hand-built jobs: a rank slower than its peers, or than its own past
(the change-point rule, on own time and CPU time), in bursts or throughout, against the peers of its
role; never a rank that only waits for it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from rankscope.diagnosis import JobData, Settings, diagnose, grid
from rankscope.diagnosis.detectors import straggler
from rankscope.diagnosis.detectors.straggler import cause, rank, shift
from rankscope.diagnosis.detectors.straggler.peers import slower_than_peers
from rankscope.diagnosis.findings import effect
from tests.jobdata import functions_frame, only, synthetic

SETTINGS = straggler.Settings()


def test_compute_straggler_is_named_not_the_ranks_that_wait_for_it() -> None:
    data = synthetic(slow={5: {"compute_us": 1500}})
    ops = [("op", "aten::addmm", 15, 10_000.0), ("op", "aten::relu", 10, 2_000.0)]
    slow_ops = [("op", "aten::addmm", 15, 20_000.0), ("op", "aten::relu", 10, 2_100.0)]
    data = replace(data, functions=functions_frame({r: slow_ops if r == 5 else ops for r in range(8)}))
    f = only(straggler.find(data, SETTINGS))
    assert (f.cause, f.ranks, f.hosts, f.function) == ("compute", [5], ["node2"], "aten::addmm")
    # The wait inversion: the culprit waits least in the collective.
    assert f.evidence["collective_wait_ms"] < f.evidence["peer_collective_wait_ms"]
    assert f.evidence["ratio"] > 1.2
    assert f.evidence["operator_ratio"] == pytest.approx(2.0)
    assert 0.5 < f.confidence <= 1


def test_a_job_a_few_seconds_old_is_too_young_to_compare_its_ranks() -> None:
    """The same slower device, in a job whose 300 steps took 3 s (a store's read says when each
    started): too young to tell from a healthy job's first seconds. 40 ms steps (12 s): found."""
    data = synthetic(slow={5: {"compute_us": 1500}})
    at = 1_800_000_000_000_000 + data.steps["step"] * 10_000
    young = replace(data, steps=data.steps.assign(start_us=at))
    assert straggler.find(young, SETTINGS) == []
    old = replace(data, steps=data.steps.assign(start_us=at.min() + data.steps["step"] * 40_000))
    assert only(straggler.find(old, SETTINGS)).ranks == [5]
    # Once the analyzed range is whole (800 steps after the warm-up), the job is old enough at any pace.
    many = synthetic(steps=900, slow={5: {"compute_us": 1500}})
    quick = many.steps.assign(start_us=1_800_000_000_000_000 + many.steps["step"] * 5_000)  # 4.5 s
    assert only(straggler.find(replace(many, steps=quick), SETTINGS)).ranks == [5]


def _in_buckets(data: JobData, width: int) -> JobData:
    """``data`` with its steps as a store reads a large job's: per rank and bucket of ``width``
    steps, their means (``Reads.steps(width=)``)."""
    s = data.steps
    b = s.assign(step=s["step"] // width * width)
    means = {c: "min" if c == "start_us" else "mean" for c in s.columns if c not in ("rank", "step")}
    out = b.groupby(["rank", "step"], as_index=False).agg(means)
    return replace(data, steps=out.assign(**{grid.WIDTH: width}))


@pytest.mark.parametrize(
    ("slow", "steps", "cause"),
    [
        ({6: {"compute_us": 1500}}, 300, "compute"),
        ({5: {"data_us": 3000}}, 300, "dataloader"),
        ({2: {"compute_us": 1500, "from": 700}}, 1400, "compute"),  # the change-point rule's
        ({3: {"compute_us": 6000, "on": 40, "off": 80}}, 1200, "compute"),  # in bursts
    ],
)
def test_a_large_jobs_steps_read_in_buckets_name_the_same_straggler(
    slow: dict[int, dict[str, float]], steps: int, cause: str
) -> None:
    """Read in buckets of 4 or 8 steps, the rank, the cause and how long it held are those of
    the steps read one by one (blocks of steps, as the hooks ship them, are as wide)."""
    data = synthetic(16, steps, slow=slow, hosts_of=2)
    f = only(straggler.find(data, SETTINGS))
    assert (f.cause, f.ranks) == (cause, list(slow))
    for width in (4, 8):
        g = only(straggler.find(_in_buckets(data, width), SETTINGS))
        assert (g.cause, g.ranks) == (f.cause, f.ranks), width
        assert g.evidence["ratio"] == pytest.approx(f.evidence["ratio"], rel=0.05), width
        assert abs(g.evidence["held_since_step"] - f.evidence["held_since_step"]) <= steps // 10, width


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
        assert slower_than_peers(data.steps) == []  # the peer rule alone does not see it
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
        assert shift.shifted(without_cpu) == [], "the own-time series alone must not see it"
        by_cpu = shift.shifted(data.steps)
        assert [x.rank for x in by_cpu] in ([], [2])
        # Of one rank alone (its peers still its peers), as of all ranks.
        assert shift.shifted(data.steps, only=2) == by_cpu and shift.shifted(data.steps, only=1) == []
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
        assert shift.shifted(data.steps.assign(cpu_us=0.0)) == [], "own time alone: too small a rise"
        (st,) = shift.shifted(data.steps)
        assert st.rank == 2 and 650 <= st.since_step <= 760 and st.ratio > 1.04
        assert shift.shifted(data.steps, only=2) == [st]
        assert shift.shifted(synthetic(ranks=4, steps=1400, hosts_of=2, seed=seed).steps) == []


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
        assert shift.shifted(moved) == []
        # Its time outside the collectives grows too, but not its CPU time: its own time is CPU
        # work (a CPU-bound rank), and a rise in it that is no more work is no change either.
        longer = healthy.copy()
        longer.loc[since, "dur_us"] += 800.0
        assert shift.shifted(longer) == []
        # The same rise as work: its CPU time grows with it.
        slower = longer.copy()
        slower.loc[since, "cpu_us"] += 800.0
        (found,) = shift.shifted(slower)
        assert found.rank == 2 and 650 <= found.since_step <= 760
        # Where its own time is not CPU work (it waits off the CPU for a device), the longer steps
        # are the change.
        (found,) = shift.shifted(longer.assign(cpu_us=longer["cpu_us"] / 4))
        assert found.rank == 2


def test_a_straggler_in_bursts_stands_out_in_cpu_time_where_its_own_time_is_lost_in_the_spread() -> None:
    """Rank 2 works 1.25x in bursts of 150 steps (its peers lose CPU to it too, so its own time
    rises less, 1.15x): in own time it stands out in too few chunks; in CPU time in most."""
    own_only = with_cpu = 0
    for seed in range(6):
        bursts = {2: {"compute_us": 900, "cpu": 1.25, "on": 150, "off": 150}}
        data = _queue_waves(synthetic(ranks=4, steps=1200, hosts_of=2, seed=seed, slow=bursts), seed)
        own_only += bool(slower_than_peers(data.steps.assign(cpu_us=0.0)))
        found = slower_than_peers(data.steps)
        assert [x.rank for x in found] in ([], [2])
        with_cpu += bool(found)
        healthy = _queue_waves(synthetic(ranks=4, steps=1200, hosts_of=2, seed=seed), seed)
        assert slower_than_peers(healthy.steps) == []
    assert own_only <= 1 and with_cpu >= 5, (own_only, with_cpu)


def _change(ratio: float, before_ratio: float) -> rank.Straggler:
    """A rank the change-point rule found, held in 15 of 15 chunks (its values per step all 0)."""
    parts = ("own_us", "data_us", "comm_us", "cpu_us", "nivcsw")
    zero = dict.fromkeys((*parts, *(f"peer_{p}" for p in parts)), 0.0)
    return rank.Straggler(
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
        (st,) = slower_than_peers(data.steps)
        assert st.rank == 1 and st.bursts and 12 <= st.chunks_flagged < 18 and st.ratio > 1.15
        f = only(diagnose(data).findings)
        assert f.cause == "compute" and f.confidence > 0.6 and "in bursts" in f.summary


def test_a_straggler_in_short_rare_bursts_is_found_in_fine_chunks_where_half_the_chunks_miss_it() -> None:
    """Rank 6 of 8 works 1.18x for 100 steps in every 300: slow in a third of the time, it fills no
    half of 6 chunks; in 24 finer ones it is slow (in CPU and own time) in 6 or more, where a
    healthy job has at most 1 or 2 by chance. Own time waits in waves of +-10% (8 ranks on shared
    cores)."""
    found = coarse_found = 0
    chunks = replace(rank.StragglerSettings(), burst_min_chunks=25)
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


def test_a_rank_the_garbage_collector_stops_longer_is_a_code_path_not_a_slower_device() -> None:
    """Rank 6 collects 1.4 ms a step longer than its peers (a clean-up its code calls, every few
    steps): CPU work in no operator, which without the hook's collection clock reads as a slower
    device. A window that caught the function its collections run in names that function; ranks
    that all collect alike are judged as before."""
    data = synthetic(slow={6: {"compute_us": 1500, "gc_us": 1400}})
    f = only(straggler.find(data, SETTINGS))
    assert (f.cause, f.ranks, f.function) == ("code_path", [6], cause.GARBAGE_COLLECTION)
    assert f.evidence["gc_ms_per_step"] == pytest.approx(1.4, abs=0.01)
    assert f.evidence["peer_gc_ms_per_step"] == 0
    assert "the garbage collector stopping it 1.4 ms per step" in f.summary
    common = [("op", "aten::addmm", 15, 10_000.0), ("python", "train.py(10): forward", 5, 20_000.0)]
    clean_up = [
        *common,
        ("python", "train.py(70): free_memory", 1, 7_000.0),
        ("pylib", "gc.collect", 1, 6_950.0),
    ]
    windows = functions_frame({r: clean_up if r == 6 else common for r in range(8)})
    f = only(straggler.find(replace(data, functions=windows), SETTINGS))
    assert (f.cause, f.function) == ("code_path", "train.py(70): free_memory")
    # A clean-up since mid-run, too mild for the peer rule: the change-point rule's account of it.
    since = synthetic(steps=800, slow={6: {"compute_us": 600, "gc_us": 500, "from": 500}})
    f = only(straggler.find(since, SETTINGS))
    assert (f.cause, f.function) == ("code_path", cause.GARBAGE_COLLECTION)
    assert f.evidence["ratio_before"] == pytest.approx(1.0, abs=0.01)
    assert 480 <= f.evidence["held_since_step"] <= 500  # from the chunk the change fell in
    alike = synthetic(slow={r: {"gc_us": 1400} for r in range(8)} | {6: {"compute_us": 1500, "gc_us": 1400}})
    assert only(straggler.find(alike, SETTINGS)).cause == "compute"


def test_dataloader_straggler() -> None:
    f = only(diagnose(synthetic(slow={2: {"data_us": 2000}})).findings)
    assert (f.cause, f.ranks) == ("dataloader", [2])
    assert f.evidence["data_wait_ms"] > 2 * f.evidence["peer_data_wait_ms"]


def test_intermittent_stalls_and_bursts_are_stragglers_though_their_median_step_is_healthy() -> None:
    # A 20 ms data-loader stall on every 20th step: the median step of rank 4 is its peers'.
    f = only(diagnose(synthetic(slow={4: {"data_us": 20_000, "on": 1, "off": 19}})).findings)
    assert (f.cause, f.ranks) == ("dataloader", [4])
    assert f.evidence["data_wait_ms"] == pytest.approx(1.3, abs=0.2)  # mean per step: 20 ms / 20 + 0.3
    # Compute 1.5x slower in bursts of 25 steps, 25 steps apart.
    f = only(diagnose(synthetic(slow={2: {"compute_us": 2500, "on": 25, "off": 25}})).findings)
    assert (f.cause, f.ranks) == ("compute", [2])
    assert f.evidence["ratio"] == pytest.approx(1.23, abs=0.05)


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


def test_a_rank_slower_in_every_chunk_of_few_steps_is_found_on_the_chunks_taken_together() -> None:
    """8 ranks, 90 long steps: each chunk holds 13 of them, and the ranks' chunk means spread by
    ~5% (each step's own time varies by 15%, as on shared cores). From the start rank 5 blocks
    ~18% longer a step, off the CPU: above the ratio in most chunks, beyond the deviations in some
    (the chunks alone found it in 2 of these 6 jobs); its chunks taken together stand far out. No
    rank of a healthy job does, one 6% slower by its cores included."""
    for seed in range(6):
        rng = np.random.default_rng(seed)
        healthy = synthetic(steps=90, seed=seed, bias={2: 1.06})
        assert slower_than_peers(_off_cpu_spread(healthy, rng)) == []
        slow = _off_cpu_spread(synthetic(steps=90, seed=seed, slow={5: {"compute_us": 900}}), rng)
        assert [st.rank for st in slower_than_peers(slow)] == [5], seed


def _off_cpu_spread(data: JobData, rng: np.random.Generator) -> pd.DataFrame:
    """Steps whose own time varies 15% a step, and no CPU time: the CPU-time rule sees nothing."""
    st = data.steps.assign(cpu_us=0.0)
    own = (st["dur_us"] - st["comm_us"]) * rng.lognormal(0, 0.15, len(st))
    dur = np.maximum(st["dur_us"], own + 50)
    return st.assign(dur_us=dur, comm_us=dur - own)
