"""The results table is what the kept runs' JSON makes: a run added without regenerating it, or a
JSON of a shape the table no longer reads, fails here."""

from __future__ import annotations

from benchmarks.results.__main__ import OUT, render


def test_results_md_is_made_from_the_kept_runs() -> None:
    assert OUT.read_text() == render(), "run: python -m benchmarks.results"
