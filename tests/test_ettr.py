"""A job's ETTR measured from its records (``diagnosis.ettr``): every second of the wall clock in one bucket."""

from __future__ import annotations

from dataclasses import replace

import pandas as pd
import pytest

from rankscope.diagnosis.ettr import (
    CAUSES,
    RunRecords,
    failing_hosts,
    failures_by_class,
    measure,
    observed_failure_rate,
)
from rankscope.preflight.verdict import host_verdicts, judge
from rankscope.renderers.text import format_failing_hosts
from rankscope.wire.errors import NotFoundError

S = 1_000_000  # µs


def _run(*, hung_s: float = 0.0, checkpoints: bool = True, warmup_s: float = 0.0) -> RunRecords:
    """Attempt 0 trains steps 0-79 at 0.1 s (a 1 s checkpoint save inside step 49, holding step 50)
    and dies; its rank shipped steps up to 75, its heartbeat saw step 79. Attempt 1 starts 15 s
    after that progress, loads the checkpoint (5 s, inside its first step) and trains steps 50-149,
    step 100 taking 0.3 s. The store keeps attempt 0's steps 0-49 and attempt 1's 50-149."""
    rows, t = [], 0
    for s in range(80):
        d = 0.1 * S + (S if checkpoints and s == 49 else 0) + (warmup_s * S if s == 0 else 0)
        if s < 76:
            rows.append((s, t, d))
        t += d
    end0 = t
    beats = [(end0 + 2 * S, 79, 2.0)] + ([(end0 + hung_s * S, 79, hung_s)] if hung_s else [])
    start1 = end0 + 15 * S
    t = start1
    steps1 = []
    for s in range(50, 150):
        d = 0.1 * S + (5 * S if checkpoints and s == 50 else 0) + (0.2 * S if s == 100 else 0)
        steps1.append((s, t, d))
        t += d
    kept = [r for r in rows if r[0] < 50] + steps1
    save = (4.95 + warmup_s) * S  # inside step 49
    ck = [("save", 50, 0, save, save + S, S, 1), ("load", -1, 1, start1, start1 + 5 * S, 5 * S, 1)]
    return RunRecords(
        job="j",
        rank=0,
        steps=pd.DataFrame(kept, columns=["step", "start_us", "dur_us"]),
        attempts=pd.DataFrame(
            [(r, f"h{r}", a, at + r) for a, at in enumerate((0, start1)) for r in range(2)],
            columns=["rank", "host", "attempt", "time_us"],
        ),
        checkpoints=pd.DataFrame(
            ck if checkpoints else [],
            columns=["kind", "step", "attempt", "start_us", "end_us", "dur_us", "ranks"],
        ),
        progress=pd.DataFrame(beats, columns=["time_us", "step", "progress_age_s"]),
    )


def test_a_restarted_job_puts_every_second_in_one_bucket() -> None:
    r = measure(_run())
    assert r.wall_s == pytest.approx(5 + 1 + 3 + 15 + 5 + 10 + 0.2)
    assert r.productive_s == pytest.approx(150 * 0.1)
    assert r.lost_s["redo"] == pytest.approx(3.0), "steps 50-79 were done twice"
    assert r.lost_s["restart"] == pytest.approx(15 + 5), "the gap, and the checkpoint load"
    assert r.lost_s["checkpoint"] == pytest.approx(1.0)
    assert r.lost_s["slowdown"] == pytest.approx(0.2)
    assert r.lost_s["hang"] == r.lost_s["startup"] == 0 and r.lost_s["other"] == pytest.approx(0, abs=1e-3)
    assert r.productive_s + sum(r.lost_s.values()) == pytest.approx(r.wall_s)
    assert r.ettr == pytest.approx(15 / r.wall_s, abs=1e-4)
    first, second = r.attempts
    assert (first.first_step, first.last_step, first.redone_steps) == (0, 79, 30)
    assert first.restart_s == pytest.approx(20), "the gap, and the next attempt's load"
    assert second.first_step == 50 and second.restart_s == 0
    assert r.steps == 150 and r.nodes == 2 and r.baseline_step_s == pytest.approx(0.1)
    assert (r.saves, r.loads, r.write_s, r.interval_s) == (1, 1, 1.0, None)
    assert r.restart_s == pytest.approx(20), "u0 as measured"
    assert r.expected_ettr is None, "one checkpoint: no interval to project with"


def _exits(rows: list[tuple[int, int, str, str, str]]) -> pd.DataFrame:
    """Exit records: (rank, time_us, how, error, message)."""
    return pd.DataFrame(
        [
            {"rank": r, "time_us": t, "how": how, "error": e, "message": m, "step": 79, "attempt": 0, "frame": "",
             "signal": 15 if how == "signal" else 0}
            for r, t, how, e, m in rows
        ]
    )  # fmt: skip


