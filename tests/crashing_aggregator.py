"""``rankscope aggregate`` that dies right after its first batch insert, before committing offsets.

For tests/kafka/: the process ends with ``os._exit(9)`` (no cleanup, no commit), as a
killed aggregator would. Usage: ``python -m tests.crashing_aggregator aggregate --kafka ...``.
"""

from __future__ import annotations

import os
import sys

from rankscope.aggregator import Batch, Store
from rankscope.cli import main

_write_batch = Store.write_batch


def _write_then_die(self: Store, batch: Batch) -> int:
    _write_batch(self, batch)
    os._exit(9)


Store.write_batch = _write_then_die  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main())
