"""How the fault suite scores a run, on made-up diagnoses: findings right, wrong or a false extra,
every probe as the service would see it, what a slowed machine explains, and the delays."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.faults import scoring
from rankscope.diagnosis.findings import Diagnosis, Finding


def _finding(cause: str, ranks: list[int], confidence: float = 0.8, scope: str = "rank") -> Finding:
    return Finding(
        cause=cause, ranks=ranks, hosts=[], function="f", confidence=confidence, summary="", scope=scope
    )


def test_score_names_right_and_wrong_findings() -> None:
    truth = scoring.GroundTruth(kind="compute", cause="compute", ranks=(2,))
    right = scoring.score(
        truth, Diagnosis(job="j", findings=[_finding("compute", [2]), _finding("dataloader", [1])])
    )
    assert right.top_correct and right.top_located and right.any_correct
    assert (right.correct_findings, right.false_findings) == (1, 1)
    wrong_cause = scoring.score(truth, Diagnosis(job="j", findings=[_finding("host_contention", [2])]))
    assert not wrong_cause.top_correct and wrong_cause.top_located
    missed = scoring.score(truth, Diagnosis(job="j", findings=[]))
    assert not missed.top_correct and missed.confidence == 0.0


def test_a_finding_on_a_rank_or_host_that_is_no_culprit_is_a_false_extra_finding() -> None:
    """The host hog's companion: the right host named, and a second finding on the healthy host's
    ranks, who only waited. A wrong cause on the culprit is wrong, but no companion."""
    truth = scoring.GroundTruth(
        kind="host", cause="host_contention", ranks=(2, 3), scope="host", where="hostB"
    )
    findings = [
        _finding("host_contention", [2, 3], scope="host"),
        _finding("compute", [0, 1], scope="host"),
        _finding("compute", [3]),
        _finding("job_wide", [0, 1, 2, 3], scope="job"),
    ]
    s = scoring.score(truth, Diagnosis(job="j", findings=findings))
    assert s.top_correct and (s.false_findings, s.companions) == (3, 2)
    two = replace(truth, also=scoring.GroundTruth(kind="compute", cause="compute", ranks=(0,)))
    assert scoring.score(two, Diagnosis(job="j", findings=findings)).companions == 2  # [0, 1]: 1 is none
    job_wide = scoring.GroundTruth(kind="job_wide", cause="job_wide", scope="job", ranks=(0, 1, 2, 3))
    assert scoring.score(job_wide, Diagnosis(job="j", findings=findings)).companions == 0
    healthy = scoring.score(scoring.GroundTruth(kind="healthy"), Diagnosis(job="j", findings=findings[:2]))
    assert healthy.companions == 2
    assert scoring.totals([s, healthy])["false_extra_findings"] == 4


def test_job_wide_and_healthy_truths() -> None:
    job_wide = scoring.GroundTruth(kind="job_wide", cause="job_wide", scope="job")
    s = scoring.score(
        job_wide, Diagnosis(job="j", findings=[_finding("job_wide", [0, 1, 2, 3], scope="job")])
    )
    assert s.top_correct
    healthy = scoring.GroundTruth(kind="healthy")
    h = scoring.score(healthy, Diagnosis(job="j", findings=[_finding("compute", [1])]))
    assert h.healthy and h.false_findings == 1 and not h.top_correct
    totals = scoring.totals([s, h])
    assert totals["top1_accuracy"] == 1.0 and totals["healthy_false_findings"] == 1
    assert totals["precision"] == 0.5 and totals["recall"] == 1.0
    # Latencies: overall, and the slowdowns' and the hangs' apart (a hang takes 30 s by definition).
    hang = scoring.score(
        scoring.GroundTruth(kind="hang-python", cause="hang", ranks=(2,)),
        Diagnosis(job="j", findings=[_finding("hang", [2])]),
    )
    delays = [scoring.Delays(localize_s=8.0), scoring.Delays(), scoring.Delays(localize_s=34.0)]
    totals = scoring.totals([s, h, hang], delays)
    assert totals["p90_localize_s"] == 34.0
    assert (totals["p90_localize_slowdowns_s"], totals["max_localize_hangs_s"]) == (8.0, 34.0)


def test_every_probe_is_scored_as_the_service_would_see_it() -> None:
    """A finding before the onset is a false alarm; localization counts from when the right top
    finding holds to the end, not from the first probe that had it."""
    truth = scoring.GroundTruth(kind="compute", cause="compute", ranks=(2,))

    def probe(at: float, *findings: Finding) -> scoring.Probe:
        return scoring.Probe(
            after_s=at, after_steps=int(at * 10), diagnosis=Diagnosis(job="j", findings=list(findings))
        )

    right, wrong = _finding("compute", [2]), _finding("compute", [1])
    probes = [
        probe(-4.0),
        probe(-2.0, wrong),
        probe(0.0),
        probe(2.0, right),  # found, then lost to a rank that is no culprit, then found for good
        probe(4.0, wrong, right),
        probe(6.0, right, wrong),
        probe(8.0, right),
    ]
    d = scoring.delays(truth, probes)
    assert (d.detect_s, d.localize_s, d.stable_s, d.stable_steps, d.flaps) == (2.0, 2.0, 6.0, 60, 1)
    a = scoring.alarms(truth, probes)
    assert (a.probes, a.false, a.first_s, a.extra) == (3, 1, -2.0, 2)
    assert not a.excused and scoring.alarms(truth, probes, machine_slowed=True).excused
    # Not right at the end: never stable, however early it was found.
    assert scoring.delays(truth, [*probes[:-1], probe(8.0, wrong)]).stable_s is None
    # A healthy run: every probe is watched.
    h = scoring.alarms(scoring.GroundTruth(kind="healthy"), probes)
    assert (h.probes, h.false, h.first_s, h.extra) == (7, 5, -2.0, 0)
    totals = scoring.totals([scoring.score(truth, probes[-1].diagnosis)], [d], [a])
    assert (totals["false_alarm_probes"], totals["false_alarm_runs"], totals["flapping_runs"]) == (1, 1, 1)
    assert totals["median_stable_s"] == 6.0


def test_findings_on_a_healthy_run_are_explained_only_if_the_machine_slowed() -> None:
    healthy = scoring.GroundTruth(kind="healthy")
    found = Diagnosis(job="j", findings=[_finding("job_wide", [0, 1], scope="job"), _finding("compute", [1])])
    steady = scoring.score(healthy, found)
    assert (steady.false_findings, steady.explained) == (2, 0)
    slowed = scoring.score(healthy, found, machine_slowed=True)
    assert (slowed.false_findings, slowed.explained) == (0, 2)
    totals = scoring.totals([slowed])
    assert totals["healthy_false_findings"] == 0 and totals["healthy_explained_findings"] == 2
    assert totals["precision"] is None, "explained findings are neither right nor wrong"
    fault = scoring.score(
        scoring.GroundTruth(kind="compute", cause="compute", ranks=(2,)), found, machine_slowed=True
    )
    assert (fault.false_findings, fault.explained) == (2, 0), "on a fault run nothing is explained away"


def test_two_faults_and_the_function_named() -> None:
    truth = scoring.GroundTruth(
        kind="two-faults",
        cause="compute",
        ranks=(1,),
        function=("forward",),
        also=scoring.GroundTruth(kind="two-faults", cause="dataloader", ranks=(3,), function=("read",)),
    )
    named = lambda cause, ranks, fn: replace(_finding(cause, ranks), function=fn)  # noqa: E731
    both = scoring.score(
        truth,
        Diagnosis(job="j", findings=[named("dataloader", [3], "x.py(3): read"), named("compute", [1], "op")]),
    )
    assert both.top_correct and both.top_located and both.both_found and both.function_ok
    assert both.false_findings == 0
    one = scoring.score(truth, Diagnosis(job="j", findings=[named("compute", [1], "aten::mm")]))
    assert one.top_correct and one.both_found is False and one.function_ok is False
    wrong = scoring.score(truth, Diagnosis(job="j", findings=[named("compute", [3], "forward")]))
    assert not wrong.top_correct and wrong.top_located  # rank 3 is faulty, but not a compute fault
    # Where only one of the two faults expects a function, naming the other is no function to score.
    unnamed = replace(truth, function=())
    assert (
        scoring.score(unnamed, Diagnosis(job="j", findings=[named("compute", [1], "op")])).function_ok is None
    )
    assert (
        scoring.score(unnamed, Diagnosis(job="j", findings=[named("dataloader", [3], "q")])).function_ok
        is False
    )
    totals = scoring.totals([both, one])
    assert totals["function_accuracy"] == 0.5


def test_delays_take_the_first_probe_that_is_right() -> None:
    truth = scoring.GroundTruth(kind="compute", cause="compute", ranks=(1,))
    d = lambda *fs: Diagnosis(job="j", findings=list(fs))  # noqa: E731
    probes = [
        scoring.Probe(after_s=2, after_steps=100, diagnosis=d()),
        scoring.Probe(after_s=4, after_steps=200, diagnosis=d(_finding("dataloader", [1]))),
        scoring.Probe(after_s=6, after_steps=300, diagnosis=d(_finding("compute", [1]))),
    ]
    got = scoring.delays(truth, probes)
    assert (got.detect_s, got.detect_steps, got.localize_s, got.localize_steps) == (4, 200, 6, 300)
    assert scoring.delays(truth, probes[:1]).localize_s is None
