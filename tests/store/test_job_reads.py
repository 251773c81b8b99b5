"""What a diagnosis reads of a job from a real chDB store: its last steps and the windows since the
first, only what the store gained since the last read, blocks of steps as their steps, and a large
job's steps in buckets the store sums up."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pandas as pd
import pytest

from rankscope.aggregator import Store
from rankscope.aggregator.reads import STEP_COLUMNS
from rankscope.diagnosis import diagnose, read_job
from rankscope.diagnosis.data import LOOKBACK_STEPS, STEP_FIELDS, RecentJob
from rankscope.diagnosis.diagnose import Settings as diagnose_settings
from rankscope.wire.records import StepBatch, StepRow
from tests.jobdata import only
from tests.store.builders import (
    JOB,
    T0,
    all_records,
    heartbeat,
    rank_info,
    step_row,
    steps,
    window,
)


def test_a_jobs_read_holds_its_last_steps_and_the_windows_since_the_first(store: Store) -> None:
    """``read_job`` reads a job's last ``last_steps`` steps (``LOOKBACK_STEPS`` by default: a
    job's whole history grows without end), and the windows taken since the first of them."""
    store.write([*all_records(), window(0, 0), window(1, 0)])  # steps 0-7; windows at 0, 1 and 2 s
    whole = read_job(store, JOB, last_steps=None)
    assert sorted(whole.steps["step"].unique()) == list(range(8))
    assert set(whole.spans()["window"]) == {0, 1, 2}
    cut = read_job(store, JOB, last_steps=3)
    assert sorted(cut.steps["step"].unique()) == [5, 6, 7]
    assert int(cut.steps["start_us"].min()) > T0  # window 0, taken at T0, is older
    assert set(cut.spans()["window"]) == {1, 2}
    assert set(cut.functions_of([0, 1])["window"]) == {1, 2}
    assert read_job(store, JOB, last_steps=8).steps.equals(whole.steps)
    assert read_job(store, JOB).steps.equals(whole.steps)  # shorter than LOOKBACK_STEPS
    assert store.last_step(JOB) == 7 and store.last_step("no such job") is None


def test_the_default_read_reaches_back_as_far_as_every_detector_looks() -> None:
    s = diagnose_settings()
    assert s.straggler.steps.shift_steps + s.straggler.steps.warmup_steps <= LOOKBACK_STEPS
    assert s.straggler.steps.last_steps + s.straggler.steps.warmup_steps <= LOOKBACK_STEPS
    assert s.job_wide.steps + s.job_wide.warmup_steps <= LOOKBACK_STEPS


def _rows(df: pd.DataFrame, columns: list[str]) -> list[tuple[object, ...]]:
    return sorted(map(tuple, df[columns].itertuples(index=False)))