def test_each_failed_attempt_names_its_first_failing_rank_and_the_time_lost_by_class() -> None:
    """Rank 1 raised a CUDA error first; rank 0's all-reduce raised after it (a peer died): the
    attempt's failure is rank 1's, a GPU hardware fault, and the time it lost (the work redone
    and the restart) is put down to that class."""
    run = _run()
    end0 = 8.8 * S
    crashed = replace(
        run,
        exits=_exits(
            [
                (0, int(end0 + 1 * S), "exception", "DistBackendError", "Connection closed by peer"),
                (
                    1,
                    int(end0),
                    "exception",
                    "RuntimeError",
                    "CUDA error: an illegal memory access was encountered",
                ),
                (0, int(40 * S), "close", "", ""),
                (1, int(40 * S), "close", "", ""),
            ]
        ),
    )
    r = measure(crashed)
    first, second = r.attempts
    assert (first.failed_rank, first.failure) == (1, "gpu_hardware") and "illegal memory" in first.error
    assert (second.failed_rank, second.failure) == (-1, ""), "it closed normally"
    assert r.failures == {"gpu_hardware": 1}
    assert r.lost_by_failure["gpu_hardware"] == pytest.approx(first.redo_s + first.hang_s + first.restart_s)
    # Rank 1 killed without a word (SIGKILL): only rank 0's peer-death and torchrun's stop are left.
    killed = replace(
        run,
        exits=_exits([(0, int(end0 + 1 * S), "exception", "DistBackendError", "Connection reset by peer")]),
    )
    first = measure(killed).attempts[0]
    assert (first.failed_rank, first.failure) == (1, "killed")
    # No exit records at all (hooks before them): the restart is a failure of unknown cause.
    r = measure(run)
    assert r.attempts[0].failure == "unknown" and any("how its process ended" in n for n in r.notes)


def test_a_host_whose_gpu_failed_two_jobs_is_a_lemon_node() -> None:
    """Rank 1 on host h1 fails with a GPU fault in two jobs: h1 is a lemon; rank 1 of a third job,
    failing in its own code, names h1 again but no more hardware."""
    gpu = (
        1,
        int(8.8 * S),
        "exception",
        "RuntimeError",
        "CUDA error: an illegal memory access was encountered",
    )
    code = (1, int(8.8 * S), "exception", "ValueError", "bad batch")
    runs = [
        measure(replace(_run(), job=j, exits=_exits([e]))) for j, e in (("a", gpu), ("b", gpu), ("c", code))
    ]
    assert runs[0].attempts[0].failed_host == "h1"
    (h1,) = failing_hosts(runs)
    assert (h1.host, h1.failures, h1.jobs, h1.lemon) == (
        "h1",
        {"gpu_hardware": 2, "code": 1},
        ["a", "b", "c"],
        True,
    )
    assert not failing_hosts(runs[:1])[0].lemon, "one failure is no pattern"
    # Beside its preflight's verdicts: h1's link out was slow, then its GPU failed the check.
    nodes = [
        {"rank": r, "node": f"h{r}", "matmul_gflops": 100.0, "memory_gbps": 10.0, "send_gbps": 1.0}
        for r in range(3)
    ]
    slow_link = judge([{**n, "send_gbps": 0.2} if n["node"] == "h1" else n for n in nodes], 1.0).to_dict()
    gpu_error = judge(
        [{**n, "gpu_errors": ["XID 79"]} if n["node"] == "h1" else n for n in nodes], 1.0
    ).to_dict()
    said = host_verdicts([slow_link, gpu_error])
    assert said == {"h0": "passed", "h1": "failed: gpu: XID 79", "h2": "passed"}
    assert host_verdicts([slow_link])["h2"].startswith("failed: link: the link h1 -> h2 alone reaches 0.20x")
    text = format_failing_hosts([replace(h1, preflight=said["h1"])], [])
    assert text.splitlines()[1].endswith("LEMON: cordon it and check its GPUs  preflight failed: gpu: XID 79")
    # Per class over the fleet's node-days: one node fails of a GPU fault every half of them.
    node_days = sum(r.nodes * r.wall_s for r in runs) / 86_400
    assert [(c.failure, c.failures) for c in failures_by_class(runs)] == [("gpu_hardware", 2), ("code", 1)]
    assert [c.mttf_node_days for c in failures_by_class(runs)] == pytest.approx([node_days / 2, node_days])


def test_ranks_alive_without_progress_before_the_restart_count_as_a_hang() -> None:
    r = measure(_run(hung_s=12, warmup_s=11))
    assert r.lost_s["hang"] == pytest.approx(12), "the first step's 11 s are start-up, not a hang"
    assert r.lost_s["startup"] == pytest.approx(11)
    assert r.lost_s["restart"] == pytest.approx(3 + 5)
    assert r.productive_s + sum(r.lost_s.values()) == pytest.approx(r.wall_s)


def test_a_job_without_checkpoints_or_restarts_says_so() -> None:
    one = _run(checkpoints=False)
    only = RunRecords(
        job="j",
        rank=0,
        steps=one.steps[one.steps["step"] < 50],
        attempts=one.attempts[one.attempts["attempt"] == 0],
        checkpoints=one.checkpoints,
        progress=one.progress.iloc[:0],
    )
    r = measure(only, restart_s=600)
    assert r.ettr == pytest.approx(1.0) and set(r.lost_s) == set(CAUSES)
    assert any("no checkpoints seen" in n for n in r.notes) and any("no restarts seen" in n for n in r.notes)
    assert r.expected_ettr is None and r.mttf_s == pytest.approx(86_400 / (2 * 6.5e-3))
    with pytest.raises(NotFoundError, match="no steps"):
        measure(
            RunRecords(
                job="j",
                rank=0,
                steps=only.steps.iloc[:0],
                attempts=only.attempts,
                checkpoints=only.checkpoints,
                progress=only.progress,
            )
        )


def test_the_failure_rate_a_store_observed_is_its_restarts_over_its_node_days() -> None:
    run = _run()
    restarted = measure(run)
    first = run.attempts["attempt"] == 0
    single = measure(replace(run, steps=run.steps.iloc[:40], attempts=run.attempts[first]))
    rate, failures, node_days = observed_failure_rate([restarted, single])
    assert failures == 1 and node_days == pytest.approx((2 * restarted.wall_s + 2 * single.wall_s) / 86_400)
    assert rate == pytest.approx(1 / node_days)
    assert observed_failure_rate([single]) == (None, 0, pytest.approx(2 * single.wall_s / 86_400))
