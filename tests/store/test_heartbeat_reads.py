"""What the store reads out of the ranks' heartbeats: each rank's GPU use, and what its windows
cost as a share of its run, the stack samples and the links' sends it carries, each heartbeat once."""

from __future__ import annotations

from dataclasses import replace

from rankscope.aggregator import Store
from rankscope.diagnosis import diagnose, read_job
from tests.store.builders import (
    JOB,
    T0,
    heartbeat,
    rank_info,
    steps,
)


def test_nvml_samples_in_heartbeats_give_each_ranks_gpu_use(store: Store) -> None:
    from rankscope.diagnosis.efficiency import measure

    sampled = [replace(heartbeat(0, T0 + i * 1_000_000, i), gpu_util=u, gpu_mem_mb=m) for i, (u, m) in
               enumerate([(80.0, 1000.0), (90.0, 3000.0)])]  # fmt: skip
    store.write([*sampled, sampled[0], heartbeat(1, T0, 0), steps(0, 0, 5), steps(1, 0, 5)])
    gpu = store.gpu_usage(JOB)
    assert gpu.to_dict("records") == [{"rank": 0, "gpu_util": 85.0, "gpu_mem_mb": 3000.0, "samples": 2}]
    assert store.gpu_usage(JOB, since_us=T0 + 500_000)["gpu_util"].tolist() == [90.0]
    e = measure(JOB, store.steps(JOB), store.windows(JOB), store.ranks(JOB), gpu)
    assert [(r.rank, r.gpu_util, r.gpu_mem_mb) for r in e.ranks] == [(0, 85.0, 3000.0), (1, None, None)]


def test_what_a_ranks_windows_cost_is_read_from_its_heartbeats_as_a_share_of_its_run(store: Store) -> None:
    from rankscope.diagnosis.efficiency import measure
    from rankscope.renderers.text import format_efficiency

    beats = [
        replace(heartbeat(0, T0 + i * 10_000_000, i), windows=n, window_cost_us=c)
        for i, (n, c) in enumerate([(0, 0), (1, 30_000), (2, 50_000)])
    ]
    store.write([*beats, beats[1], heartbeat(1, T0, 0), steps(0, 0, 5), steps(1, 0, 5)])
    costs = store.window_costs(JOB)
    assert costs.to_dict("records") == [
        {"rank": 0, "windows": 2, "window_cost_us": 50_000, "time_us": T0 + 20_000_000},
        {"rank": 1, "windows": 0, "window_cost_us": 0, "time_us": T0},
    ]
    # From each rank's start (its rank record: where its budget starts counting) to its last word,
    # in the efficiency report and the diagnosis alike.
    store.write([rank_info(0, T0 - 20_000_000), rank_info(1)])
    e = measure(JOB, store.steps(JOB), store.windows(JOB), store.ranks(JOB), None, costs)
    assert [(r.rank, r.window_cost) for r in e.ranks] == [(0, 0.00125), (1, None)]  # 50 ms in 40 s
    assert " 0.12%" in format_efficiency(e)
    assert diagnose(read_job(store, JOB)).analyzed["window_cost"] == 0.00125


def test_stack_samples_are_summed_per_rank_and_function_each_heartbeat_once(store: Store) -> None:
    beats = [heartbeat(0, T0, 4), heartbeat(0, T0 + 5_000_000, 9), heartbeat(1, T0 + 5_000_000, 9)]
    store.write([*beats, beats[1]])  # a heartbeat ingested twice (at-least-once) counts once
    got = store.stack_samples(JOB)
    assert got.values.tolist() == [
        [0, "", 2],
        [0, "train.py(40): step", 13],
        [1, "", 1],
        [1, "train.py(40): step", 9],
    ]
    assert store.stack_samples(JOB, since_us=T0 + 1)["samples"].tolist() == [1, 9, 1, 9]
    assert read_job(store, JOB).samples.equals(got)
    empty = store.stack_samples("nope")
    assert empty.empty and list(empty.columns) == ["rank", "function", "samples"]


def test_link_sends_are_read_per_heartbeat_and_link_each_heartbeat_once(store: Store) -> None:
    beats = [heartbeat(0, T0, 0), heartbeat(0, T0 + 5_000_000, 9), heartbeat(1, T0 + 5_000_000, 4)]
    store.write([*beats, beats[1]])  # a heartbeat ingested twice (at-least-once) is read once
    got = store.link_sends(JOB)
    assert got.values.tolist() == [  # the first heartbeat sent nothing yet: no row
        [0, T0 + 5_000_000, "10.0.0.1>10.0.0.2", 9 << 20, 9_000],
        [1, T0 + 5_000_000, "10.0.0.1>10.0.0.2", 4 << 20, 4_000],
    ]
    assert store.link_sends(JOB, since_us=T0 + 5_000_001).empty
    assert read_job(store, JOB).links.equals(got)
    assert list(store.link_sends("nope").columns) == ["rank", "time_us", "link", "nbytes", "send_us"]
