"""rankscope's aggregator: ingests ranks' wire records into ClickHouse (embedded chDB or a server).

Example::

    from rankscope.aggregator import Store, ingest

    with Store.embedded("/var/lib/rankscope/db") as store:
        ingest("/var/spool/rankscope", store)
        print(store.jobs())
"""

from __future__ import annotations

from rankscope.wire.errors import RankscopeError, SchemaError, StoreError, UsageError

from .batch import Batch
from .schema import STORE_VERSION, ensure_schema
from .spool import IngestStats, ingest
from .store import Store

__all__ = [
    "STORE_VERSION",
    "Batch",
    "IngestStats",
    "RankscopeError",
    "SchemaError",
    "Store",
    "StoreError",
    "UsageError",
    "ensure_schema",
    "ingest",
]
