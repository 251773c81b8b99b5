"""The fault suite: scoring on made-up diagnoses (fast), and the reduced suite on real jobs (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks.faults import scoring
from benchmarks.faults.catalogue import Fault, JobSpec
from benchmarks.faults.injectors import Fabric, Unavailable
from benchmarks.faults.scenarios import ScenarioError, load, load_all
from benchmarks.faults.workload import model_of, padding_rows
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


_BUSY = "import time\nend = time.monotonic() + {s}\nwhile time.monotonic() < end: pass"


def _watch_while(hogs: str, seconds: float = 3.0) -> dict[str, float] | None:
    """The machine's summary over 1.5 s as found, then ``seconds`` with four CPU-bound processes
    started ``hogs`` (``inside`` the harness's process tree, or ``outside`` it)."""
    import time

    from benchmarks import machine

    watch = machine.MachineWatch(every_s=0.1)
    watch.start()
    time.sleep(1.5)
    code = _BUSY.format(s=seconds)
    if hogs == "inside":
        procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(4)]
    else:  # the shell exits at once: its children belong to no process of this test
        cmd = " ".join(f"{sys.executable} -c '{code}' &" for _ in range(4))
        subprocess.run(["sh", "-c", cmd], check=True)
    time.sleep(seconds + 0.3)
    if hogs == "inside":
        for proc in procs:
            proc.wait()
    watch.stop()
    return machine.summary(watch.samples, end=time.time() - 0.5)


@pytest.mark.alone
def test_the_machine_watch_sees_other_processes_take_the_cores_but_not_the_job_itself() -> None:
    from benchmarks import machine

    outside = _watch_while("outside")
    assert outside is not None and outside["capacity"] >= machine.LOST, outside
    inside = _watch_while("inside")
    assert inside is not None and inside["capacity"] < machine.LOST, inside
    assert machine.summary([(0.0, 0.001, 2.0)] * 5) is None, "too few samples to tell"


def test_a_healthy_jobs_steps_needing_more_cpu_time_mean_its_machine_slowed() -> None:
    import pandas as pd

    from benchmarks import machine

    def steps(
        late: float, from_step: int = 40
    ) -> pd.DataFrame:  # 4 ranks x 60 steps; ``late`` x the CPU time
        return pd.DataFrame(
            [
                {"rank": r, "step": i, "cpu_us": 6000 * (late if i >= from_step else 1.0) + 10 * (i % 3)}
                for r in range(4)
                for i in range(60)
            ]
        )

    steady = {"reference": 1.0, "capacity": 1.0}
    assert machine.work(steps(1.0)) == pytest.approx(1.0, abs=0.01)
    assert not machine.slowed({**steady, "work": machine.work(steps(1.0))})
    assert machine.work(steps(1.2)) == pytest.approx(1.2, abs=0.01)
    assert machine.slowed({**steady, "work": machine.work(steps(1.2))})
    assert machine.work(steps(1.2).query("step < 20")) is None, "too few steps a rank to tell"
    # Slower from a quarter into the run on: the job's start against its end, as job_wide reads it.
    assert machine.work(steps(1.2, from_step=15)) == pytest.approx(1.2, abs=0.01)


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


def test_every_scenario_file_loads_and_the_ci_suite_is_small() -> None:
    full = load_all("full")
    assert len(full) >= 15
    kinds = {s.fault.kind for s in full}
    assert kinds >= {
        "none",
        "compute",
        "dataloader",
        "host",
        "nic",
        "switch",
        "hang",
        "code_path",
        "job_wide",
    }
    ci = load_all("ci")
    assert 3 <= len(ci) <= 6 and any(s.truth.healthy for s in ci)
    # The validation split: its own scenarios, healthy ones among them, none of the tuning set's.
    held_out = load_all("validation")
    assert (
        held_out and {s.split for s in held_out} == {"validation"} and {s.split for s in full} == {"tuning"}
    )
    assert any(s.truth.healthy for s in held_out) and not {s.name for s in held_out} & {s.name for s in full}
    # The soak suite: healthy jobs of many minutes, in none of the others.
    soak = load_all("soak")
    assert soak and all(s.split == "soak" and s.truth.healthy and s.seconds >= 600 for s in soak)
    assert not {s.name for s in soak} & {s.name for s in full + held_out}


def test_a_bad_scenario_is_refused_with_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "world_size: 4\nfault: {kind: compute, rank: 9, onset_s: 5}\nexpect: {cause: compute, ranks: [9]}\n"
    )
    with pytest.raises(ScenarioError, match="outside"):
        load(bad)
    bad.write_text("fault: {kind: nic, rank: 1}\nexpect: {cause: communication, ranks: [1]}\n")
    with pytest.raises(ScenarioError, match="rate_mbit"):
        load(bad)


CLEAR_CUT = ("compute", "dataloader", "hang-collective")
"""Fault kinds the diagnosis localizes today; the CI run asserts on these and reports the rest."""


