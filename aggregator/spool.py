"""Ingest the spool: ``*.jsonl`` files that ranks append wire values to, one per line.

Each file has one writer (see ``profiler_hook.sinks.SpoolSink``). Reading resumes at the offset
committed for the file and stops before a last line that has no ``\\n`` yet: that line is still
being written, or was torn by a crash, and is read on a later pass if it gets completed. Offsets are
committed only after the rows they cover were written, so a crash in between replays those lines
(at-least-once); the store's ReplacingMergeTree tables collapse the replay. A line that does not
decode, or does not fit the store's columns, becomes a dead letter (source = path relative to the
spool root, position = byte offset of the line) with the reason.

Offsets are kept per file, by its identity (:func:`file_id`: device, inode and a hash of its first
line), not by its path: two spools ingested into one store may both hold ``job1/host-rank0-7.jsonl``,
and a file replaced under its name is another file; each is read from its start.

A line is read ``MAX_LINE_BYTES`` at a time at most, so memory stays bounded whatever is in a file.
A longer line becomes a dead letter at once (its size and its first ``RAW_PREFIX_BYTES``), and
reading goes on after its newline; if the newline has not come yet, the offset is committed inside
the line and the next pass skips the line's rest first, so a giant line is read once.

Only regular files inside the spool are read: a ``*.jsonl`` link to a file outside the spool root
(or anything that is not a regular file) is skipped with a warning and counted in
``IngestStats.skipped``; a link to a file inside the spool is read once, as the file it names.

Example::

    stats = ingest("/var/spool/rankscope", store)
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from rankscope.wire.records import MAX_VALUE_BYTES

from .batch import RAW_PREFIX_BYTES, Batch
from .reads import SpoolOffset
from .store import Store

log = logging.getLogger(__name__)

MAX_LINE_BYTES = MAX_VALUE_BYTES + 2
"""The longest line read whole: one value of ``MAX_VALUE_BYTES`` (1 MiB) and its ``\\r\\n``."""
FINGERPRINT_BYTES = 4096
"""A file's identity hashes its first line, or its first this many bytes if the line is longer."""
_SKIP_CHUNK = 1 << 20


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
    skipped: int = 0
    """``*.jsonl`` paths not read: links to files outside the spool, or not regular files."""


def file_id(path: str | os.PathLike[str]) -> str | None:
    """The identity spool offsets are kept under: ``<device>:<inode>:<hash of the first line>``.

    None while the file has no complete first line (and is shorter than ``FINGERPRINT_BYTES``):
    it has nothing to ingest yet.
    """
    with open(path, "rb") as f:
        return _file_id(f)


def _file_id(f: BinaryIO) -> str | None:
    st = os.fstat(f.fileno())
    head = os.pread(f.fileno(), FINGERPRINT_BYTES, 0)
    end = head.find(b"\n")
    if end >= 0:
        head = head[: end + 1]
    elif len(head) < FINGERPRINT_BYTES:
        return None
    return f"{st.st_dev}:{st.st_ino}:{hashlib.sha256(head).hexdigest()[:32]}"


class _Pass:
    """State of one ingest pass: the pending batch and the offsets it will commit."""

    def __init__(self, store: Store, batch_records: int, batch_bytes: int) -> None:
        self.store = store
        self.batch_records = batch_records
        self.batch_bytes = batch_bytes
        self.batch = Batch()
        self.pending: dict[str, SpoolOffset] = {}
        self.records = 0
        self.dead_letters = 0

    def line(self, source: str, position: int, line: bytes) -> None:
        value = line.rstrip(b"\r\n")
        if value.strip():
            self.batch.add_value(source, position, b"", value)

    def oversized(self, source: str, position: int, prefix: bytes, size: int, complete: bool) -> None:
        size_text = f"{size} bytes" if complete else f"at least {size} bytes (no newline yet)"
        reason = (
            f"line of {size_text} exceeds the {MAX_LINE_BYTES}-byte limit "
            f"(kept: its first {len(prefix)} bytes)"
        )
        self.batch.dead_letter(source, position, b"", prefix, reason)

    def advance(self, file: str, offset: SpoolOffset) -> None:
        """Mark ``file`` as read up to ``offset``; flushes when the batch is full."""
        self.pending[file] = offset
        if len(self.batch) >= self.batch_records or self.batch.nbytes >= self.batch_bytes:
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


def _skip_line(f: BinaryIO) -> tuple[int, bool]:
    """Read past the rest of the current line in bounded chunks: (bytes, whether its newline came)."""
    n = 0
    while True:
        chunk = f.readline(_SKIP_CHUNK)
        n += len(chunk)
        if chunk.endswith(b"\n"):
            return n, True
        if len(chunk) < _SKIP_CHUNK:
            return n, False


