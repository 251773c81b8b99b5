"""``python -m benchmarks.faults``: the fault suite's command (``suite.main``)."""

from benchmarks.faults.suite import main

raise SystemExit(main())
