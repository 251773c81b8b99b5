"""The background thread that encodes records and hands them to the sink.

The training thread only does ``queue.put_nowait``: it never waits on encoding, disk or network.
A full queue or a failing sink drops the record and counts it; the count rides on heartbeats.
Each record leaves numbered (``seq``, with its process's ``pid``), a dropped one taking its
number with it, so that the store can tell what never arrived.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from typing import cast

from rankscope.wire.records import Record, encode

from .sinks import Sink

log = logging.getLogger(__name__)
_STOP = object()
_NUMBERS: dict[tuple[str, int, int], itertools.count[int]] = {}
"""Per job, rank and process, the next record's number, as the store counts them: a hook attached
again in the same process for the same job and rank goes on counting; another job, or a forked
child (a new pid), starts from 0."""


class Shipper:
    def __init__(self, sink: Sink, queue_size: int, pid: int | None = None) -> None:
        self.sink = sink
        self.pid = os.getpid() if pid is None else pid
        self._sent = 0
        self._dropped = 0
        self.errors = 0
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._lock = threading.Lock()
        self._in_hand = False
        """The shipper thread holds a record it has taken from the queue and not shipped yet."""
        self._abandoned = False
        """close() gave up waiting and counted what was left as dropped."""
        self._thread = threading.Thread(target=self._run, name="rankscope-shipper", daemon=True)
        self._thread.start()

    @property
    def sent(self) -> int:
        """Records handed to the transport and not reported lost by it since."""
        return self._sent - getattr(self.sink, "failed", 0)

    @property
    def dropped(self) -> int:
        """Records lost: queue full, the sink raised, or the transport gave up after accepting them."""
        return self._dropped + getattr(self.sink, "failed", 0)

    def idle(self) -> bool:
        """Nothing waits in the queue."""
        return self._queue.empty()

    def submit(self, record: Record) -> bool:
        """Queue a record without blocking; False (and counted) if the queue is full."""
        try:
            self._queue.put_nowait(record)
            return True
        except queue.Full:
            self._dropped += 1
            self._number(record)  # its number, never to arrive
            return False

    def _number(self, record: Record) -> int:
        return next(_NUMBERS.setdefault((record.job, record.rank, self.pid), itertools.count()))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            with self._lock:
                if item is _STOP or self._abandoned:
                    return  # what is still queued was counted by close()
                self._in_hand = True
            try:
                record = cast(Record, item)
                key, value = encode(dataclasses.replace(record, pid=self.pid, seq=self._number(record)))
                self.sink.send(key, value)
                ok = True
            except Exception as exc:  # a transport must never take the rank down
                ok = False
                self.errors += 1
                if self.errors <= 3 or self.errors % 1000 == 0:
                    log.warning(
                        "rankscope: could not ship a record (%d lost so far): %s", self.dropped + 1, exc
                    )
            with self._lock:
                self._in_hand = False
                if ok:
                    self._sent += 1
                    if self._abandoned:
                        self._dropped -= 1  # close() counted it lost, but it went out after all
                elif not self._abandoned:
                    self._dropped += 1

    def close(self, timeout: float = 5.0) -> None:
        """Ship what is queued within ``timeout`` seconds in all, then close the sink. Records still
        queued at the deadline are abandoned and counted in ``dropped``."""
        deadline = time.monotonic() + timeout
        begin_close = getattr(self.sink, "begin_close", None)
        if begin_close is not None:
            begin_close(deadline)
        stop_queued = True
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            stop_queued = False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            with self._lock:
                self._abandoned = True
                left = self._queue.qsize() - stop_queued + self._in_hand
                self._dropped += left
            log.warning("rankscope: %d records not shipped within the %.1f s close timeout", left, timeout)
            return
        try:
            self.sink.close()
        except Exception as exc:
            log.warning("rankscope: closing the sink failed: %s", exc)
