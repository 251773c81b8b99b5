"""Where records go: a sink takes (key, value) pairs on the shipper's background thread."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from .config import Config, Identity


class Sink(Protocol):
    def send(self, key: bytes, value: bytes) -> None:
        """Hand one record to the transport; may raise, the shipper counts the loss."""

    def close(self) -> None:
        """Flush what is buffered and release the transport."""


class NullSink:
    """Discards everything (``sink="none"``): measures the hook without any transport."""

    def send(self, key: bytes, value: bytes) -> None:
        pass

    def close(self) -> None:
        pass


class SpoolSink:
    """Appends one JSON value per line to ``<spool>/<job>/<host>-rank<R>-<pid>.jsonl``.

    One file per process, so a line is only ever appended by one writer. A crash can leave the last
    line without its newline; readers treat such a line as unfinished and never consume it, and a
    restarted rank writes to a new file (new pid), so a torn line is never continued.
    """

    def __init__(self, spool_dir: str | os.PathLike[str], job: str, ident: Identity) -> None:
        directory = Path(spool_dir) / job
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{ident.host}-rank{ident.rank}-{ident.pid}.jsonl"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._torn = False

    def send(self, key: bytes, value: bytes) -> None:
        line = value + b"\n"
        if self._torn:
            # End the line a failed write left behind, so it becomes one dead letter, not a merger.
            line = b"\n" + line
        self._torn = True
        view = memoryview(line)
        while view:
            view = view[os.write(self._fd, view) :]
        self._torn = False

    def close(self) -> None:
        os.close(self._fd)


def make_sink(cfg: Config, ident: Identity) -> Sink:
    if cfg.sink == "spool":
        return SpoolSink(cfg.spool_dir, cfg.job, ident)
    if cfg.sink == "none":
        return NullSink()
    raise ValueError(f"sink {cfg.sink!r} is not available yet; use 'spool' or 'none'")