def _read_file(f: BinaryIO, file: str, source: str, committed: SpoolOffset, run: _Pass) -> int:
    """Feed the file's new complete lines to ``run``; returns the bytes consumed."""
    size = os.fstat(f.fileno()).st_size
    start, in_line = committed.offset, committed.in_line
    if size < start:
        log.warning(
            "spool file %s shrank to %d bytes below its ingested offset %d (truncated or replaced); "
            "ingesting it again from the start",
            source,
            size,
            start,
        )
        start, in_line = 0, False
    pos = start
    f.seek(start)
    if in_line:  # the rest of an oversized line dead-lettered on an earlier pass
        n, ended = _skip_line(f)
        pos += n
        if n:
            run.advance(file, SpoolOffset(source, pos, not ended))
        if not ended:
            return pos - start
    while True:
        line = f.readline(MAX_LINE_BYTES)
        if line.endswith(b"\n"):
            run.line(source, pos, line)
            pos += len(line)
            run.advance(file, SpoolOffset(source, pos))
            continue
        if len(line) < MAX_LINE_BYTES:
            break  # end of file: an unfinished or torn line is left for a later pass
        n, ended = _skip_line(f)
        run.oversized(source, pos, line[:RAW_PREFIX_BYTES], len(line) + n, ended)
        pos += len(line) + n
        run.advance(file, SpoolOffset(source, pos, not ended))
        if not ended:
            break
    if pos == start and start != committed.offset:
        run.advance(file, SpoolOffset(source, start))  # commit the restart even if nothing follows it
    return pos - start


def _jsonl_files(root: str, rel: str = "") -> Iterator[tuple[str, os.DirEntry[str]]]:
    """Every ``*.jsonl`` entry under ``root`` (a real path), not through links to directories, as
    its path relative to ``root`` and its entry (whose type needs no system call)."""
    try:
        entries = list(os.scandir(os.path.join(root, rel)))
    except FileNotFoundError:  # removed since it was listed
        return
    except OSError as exc:
        log.warning("cannot list spool directory %s: %s", rel or ".", exc)
        return
    for entry in entries:
        path = f"{rel}/{entry.name}" if rel else entry.name
        if entry.is_dir(follow_symlinks=False):
            yield from _jsonl_files(root, path)
        elif entry.name.endswith(".jsonl"):
            yield path, entry


def _open_inside(entry: os.DirEntry[str], root: str) -> tuple[BinaryIO | None, str]:
    """The spool file ``entry`` opened for reading if it is a regular file inside ``root`` (a real
    path), and why not. Listed without following links, an entry that is no link lies inside."""
    path = entry.path
    if entry.is_symlink():
        path = os.path.realpath(path)
        if os.path.commonpath([path, root]) != root:
            return None, f"a link to {path}, outside the spool"
    try:
        # O_NOFOLLOW: the real path is no link (unless one was put there since); O_NONBLOCK: a FIFO
        # put there since must not hang the reader.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        return None, f"cannot be opened: {exc}"
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        return None, "not a regular file"
    return f, ""


def ingest(
    spool_dir: str | os.PathLike[str], store: Store, batch_records: int = 20_000, batch_bytes: int = 64 << 20
) -> IngestStats:
    """Read every spool file's new complete lines into ``store``; safe to repeat and to interrupt.

    ``batch_records`` and ``batch_bytes`` bound the records, dead letters and value bytes held in
    memory between writes. A missing ``spool_dir`` is an empty spool (ranks create it when they start).
    """
    if batch_records < 1:
        raise ValueError(f"batch_records must be at least 1, got {batch_records}")
    t0 = time.perf_counter()
    root = Path(spool_dir)
    run = _Pass(store, batch_records, batch_bytes)
    files = nbytes = skipped = 0
    if not root.is_dir():
        log.info("spool directory %s does not exist yet; nothing to ingest", root)
    else:
        committed = store.offsets()
        real_root = os.path.realpath(root)
        seen: set[str] = set()
        for rel, entry in sorted(_jsonl_files(real_root), key=lambda e: e[0]):
            # A file name that is not UTF-8 would make an unstorable source: keep it readable instead.
            source = os.fsencode(rel).decode("utf-8", "backslashreplace")
            f, why_not = _open_inside(entry, real_root)
            if f is None:
                if os.path.lexists(entry.path):  # else removed since it was listed
                    log.warning("spool file %s is not read: %s", source, why_not)
                    skipped += 1
                continue
            try:
                with f:
                    fid = _file_id(f)
                    if fid is None or fid in seen:  # nothing complete yet, or read through another link
                        continue
                    seen.add(fid)
                    consumed = _read_file(f, fid, source, committed.get(fid, SpoolOffset(source, 0)), run)
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
        skipped=skipped,
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