def test_a_recent_job_reads_only_what_the_store_gained_and_holds_what_a_fresh_read_would(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RecentJob`` (what ``rankscope serve`` diagnoses): after each update it holds the rows
    ``read_job`` would read for the same span, though it read only the new ones; a rank whose rows
    come late is caught up, and a restarted rank makes it read afresh."""
    recent, read_rows = RecentJob(JOB, recent_s=3.0), []  # 3 s: 30 steps of 100 ms
    real_steps = store.steps

    def counting_steps(*args: Any, **kwargs: Any) -> pd.DataFrame:
        df = real_steps(*args, **kwargs)
        read_rows.append((len(df), "after_us" in kwargs))
        return df

    monkeypatch.setattr(store, "steps", counting_steps)
    step_cols = ["rank", "step", "start_us", "dur_us", "comm_us"]
    fn_cols = ["rank", "window", "name", "total_us"]

    def check(last_step: int) -> None:
        last_us = T0 + last_step * 100_000
        got, want = recent.update(store, last_us), read_job(store, JOB, since_us=last_us - 3_000_000)
        # read_job keeps a whole row whose end is in the span; the held frame may keep a little
        # more (it drops old rows every tenth of the span): compare over the span.
        lo = last_us - 3_000_000
        in_span = lambda df: df[df["start_us"] >= lo]  # noqa: E731
        assert _rows(in_span(got.steps), step_cols) == _rows(in_span(want.steps), step_cols)
        first = want.functions["window"].min() if not want.functions.empty else 1 << 62
        over = lambda df: df[df["window"] >= first]  # noqa: E731
        assert _rows(over(got.functions), fn_cols) == _rows(want.functions, fn_cols)
        assert got.ranks.equals(want.ranks) and got.heartbeats.equals(want.heartbeats)

    store.write([rank_info(0), rank_info(1), steps(0, 0, 20), steps(1, 0, 20), window(0, 0), window(1, 0)])
    check(20)
    for lo in range(20, 80, 10):  # rank 1's rows of steps 40..60 come a cycle late
        late = 40 <= lo < 60
        # Rank 0 ships blocks of 10 steps whose duration does not divide evenly: the block's
        # last step reads back ending a fraction of a microsecond off the row's end.
        block = StepRow(
            lo, T0 + lo * 100_000, 1_000_001 - lo % 20, 10_000, 200_000, 30, 4_000, 850_000, 0, 10
        )
        store.write([replace(steps(0, lo, lo + 10), rows=(block,)), heartbeat(0, T0 + lo * 100_000, lo)])
        store.write([] if late else [steps(1, 40 if lo == 60 else lo, lo + 10)])
        store.write([window(r, lo // 10) for r in (0, 1)] if lo % 20 == 0 else [])
        read_rows.clear()
        check(lo + 10)
        # The update read 10 steps a rank (30 for the late rank's catch-up), read_job the span.
        assert read_rows[0] == (10 + (30 if lo == 60 else 0 if late else 10), True), (lo, read_rows)
    # Rank 1 restarts from a checkpoint at step 70 and redoes steps 70..79 later.
    again = rank_info(1, T0 + 9_000_000)
    redo = StepBatch(
        job=JOB, rank=1, host="node0", time_us=T0 + 10_000_000,
        rows=tuple(step_row(s, 1)._replace(start_us=T0 + 9_000_000 + (s - 70) * 100_000) for s in range(70, 80)),
    )  # fmt: skip
    store.write([again, redo])
    read_rows.clear()
    check(100)
    assert read_rows[0][1] is False  # read afresh


def test_a_row_of_a_block_of_steps_reads_back_as_its_steps(store: Store) -> None:
    row = StepRow(100, T0, 40_000, 4_000, 8_000, 12, 1_500, 30_000, 3, 4, 2_000, 6_000)  # steps 100..103
    store.write([StepBatch(job=JOB, rank=0, host="h", time_us=T0, rows=(row,))])
    df = store.steps(JOB)
    assert df["step"].tolist() == [100, 101, 102, 103]
    assert df["start_us"].tolist() == [T0, T0 + 10_000, T0 + 20_000, T0 + 30_000]
    assert df[
        ["dur_us", "data_us", "comm_us", "n_coll", "cpu_us", "nivcsw", "wait_us", "gc_us"]
    ].drop_duplicates().values.tolist() == [[10_000, 1_000, 2_000, 3, 7_500, 0.75, 500, 1_500]]
    assert (df["first_coll_us"] == 1_500).all()
    assert store.steps(JOB, since_step=102)["step"].tolist() == [102, 103]
    assert read_job(store, JOB, since_us=T0 + 35_000).steps["step"].tolist() == [100, 101, 102, 103]
    assert read_job(store, JOB, since_us=T0 + 45_000).steps.empty  # the block ended before
    # A rank restarted from a checkpoint, with rows of one step over the same steps: the later run counts.
    again = StepRow(102, T0 + 60_000, 9_000, 0, 0, 3, 100, 9_000, 0, 1)
    store.write([StepBatch(job=JOB, rank=0, host="h", time_us=T0, rows=(again,))])
    df = store.steps(JOB)
    assert df["step"].tolist() == [100, 101, 102, 103] and df["dur_us"].tolist()[2] == 9_000


def test_a_large_jobs_steps_are_read_in_buckets_summed_up_by_the_store(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of blocks of 4 steps, read in buckets of 8: each bucket's means per step are those of
    its steps read one by one. ``read_job`` reads buckets where ranks x steps exceed
    ``MAX_STEP_CELLS``, the fewest steps a bucket that keep the buckets under ``MAX_BUCKETS``, and
    the diagnosis names the same straggler from them."""
    blocks = [
        StepBatch(
            job=JOB, rank=r, host=f"node{r}", time_us=T0 + lo * 10_000,
            rows=tuple(
                StepRow(b, T0 + b * 10_000, 4 * (10_000 + 5_000 * (r == 2)), 400, 4 * 3_000, 12, 900,
                        4 * (6_000 + 5_000 * (r == 2)), 2, 4, 4 * (100 + b))
                for b in range(lo, lo + 64, 4)
            ),
        )
        for r in range(8)
        for lo in range(0, 1024, 64)
    ]  # fmt: skip
    store.write([*map(rank_info, range(8)), *blocks])
    one_by_one = store.steps(JOB)
    got = store.steps(JOB, width=8, since_step=16)
    assert got["width"].eq(8).all() and got["step"].min() == 16 and len(got) == 8 * (1024 - 16) // 8
    assert (got["step"] % 8 == 0).all() and list(got.columns) == [*STEP_COLUMNS, "width"]
    cut = one_by_one[one_by_one["step"] >= 16]
    means = cut.groupby(["rank", cut["step"] // 8 * 8]).agg(
        {
            **dict.fromkeys(["dur_us", "data_us", "comm_us", "first_coll_us", "cpu_us", "wait_us"], "mean"),
            "start_us": "min",
        }
    )
    # Buckets come in no order (sorting 2 million of them took ClickHouse 1 s; the diagnosis places
    # each by its rank and step).
    by_step = got.set_index(["rank", "step"]).sort_index()
    assert np.allclose(by_step[means.columns].to_numpy(), means.to_numpy())
    whole = read_job(store, JOB)
    # 8 x 1,024 steps: one by one, only the columns the diagnosis uses (``STEP_FIELDS``).
    assert whole.steps.equals(one_by_one[[c for c in STEP_COLUMNS if c in [*STEP_FIELDS, "start_us"]]])
    asked = store.steps(JOB, width=8, since_step=16, columns=["cpu_us"])
    assert list(asked.columns) == ["rank", "step", "start_us", "cpu_us", "width"]
    assert asked.equals(got[asked.columns])
    monkeypatch.setattr("rankscope.diagnosis.data.MAX_STEP_CELLS", 8 * 1024 // 3)
    data = read_job(store, JOB)
    assert data.steps["width"].eq(4).all() and len(data.steps) == 8 * 1024 // 4
    # Buckets of 2 would keep under this, but half of them would hold no row (a block begins
    # every 4 steps): a bucket is as wide as a stored row at least.
    monkeypatch.setattr("rankscope.diagnosis.data.MAX_STEP_CELLS", 8 * 1024 // 2)
    in_order = lambda df: df.sort_values(["rank", "step"], ignore_index=True)  # noqa: E731
    assert in_order(read_job(store, JOB).steps).equals(in_order(data.steps))
    f, g = only(diagnose(data).findings), only(diagnose(whole).findings)
    assert (f.cause, f.ranks) == (g.cause, g.ranks) == ("compute", [2])
    assert f.evidence["ratio"] == pytest.approx(g.evidence["ratio"], rel=0.01)
    # Fewer buckets allowed than steps one by one (``MAX_BUCKETS``): wider buckets, under it.
    monkeypatch.setattr("rankscope.diagnosis.data.MAX_BUCKETS", 8 * 1024 // 8)
    wide = read_job(store, JOB).steps
    assert wide["width"].eq(8).all() and len(wide) == 8 * 1024 // 8
    assert only(diagnose(replace(data, steps=wide)).findings).ranks == [2]


def test_a_recent_large_job_is_held_in_buckets_each_ranks_last_read_again(
    store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job too large to hold step by step (``MAX_STEP_CELLS``): ``RecentJob`` holds the buckets
    ``read_job`` reads, though an update reads only each rank's last bucket again (it gained rows)
    and those after it; as the job grows into wider buckets, it reads afresh."""
    for limit in ("MAX_STEP_CELLS", "MAX_BUCKETS"):  # 8 ranks: 1 a bucket to 16 steps … 8 past 64
        monkeypatch.setattr(f"rankscope.diagnosis.data.{limit}", 8 * 64 // 4)
    recent, reads = RecentJob(JOB, recent_s=3600.0), []
    real_steps = store.steps

    def counting_steps(*args: Any, **kwargs: Any) -> pd.DataFrame:
        df = real_steps(*args, **kwargs)
        reads.append((len(df), kwargs.get("width", 1), "after_us" in kwargs))
        return df

    monkeypatch.setattr(store, "steps", counting_steps)
    columns = [*STEP_FIELDS, "start_us", "width"]
    store.write([rank_info(r) for r in range(8)])
    for hi in range(4, 100, 4):  # each rank ships blocks of 4 steps; each step a little longer
        store.write(
            replace(
                steps(r, hi - 4, hi),
                rows=tuple(step_row(s, r)._replace(dur_us=90_000 + 100 * s) for s in range(hi - 4, hi)),
            )
            for r in range(8)
        )
        reads.clear()
        got = recent.update(store, T0 + hi * 100_000).steps.reindex(columns=columns)
        want = read_job(store, JOB).steps.reindex(columns=columns)
        w = 1 if hi <= 16 else 2 if hi <= 32 else 4 if hi <= 64 else 8
        assert want["width"].fillna(1).eq(w).all()
        order = lambda df: df.sort_values(["rank", "step"]).to_numpy(dtype=float, na_value=1)  # noqa: E731
        assert len(got) == len(want) and np.allclose(order(got), order(want)), hi
        n, width, incremental = reads[0]
        if hi in (20, 36, 68):  # the first update in wider buckets
            assert (width, incremental) == (w, False)
        elif hi > 68:
            # A rank's last bucket again, and the next where the new block began one.
            assert (width, incremental, n) == (8, True, 8 * (1 + (hi % 8 == 4))), hi