@pytest.mark.alone  # the padding is found by timing the model
def test_a_slow_device_pads_more_rows_the_slower_it_is_and_leaves_no_gradients() -> None:
    import torch

    torch.manual_seed(0)
    model, x = model_of(256), torch.randn(32, 128)
    assert padding_rows(model, x, 1.0) == 0
    mild, heavy = padding_rows(model, x, 1.5), padding_rows(model, x, 3.0)
    assert 1 <= mild < heavy, (mild, heavy)
    assert mild >= 16 and heavy >= 64, (mild, heavy)  # never below (factor - 1) of the 32 rows
    assert all(p.grad is None for p in model.parameters()), "the timing runs must not leak into training"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_reduced_suite_on_real_jobs(tmp_path: Path) -> None:
    from benchmarks.faults.suite import report, run_suite

    out = run_suite(load_all("ci"), tmp_path)
    print(report(out["scenarios"]))
    ran = [r for r in out["scenarios"] if "skipped" not in r]
    assert ran, out["skipped"]
    for r in ran:
        assert not r["error"], (r["name"], r["error"])
        assert not r["cleanup_errors"], (r["name"], r["cleanup_errors"])
        s = r["score"]
        if s["healthy"]:
            # Findings are explained (not false) when the harness measured the machine itself slow down.
            assert s["false_findings"] == 0, (r["name"], r["machine"], [d["summary"] for d in s["detail"]])
            # ...and at every probe as ``rankscope serve`` diagnoses it, nobody would be paged.
            a = r["alarms"]
            assert a["false_tickets"] == 0 or a["excused"], (r["name"], r["machine"], r["probes"])
        elif r["kind"] in CLEAR_CUT:
            # The whole diagnosis, evidence and all, so that a wrong answer in CI can be understood.
            assert s["top_correct"], (r["name"], r["ground_truth"], json.dumps(r["diagnosis"], indent=1))
            assert r["delays"]["localize_s"] is not None, r["name"]
    totals = out["totals"]
    assert totals["healthy_false_findings"] == 0
    assert set(totals) >= {"top1_accuracy", "precision", "recall", "healthy_false_findings"}
    # The kept runs scored again (--rescore) give the same scores and delays as when they ran.
    again = run_suite(load_all("ci"), tmp_path, rescore=True)
    assert [
        (r["name"], r["score"], r["delays"], r["alarms"]) for r in again["scenarios"] if "skipped" not in r
    ] == [(r["name"], r["score"], r["delays"], r["alarms"]) for r in ran]


_RECEIVE = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
while conn.recv(1 << 20):
    pass
"""
_SEND = """
import socket, sys, time
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as s:
    t = time.perf_counter()
    s.sendall(b"x" * (4 << 20))
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # the receiver closes once it has read everything
    print(time.perf_counter() - t)
"""


def _transfer_s(fabric: Fabric, src_host: int, dst_host: int) -> float:
    """Seconds to move 4 MB from one simulated host to another, through the fabric."""
    ns, ip = fabric.netns, fabric.ip
    rx = subprocess.Popen(
        ["ip", "netns", "exec", ns[dst_host], sys.executable, "-c", _RECEIVE, ip[dst_host]],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rx.stdout is not None
        port = rx.stdout.readline().strip()
        out = subprocess.run(
            ["ip", "netns", "exec", ns[src_host], sys.executable, "-c", _SEND, ip[dst_host], port],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return float(out.stdout)
    finally:
        rx.kill()
        rx.wait()


def test_the_fabric_limits_only_the_faulty_switch_uplink_and_leaves_nothing_behind() -> None:
    # Six hosts on three switches (two each); sw1's uplink is limited to 16 Mbit/s (2 MB/s) at onset.
    spec = JobSpec(job="fabric", world_size=6, hosts=6, switches=3)
    try:
        fabric = Fabric(spec, "switch", (2, 3), 16)
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        fields = fabric.setup()
        assert fields["ifname"][2] != fields["ifname"][3] and fields["netns"][0] != fields["netns"][1]
        assert _transfer_s(fabric, 1, 2) < 1.0  # fast before onset
        fabric.start()
        assert _transfer_s(fabric, 1, 2) > 1.2  # 4 MB at 2 MB/s: sw0 -> sw1 crosses the slow uplink
        assert _transfer_s(fabric, 2, 3) < 1.0  # within sw1: not through its uplink
        assert _transfer_s(fabric, 0, 5) < 1.0  # sw0 -> sw2: through the spine, not sw1's uplink
    finally:
        errors = fabric.cleanup()
    assert errors == []
    left = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert not [n for n in fabric.netns.values() if n in left]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [n for n in fabric.netns.values() if n in namespaces]


def test_a_link_fault_limits_the_two_hosts_traffic_with_each_other_and_no_other() -> None:
    # Four hosts, a rank each; the link between hosts 2 and 3 limited to 16 Mbit/s (2 MB/s) both ways.
    spec = JobSpec(job="fabric", world_size=4, hosts=4)
    try:
        fabric = Fabric(spec, "link", (2, 3), 16)
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        fabric.setup()
        assert _transfer_s(fabric, 2, 3) < 1.0  # fast before onset
        fabric.start()
        assert _transfer_s(fabric, 2, 3) > 1.2 and _transfer_s(fabric, 3, 2) > 1.2  # 4 MB at 2 MB/s
        assert _transfer_s(fabric, 2, 0) < 1.0 and _transfer_s(fabric, 1, 3) < 1.0  # each end's others
    finally:
        assert fabric.cleanup() == []


def test_fault_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="unknown fault"):
        Fault(kind="cosmic-ray")
