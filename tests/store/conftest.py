"""The store's tests run against a real chDB engine (no mocks).

chDB hosts one engine per process, on one data directory at a time (another directory can be opened
only after every client of the first is closed). So each module here shares one module-scoped directory,
held open while its tests run, and every test gets its own *database* inside it
(``Store.embedded(path, database=...)``): tests are isolated (dead letters and offsets are not per
job, so distinct job ids alone would not do) without reopening the engine, and the engine is released
when the module ends, so other test modules can open their own directories.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from rankscope.aggregator import Store

_db_ids = itertools.count()


@pytest.fixture(scope="module")
def chdb_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The module's chDB directory, held open throughout so tests switch databases, never paths."""
    path = tmp_path_factory.mktemp("chdb") / "data"
    with Store.embedded(path, database="session"):
        yield path


@pytest.fixture
def store(chdb_path: Path) -> Iterator[Store]:
    with Store.embedded(chdb_path, database=f"test_{next(_db_ids)}") as s:
        yield s
