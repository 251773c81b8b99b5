"""Ingest the spool: ``*.jsonl`` files that ranks append wire values to, one per line.

Each file has one writer (see ``profiler_hook.sinks.SpoolSink``). Reading resumes at the offset
committed for the file (its path relative to the spool root) and stops before a last line that has
no ``\\n`` yet: that line is still being written, or was torn by a crash, and is read on a later pass
if it gets completed. Offsets are committed only after the rows they cover were written, so a crash
in between replays those lines (at-least-once); the store's ReplacingMergeTree tables collapse the
replay. A line that does not decode, or does not fit the store's columns, becomes a dead letter
(source = relative path, position = byte offset of the line) with the reason.

Example::

    stats = ingest("/var/spool/rankscope", store)
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .store import Batch, Store

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class IngestStats:
    """What one :func:`ingest` pass did."""

    files: int
    """Files from which new complete lines were consumed."""
    records: int
    """Records written."""
    dead_letters: int
    """Lines kept as dead letters."""
    bytes: int
    """Bytes consumed (complete lines only)."""
    seconds: float


class _Pass:
    """State of one ingest pass: the pending batch and the offsets it will commit."""

    def __init__(self, store: Store, batch_records: int) -> None:
        self.store = store
        self.batch_records = batch_records
        self.batch = Batch()
        self.pending: dict[str, int] = {}
        self.records = 0
        self.dead_letters = 0

    def line(self, source: str, position: int, line: bytes) -> None:
        value = line.rstrip(b"\r\n")
        if value.strip():
            self.batch.add_value(source, position, b"", value)

    def advance(self, source: str, offset: int) -> None:
        """Mark ``source`` as read up to ``offset``; flushes when the batch is full."""
        self.pending[source] = offset
        if len(self.batch) >= self.batch_records:
            self.flush()

    def flush(self) -> None:
        """Write the batch, then (only then) commit the offsets it covers."""
        if not self.pending:
            return
        self.records += self.store.write_batch(self.batch)
        self.dead_letters += self.batch.dead_letters
        self.store.set_offsets(self.pending)
        self.batch = Batch()
        self.pending = {}


def _read_file(path: Path, source: str, committed: int, run: _Pass) -> int:
    """Feed ``path``'s new complete lines to ``run``; returns the bytes consumed."""
    size = path.stat().st_size
    start = committed
    if size < committed:
        log.warning(
            "spool file %s shrank to %d bytes below its ingested offset %d (truncated or replaced); "
            "ingesting it again from the start",
            source,
            size,
            committed,
        )
        start = 0
    pos = start
    with path.open("rb") as f:
        f.seek(start)
        for line in f:
            if not line.endswith(b"\n"):
                break  # unfinished or torn: leave it for a later pass
            run.line(source, pos, line)
            pos += len(line)
            run.advance(source, pos)
    if pos == start and start != committed:
        run.advance(source, start)  # commit the restart even if nothing complete follows it
    return pos - start


def ingest(spool_dir: str | os.PathLike[str], store: Store, batch_records: int = 5000) -> IngestStats:
    """Read every spool file's new complete lines into ``store``; safe to repeat and to interrupt.

    ``batch_records`` bounds the records and dead letters held in memory between writes. A missing
    ``spool_dir`` is an empty spool (ranks create it when they start).
    """
    if batch_records < 1:
        raise ValueError(f"batch_records must be at least 1, got {batch_records}")
    t0 = time.perf_counter()
    root = Path(spool_dir)
    run = _Pass(store, batch_records)
    files = nbytes = 0
    if not root.is_dir():
        log.info("spool directory %s does not exist yet; nothing to ingest", root)
    else:
        committed = store.offsets()
        for path in sorted(root.rglob("*.jsonl")):
            if not path.is_file():
                continue
            # A file name that is not UTF-8 would make an unstorable source: keep it readable instead.
            source = os.fsencode(path.relative_to(root).as_posix()).decode("utf-8", "backslashreplace")
            try:
                consumed = _read_file(path, source, committed.get(source, 0), run)
            except OSError as exc:
                # A file removed or unreadable mid-pass: skip it, keep the lines read so far, go on.
                log.warning("cannot read spool file %s: %s", source, exc)
                continue
            files += consumed > 0
            nbytes += consumed
        run.flush()
    stats = IngestStats(
        files=files,
        records=run.records,
        dead_letters=run.dead_letters,
        bytes=nbytes,
        seconds=time.perf_counter() - t0,
    )
    log.info(
        "ingested %d records and %d dead letters (%d bytes from %d files) in %.3f s",
        stats.records,
        stats.dead_letters,
        stats.bytes,
        stats.files,
        stats.seconds,
    )
    return stats
