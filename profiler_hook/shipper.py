"""The background thread that encodes records and hands them to the sink.

The training thread only does ``queue.put_nowait``: it never waits on encoding, disk or network.
A full queue or a failing sink drops the record and counts it; the count rides on heartbeats.
"""

from __future__ import annotations

import logging
import queue
import threading

from .records import Record, encode
from .sinks import Sink

log = logging.getLogger(__name__)
_STOP = object()


class Shipper:
    def __init__(self, sink: Sink, queue_size: int) -> None:
        self.sink = sink
        self.sent = 0
        self.dropped = 0
        self.errors = 0
        self._queue: queue.Queue[object] = queue.Queue(maxsize=queue_size)
        self._thread = threading.Thread(target=self._run, name="rankscope-shipper", daemon=True)
        self._thread.start()

    def submit(self, record: Record) -> bool:
        """Queue a record without blocking; False (and counted) if the queue is full."""
        try:
            self._queue.put_nowait(record)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            try:
                key, value = encode(item)  # type: ignore[arg-type]
                self.sink.send(key, value)
                self.sent += 1
            except Exception as exc:  # a transport must never take the rank down
                self.dropped += 1
                self.errors += 1
                if self.errors <= 3 or self.errors % 1000 == 0:
                    log.warning("rankscope: could not ship a record (%d lost so far): %s", self.dropped, exc)

    def close(self, timeout: float = 5.0) -> None:
        """Ship what is queued (waiting at most ``timeout`` seconds), then close the sink."""
        try:
            self._queue.put(_STOP, timeout=timeout)
        except queue.Full:
            log.warning("rankscope: shipper queue still full at close; %d records left", self._queue.qsize())
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("rankscope: shipper did not finish in %.1fs", timeout)
            return
        try:
            self.sink.close()
        except Exception as exc:
            log.warning("rankscope: closing the sink failed: %s", exc)
