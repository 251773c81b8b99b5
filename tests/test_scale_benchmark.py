"""``benchmarks.scale.pipeline``: one small size end to end, in a process of its own as the benchmark runs each."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.scale import pipeline as scale


def test_a_small_job_goes_through_the_whole_pipeline_and_its_straggler_is_named(tmp_path: Path) -> None:
    """...and again with its records copied to three times as long (``--repeat``)."""
    out = tmp_path / "scale.json"
    (r,) = scale.main(
        ["--ranks", "24", "--minutes", "2", "--functions", "20", "--repeat", "3", "--json", str(out)]
    )
    assert "error" not in r, r
    # Per rank: its rank record, a step record every 2 s, a heartbeat every 5 s, a window every 30 s.
    assert r["records"] == 24 * (1 + 60 + 24 + 4) and r["dead_letters"] == r["records_missing"] == 0
    assert r["records_per_s"] > 0 and r["store_mb"] > 0 and r["peak_rss_gb"] > 0
    assert r["straggler_named"] and r["top_finding"] == "compute @ ranks [8]", r
    # The first serve cycle, then one after each 10 s the job ran on.
    assert len(r["cycle_s"]) == 1 + scale.CYCLES and r["cycle_problem"] == "", r
    assert r["cycle_steady_s"] in r["cycle_s"][1:]
    assert r["repeated_minutes"] == 6 and r["repeated_step_rows"] == 3 * r["step_rows"] > 0, r
    assert r["repeated_straggler_named"] and r["repeated_diagnose_s"] >= r["repeated_read_s"] > 0, r
    assert r["repeated_peak_rss_gb"] is not None and r["repeated_peak_rss_gb"] > 0, r
    assert json.loads(out.read_text()) == {"sizes": [r]}
