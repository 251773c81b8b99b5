"""rankscope's aggregator: ingests ranks' wire records into ClickHouse (embedded chDB or a server).

Example::

    from aggregator import Store, ingest

    with Store.embedded("/var/lib/rankscope/db") as store:
        ingest("/var/spool/rankscope", store)
        print(store.jobs())
"""

from __future__ import annotations

from .batch import Batch
from .errors import RankscopeError, StoreError, UsageError
from .schema import STORE_VERSION, SchemaError, ensure_schema
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
