"""The service's tests' fixtures: the recorded real runs as a spool (each module its own copy),
a store folder, a webhook receiver, a served service."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from benchmarks.faults.serve_e2e import Receiver
from rankscope.api import Service, create_app
from rankscope.api.auth import Tokens
from rankscope.api.notify import Webhook
from tests.api.common import FIXTURES, JOBS, READ, WRITE, service_on


@pytest.fixture(scope="module")
def spool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spool")
    for job in JOBS:
        (root / job).mkdir()
        for gz in (FIXTURES / job).glob("*.jsonl.gz"):
            (root / job / gz.name.removesuffix(".gz")).write_bytes(gzip.decompress(gz.read_bytes()))
    return root


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("store")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.server.shutdown()


@pytest.fixture
def served(store_dir: Path, spool: Path, receiver: Receiver) -> Iterator[tuple[Service, TestClient]]:
    store, svc = service_on(store_dir, spool, webhooks=(Webhook(receiver.url),))
    yield svc, TestClient(create_app(svc, Tokens({READ: "read", WRITE: "write"})))
    svc.stop()
    store.close()
