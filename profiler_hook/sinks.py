"""Where records go: a sink takes (key, value) pairs on the shipper's background thread."""

from __future__ import annotations

import hashlib
import os
import time
import urllib.parse
from pathlib import Path
from typing import Any, Protocol

from rankscope.wire.kafka import api_version_kwargs

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


_SAFE = "-_.+=@,~"
"""Characters besides ASCII letters and digits that a path component keeps as they are."""
MAX_COMPONENT_CHARS = 120
"""A longer component is cut and given a hash of the whole name, to stay well within a file name."""


def path_component(name: str) -> str:
    """``name`` as one file-name component that always stays inside its directory.

    Characters other than ASCII letters, digits and ``-_.+=@,~`` are percent-encoded (``/`` as
    ``%2F``, NUL as ``%00``, ``é`` as ``%C3%A9``; a lone surrogate as its UTF-8 bytes), so different
    names stay different; a leading dot becomes ``%2E`` (no ``.``, ``..`` or hidden files), an empty
    name ``%``; one over ``MAX_COMPONENT_CHARS`` keeps its start and a hash of the whole name.
    Example: ``path_component("../../x") == "%2E.%2F..%2Fx"``.
    """
    safe = urllib.parse.quote(name, safe=_SAFE, errors="surrogatepass")
    if safe.startswith("."):
        safe = "%2E" + safe[1:]
    if len(safe) > MAX_COMPONENT_CHARS:
        digest = hashlib.sha256(name.encode(errors="surrogatepass")).hexdigest()[:16]
        safe = f"{safe[: MAX_COMPONENT_CHARS - 17]}-{digest}"
    return safe or "%"


class SpoolSink:
    """Appends one JSON value per line to ``<spool>/<job>/<host>-rank<R>-<pid>.jsonl``.

    ``<job>`` and ``<host>`` are made safe by :func:`path_component`, so that the file is always
    inside ``<spool>/<job>/`` whatever the job id or ``$RANKSCOPE_HOST`` hold (``../../x``, an
    absolute path, a NUL, 5,000 characters); the records carry the job id and host unchanged.

    One file per process, so a line is only ever appended by one writer. A crash can leave the last
    line without its newline; readers treat such a line as unfinished and never consume it, and a
    restarted rank writes to a new file (new pid), so a torn line is never continued.
    """

    def __init__(self, spool_dir: str | os.PathLike[str], job: str, ident: Identity) -> None:
        directory = Path(spool_dir) / path_component(job)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{path_component(ident.host)}-rank{ident.rank}-{ident.pid}.jsonl"
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


class KafkaSink:
    """Produces each record to a Kafka topic (kafka-python, ``pip install rankscope[kafka]``).

    Runs on the shipper thread only. While no broker answers, ``send`` keeps retrying the record
    it holds, so the shipper's bounded queue fills and the training thread's further records are
    dropped and counted there — the step itself never waits. Records the producer gives up on
    after being accepted are counted in ``failed``.
    """

    RETRY_S = 0.5

    def __init__(self, cfg: Config, ident: Identity) -> None:
        self.topic = cfg.kafka_topic
        self.failed = 0
        self.delivered = 0
        self._give_up_at = float("inf")
        self._producer: Any = None
        self._kwargs: dict[str, Any] = {
            "bootstrap_servers": cfg.kafka_bootstrap.split(","),
            "client_id": f"rankscope-{cfg.job}-{ident.rank}",
            "compression_type": "gzip",
            "acks": 1,
            "linger_ms": 50,
            "max_block_ms": 1000,
            # Deliver what it held within a second of the broker's return: with kafka-python's 30 s
            # backoff a producer can stay away for tens of seconds after a long outage, and a
            # consumer that waits for the topic to go quiet may take that for the end of the job.
            "reconnect_backoff_max_ms": 1000,
            **cfg.kafka_options,
        }
        self._kwargs.update(api_version_kwargs(cfg.kafka_api_version))

    def _ok(self, _meta: Any) -> None:
        self.delivered += 1

    def _failed(self, _exc: BaseException) -> None:
        self.failed += 1

    def send(self, key: bytes, value: bytes) -> None:
        from kafka import KafkaProducer
        from kafka.errors import KafkaError

        while True:
            if time.monotonic() >= self._give_up_at:  # closing, and its time is up: fail fast
                raise ConnectionError(f"Kafka at {self._kwargs['bootstrap_servers']}: closed before delivery")
            try:
                if self._producer is None:
                    self._producer = KafkaProducer(**self._kwargs)
                future = self._producer.send(self.topic, key=key, value=value)
                future.add_callback(self._ok)
                future.add_errback(self._failed)
                return
            except KafkaError as exc:  # no broker yet, or no metadata for the topic: hold and retry
                if time.monotonic() >= self._give_up_at:
                    raise ConnectionError(f"Kafka at {self._kwargs['bootstrap_servers']}: {exc}") from exc
                time.sleep(self.RETRY_S)

    def begin_close(self, deadline: float) -> None:
        """Stop retrying at ``deadline`` (``time.monotonic()``), so that close() can finish."""
        self._give_up_at = deadline

    def close(self) -> None:
        if self._producer is not None:
            left = max(0.0, self._give_up_at - time.monotonic())
            try:
                self._producer.flush(timeout=left)
            finally:  # what is still unsent fails its futures here and is counted in ``failed``
                self._producer.close(timeout=max(0.0, self._give_up_at - time.monotonic()))


def make_sink(cfg: Config, ident: Identity) -> Sink:
    if cfg.sink == "spool":
        return SpoolSink(cfg.spool_dir, cfg.job, ident)
    if cfg.sink == "kafka":
        return KafkaSink(cfg, ident)
    return NullSink()
