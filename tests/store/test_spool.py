"""The spool reader on a real chDB engine: torn lines, files that shrink or are replaced, a write
that fails, two spools alike, links out of the spool, oversized and unfinished lines."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from rankscope.aggregator import Batch, Store, StoreError, ingest
from rankscope.aggregator.batch import RAW_PREFIX_BYTES
from rankscope.aggregator.spool import MAX_LINE_BYTES
from rankscope.wire.records import (
    encode,
)
from tests.store.builders import (
    JOB,
    T0,
    offset_of,
    rank_info,
    steps,
    write_spool,
)

# --- torn lines, shrinking files, failures ---------------------------------------------------------


def test_a_torn_final_line_is_ingested_only_once_completed(store: Store, tmp_path: Path) -> None:
    path = tmp_path / "j" / "h-rank0-1.jsonl"
    path.parent.mkdir()
    first, second, third = (encode(r)[1] for r in (rank_info(0), steps(0, 0, 2), steps(0, 2, 4)))
    path.write_bytes(first + b"\n" + second + b"\n" + third[:25])

    stats = ingest(tmp_path, store)

    assert stats.records == 2 and stats.dead_letters == 0
    assert offset_of(store, path) == len(first) + len(second) + 2
    assert store.counts(JOB)["steps"] == 2

    with path.open("ab") as f:
        f.write(third[25:] + b"\n")
    stats = ingest(tmp_path, store)

    assert stats.records == 1 and stats.bytes == len(third) + 1
    assert offset_of(store, path) == path.stat().st_size
    assert store.steps(JOB)["step"].tolist() == [0, 1, 2, 3]
    assert store.dead_letters().empty


def test_a_file_that_shrank_is_read_again_from_the_start(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "h-rank0-1.jsonl"
    path.write_bytes(b"".join(encode(r)[1] + b"\n" for r in (rank_info(0), steps(0, 0, 5))))
    ingest(tmp_path, store)
    # Truncated in place, the same first line (so the same file), then written again: shorter.
    path.write_bytes(b"".join(encode(r)[1] + b"\n" for r in (rank_info(0), steps(0, 5, 6))))

    with caplog.at_level(logging.WARNING, logger="rankscope.aggregator.spool"):
        stats = ingest(tmp_path, store)

    assert stats.records == 2
    assert "shrank" in caplog.text
    assert offset_of(store, path) == path.stat().st_size
    assert store.steps(JOB)["step"].tolist() == [0, 1, 2, 3, 4, 5]


def test_a_file_name_that_is_not_utf8_is_still_ingested(store: Store, tmp_path: Path) -> None:
    path = Path(os.fsdecode(bytes(tmp_path) + b"/rank\xff.jsonl"))
    path.write_bytes(encode(rank_info(0))[1] + b"\n{broken\n")

    stats = ingest(tmp_path, store)

    assert (stats.records, stats.dead_letters) == (1, 1)
    assert [(o.path, o.offset) for o in store.offsets().values()] == [
        ("rank\\xff.jsonl", path.stat().st_size)
    ]
    assert store.dead_letters()["source"].tolist() == ["rank\\xff.jsonl"]


class FailingStore(Store):
    """A real store whose second batch write fails, as if the server went away mid-ingest."""

    writes = 0

    def write_batch(self, batch: Batch) -> int:
        self.writes += 1
        if self.writes == 2:
            raise StoreError("injected failure")
        return super().write_batch(batch)


def test_offsets_are_committed_only_after_the_write(store: Store, tmp_path: Path) -> None:
    lines = [encode(steps(0, s, s + 1))[1] + b"\n" for s in range(5)]
    (tmp_path / "f.jsonl").write_bytes(b"".join(lines))
    failing = FailingStore(store.client, store.database)

    with pytest.raises(StoreError, match="injected"):
        ingest(tmp_path, failing, batch_records=2)

    assert offset_of(store, tmp_path / "f.jsonl") == len(lines[0]) + len(lines[1])  # the first batch only
    assert store.steps(JOB)["step"].tolist() == [0, 1]
    stats = ingest(tmp_path, store, batch_records=2)
    assert stats.records == 3
    assert store.steps(JOB)["step"].tolist() == [0, 1, 2, 3, 4]


# --- spool files: identity, links, oversized lines --------------------------------------------------


def test_two_spools_with_the_same_relative_path_are_both_read_whole(store: Store, tmp_path: Path) -> None:
    """Offsets are per file, not per path: the second spool's file is read from its start."""
    a = write_spool(tmp_path / "a", [rank_info(0), steps(0, 0, 3)])
    b = write_spool(tmp_path / "b", [rank_info(1), steps(1, 0, 5)])
    b[0].rename(a[0].parent.parent.parent / "b" / a[0].relative_to(tmp_path / "a"))  # the same name
    assert sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.jsonl")) == sorted(
        p.relative_to(tmp_path / "b") for p in (tmp_path / "b").rglob("*.jsonl")
    )

    first, second = ingest(tmp_path / "a", store), ingest(tmp_path / "b", store)

    assert (first.records, second.records) == (2, 2)
    assert store.counts(JOB)["ranks"] == 2
    assert store.steps(JOB).groupby("rank")["step"].count().to_dict() == {0: 3, 1: 5}


