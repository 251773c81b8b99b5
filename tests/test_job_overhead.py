"""``benchmarks.overhead.job``: what it reads from a job's output and spool, and its figures, on
made-up runs (its real runs take minutes a job)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.overhead import blocks
from benchmarks.overhead import job as job_overhead
from rankscope.wire.records import Heartbeat, RankInfo, WindowSummary, encode


def test_the_loop_figures_come_from_rank_0s_train_line_or_the_demo_jobs_done_line() -> None:
    out = "step 50 loss 6.3\ntrain: 150 steps in 36.12 s (240.80 ms/step)\nrankscope: closed\n"
    assert job_overhead.parse_train_line(out) == {"steps": 150, "loop_s": 36.12, "ms_per_step": 240.8}
    assert job_overhead.parse_train_line("done: 736 steps in 80.0 s (108.7 ms/step)")["steps"] == 736
    with pytest.raises(ValueError, match="no 'train: N steps"):
        job_overhead.parse_train_line("Traceback (most recent call last):\n  RuntimeError: boom")


def test_a_ranks_windows_are_its_last_heartbeats_count_and_cost_and_their_share_of_its_records_span(
    tmp_path: Path,
) -> None:
    t0 = 1_700_000_000_000_000
    base = {"job": "j", "host": "h"}
    recs = [
        RankInfo(**base, rank=0, time_us=t0, local_rank=0, world_size=2),
        Heartbeat(**base, rank=0, time_us=t0 + 5_000_000, step=9, progress_age_s=0.1, windows=1,
                  window_cost_us=90_000),
        Heartbeat(**base, rank=0, time_us=t0 + 10_000_000, step=19, progress_age_s=0.1, windows=2,
                  window_cost_us=200_000),
        WindowSummary(**base, rank=0, time_us=t0 + 6_000_000, window=5, step_lo=5, step_hi=10, dur_us=1,
                      busy={}, n_events=1, functions=()),
        RankInfo(**base, rank=1, time_us=t0, local_rank=1, world_size=2),
        Heartbeat(**base, rank=1, time_us=t0 + 4_000_000, step=9, progress_age_s=0.1),
    ]  # fmt: skip
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "h-rank0-1.jsonl").write_bytes(b"".join(encode(r)[1] + b"\n" for r in recs[:4]))
    torn = b'{"v"'  # a line cut short by the rank's end
    (tmp_path / "j" / "h-rank1-2.jsonl").write_bytes(b"".join(encode(r)[1] + b"\n" for r in recs[4:]) + torn)
    ranks = job_overhead.spool_windows(tmp_path)
    assert ranks[0] == {
        "windows": 2, "window_cost_us": 200_000, "window_records": 1, "span_s": 10.0, "share_pct": 2.0
    }  # fmt: skip
    assert ranks[1]["windows"] == 0 and ranks[1]["window_records"] == 0 and ranks[1]["span_s"] == 4.0


def test_a_jobs_figures_pair_each_run_with_the_hook_with_one_without() -> None:
    def run(hook: bool, ms: float, windows: int | None = 2) -> dict:
        ranks = {r: {"windows": windows, "window_cost_us": 100_000, "window_records": 2, "span_s": 10.0,
                     "share_pct": 1.0} for r in range(4)}  # fmt: skip
        return {"hook": hook, "ms_per_step": ms, "steps": 100, "loop_s": ms / 10, "wall_s": 60.0,
                "ranks": ranks}  # fmt: skip

    # The hook's runs are 1%, 2% ... 5% slower than their partners; the machine drifts between pairs.
    offs = [100, 104, 98, 101, 99]
    runs = [r for i, off in enumerate(offs) for r in (run(False, off), run(True, off * (1.01 + i / 100)))]
    row = job_overhead.figures(runs)
    assert (
        row["pairs"] == 5 and row["off_ms_per_step"] == 100 and row["median_pair_pct"] == pytest.approx(3.0)
    )
    assert row["on_ms_per_step"] == 103.95 and row["ratio_pct"] == pytest.approx(3.95)
    low, high = row["ratio_ci95_pct"]
    assert low < 3.95 < high
    assert row["windows"] == [2] * 4 and row["window_ms"] == 50.0 and row["windows_share_pct"] == [1.0] * 4
    # A hook that does not send the window fields: no count, no cost per window; its records still count.
    old = job_overhead.figures([run(True, 101, None), run(False, 100, None)])
    assert old["windows"] == [None] * 4 and old["window_ms"] is None and old["window_records"] == [2] * 4


def test_in_run_blocks_alternate_in_pairs_and_a_working_block_goes_on_while_a_window_is_busy() -> None:
    class FakeHook:
        def __init__(self) -> None:
            self._prof, self._summarizers, self.calls = None, [], []

        def pause(self) -> None:
            self.calls.append("pause")

        def resume(self) -> None:
            self.calls.append("resume")

    class OneRank(blocks.Blocks):
        """One rank: the agreement is its own value."""

        @staticmethod
        def _most(value: float) -> float:
            return value

    hook = FakeHook()
    b = OneRank(hook, Path("unused"), start_steps=30, block_s=1e-9)  # blocks of 3 steps, the least
    for _ in range(30):
        b.ended()
    assert b.n == 3 and hook.calls == ["resume"]
    for _ in range(12):  # on, off; then off again, the second pair's order reversed: each block's
        b.ended()  # first step, after the switch, untimed (SETTLING)
    hook._prof = object()  # a window opens in the fourth block (working): it goes on until it ends
    for _ in range(blocks.SETTLING + 6):
        b.ended()
    hook._prof = None
    for _ in range(3):
        b.ended()
    assert [(mode, steps) for mode, _, steps, *_ in b.blocks] == [
        ("on", 3),
        ("off", 3),
        ("off", 3),
        ("on", 9),
    ]
    assert all(len(block) == 5 and block[4] >= 0 for block in b.blocks)  # and the training thread's CPU time
    assert hook.calls == ["resume", "pause", "pause", "resume", "resume"]
    with pytest.raises(ValueError, match="more than 20 steps of warm-up"):
        OneRank(hook, Path("unused"), start_steps=blocks.WARM_TAIL, block_s=1.0)


def test_in_run_figures_take_each_pairs_slowest_rank_and_leave_out_a_block_without_its_partner() -> None:
    def rank(scale: float) -> dict:
        return {"steps_per_block": 10, "windows": 1, "window_cost_us": 50_000,
                "blocks": [["on", 1.02 * scale, 10, 0.9, 0.7], ["off", 1.0, 10, 0.8, 0.5], ["off", 1.0, 10, 0.8, 0.5],
                           ["on", 1.01, 10, 0.8, 0.6], ["on", 1.0, 10, 0.8, 0.6]]}  # fmt: skip

    run = {"job": "j", "loop_s": 5.0, "ranks": {0: {"share_pct": 0.4}, 1: {"share_pct": 0.5}},
           "blocks": [rank(1.0), rank(1.01)]}  # fmt: skip
    row = job_overhead.block_figures(run)
    assert row["pairs"] == 2 and row["pair_pct"] == pytest.approx([3.02, 1.0], abs=0.01)
    # CPU: both ranks' processes together per step, 1.8 s against 1.6 s, then 1.6 against 1.6
    assert row["cpu_ms_per_step"] == [160.0, 170.0] and row["cpu_pct"] == pytest.approx(6.25)
    # ...of which the training threads': 1.4 s against 1.0 s, then 1.2 against 1.0
    assert row["train_cpu_ms_per_step"] == [100.0, 130.0] and row["train_cpu_pct"] == pytest.approx(30.0)
    for r in run["blocks"]:  # a run kept before the threads' time was recorded: none
        r["blocks"] = [block[:4] for block in r["blocks"]]
    assert job_overhead.block_figures(run)["train_cpu_pct"] is None
    assert row["windows"] == [1, 1] and row["window_ms"] == 50.0 and row["windows_share_pct"] == [0.4, 0.5]