def test_a_file_replaced_by_a_larger_one_is_read_from_its_start(store: Store, tmp_path: Path) -> None:
    path = write_spool(tmp_path, [rank_info(0), steps(0, 0, 2)])[0]
    ingest(tmp_path, store)
    replacement = tmp_path / "new.tmp"
    replacement.write_bytes(
        b"".join(
            encode(r)[1] + b"\n" for r in [rank_info(0, T0 + 1), *(steps(0, s, s + 1) for s in range(2, 12))]
        )
    )
    replacement.replace(path)  # larger than the file it replaces

    stats = ingest(tmp_path, store)

    assert stats.records == 11
    assert store.steps(JOB)["step"].tolist() == list(range(12))
    assert store.ranks(JOB)["time_us"].tolist() == [T0 + 1]


def test_links_out_of_the_spool_are_not_followed(
    store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A ``*.jsonl`` link to a file outside the spool is skipped with a warning; one inside it is read once."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(encode(rank_info(1))[1] + b"\nroot:x:0:0\n")
    spool = tmp_path / "spool"
    inside = write_spool(spool, [rank_info(0)])[0]
    (spool / "job-a" / "evil.jsonl").symlink_to(secret)
    (spool / "job-a" / "again.jsonl").symlink_to(inside)
    (spool / "job-b").symlink_to(tmp_path, target_is_directory=True)
    (tmp_path / "outside.jsonl").write_bytes(encode(rank_info(1))[1] + b"\n")

    with caplog.at_level(logging.WARNING, logger="rankscope.aggregator.spool"):
        stats = ingest(spool, store)

    assert (stats.records, stats.dead_letters, stats.skipped) == (1, 0, 1)
    assert f"job-a/evil.jsonl is not read: a link to {secret}, outside the spool" in caplog.text
    assert store.ranks(JOB)["rank"].tolist() == [0]
    assert store.dead_letters().empty


def test_an_oversized_line_is_a_dead_letter_with_its_size_and_read_in_bounded_memory(
    store: Store, tmp_path: Path
) -> None:
    """A 24 MiB line: dead-lettered with its size and first bytes, the lines after it stored, and
    never held whole in memory (it took ~10x its size)."""
    import tracemalloc

    giant = b'{"v":1,"type":"heartbeat","stack":"' + b"x" * (24 << 20) + b'"}'
    good = [encode(r)[1] for r in (rank_info(0), steps(0, 0, 2))]
    path = tmp_path / "g.jsonl"
    path.write_bytes(good[0] + b"\n" + giant + b"\n" + good[1] + b"\n")

    tracemalloc.start()
    try:
        stats = ingest(tmp_path, store)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()

    assert (stats.records, stats.dead_letters) == (2, 1)
    assert peak < 8 << 20, f"peak {peak >> 20} MiB of Python memory for a {len(giant) >> 20} MiB line"
    row = store.dead_letters().to_dict("records")[0]
    assert row["position"] == str(len(good[0]) + 1)
    assert f"line of {len(giant) + 1} bytes exceeds the {MAX_LINE_BYTES}-byte limit" in row["reason"]
    assert row["raw"] == giant[:RAW_PREFIX_BYTES].decode()
    assert offset_of(store, path) == path.stat().st_size


def test_a_giant_unfinished_line_is_dead_lettered_once_and_not_read_again(
    store: Store, tmp_path: Path
) -> None:
    path = tmp_path / "t.jsonl"
    head = encode(rank_info(0))[1] + b"\n"
    path.write_bytes(head + b'{"v":1,"type":"heartbeat","stack":"' + b"y" * (3 << 20))

    torn_size = path.stat().st_size
    first = ingest(tmp_path, store)
    again = ingest(tmp_path, store)  # the torn line is not read again
    with path.open("ab") as f:  # the writer finishes it, then writes more
        f.write(b"y" * 100 + b'"}\n' + encode(steps(0, 0, 2))[1] + b"\n")
    last = ingest(tmp_path, store)

    assert (first.records, first.dead_letters, first.bytes) == (1, 1, torn_size)
    assert (again.records, again.dead_letters, again.bytes) == (0, 0, 0)
    assert (last.records, last.dead_letters) == (1, 0)
    reason = store.dead_letters()["reason"].tolist()
    assert len(reason) == 1 and "at least" in reason[0] and "no newline yet" in reason[0]
    assert store.steps(JOB)["step"].tolist() == [0, 1]
    assert offset_of(store, path) == path.stat().st_size
