"""The detectors: each finds one kind of culprit in a job's records and says so as findings.

A detector is a module here with

- ``Settings``: a frozen dataclass of its thresholds, each documented where it is defined;
- ``find(data: JobData, s: Settings) -> list[Finding]``: pure, records in, findings out;

and a line in :data:`DETECTORS`, which says in what order they run and which findings absorb
which:

0. ``failure`` — a job whose latest attempt died: the rank that failed first, its error and its
   class; when it finds one, the others do not run (a dead job's heartbeats stopped: no hang).
   Each earlier attempt's failure, of a job that restarted, is added to whatever the detectors
   found (``failure.earlier``);
1. ``hang`` — a job that stopped making progress, and the ranks it waits for; when it finds one,
   the others do not run (``exclusive``): a job that stopped has one thing to fix, and what the
   others would read in the steps before it stopped (a rank slower by chance in its first
   seconds) describes a job that no longer runs;
2. ``straggler`` — the ranks that hold a running job back: working longer per step (``compute``,
   ``dataloader``, ``code_path``) or their threads waiting for a CPU (``host_contention``), each
   account deciding the other's (see its module);
3. ``link`` — slow network links (cause ``communication``);

then ``diagnosis.topology`` merges the rank findings that make up a whole NIC, host, switch or
spine into one naming it; and

4. ``job_wide`` — every rank slower than the job's own start — runs only when nothing above found
   anything (``alone``): a job-wide slowdown is what is left when no rank stands out.

To add one: write ``detectors/<name>.py`` with its ``Settings`` and ``find``, its tests in
``tests/detectors/test_<name>.py`` on a hand-built ``JobData``, and its line here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..data import JobData
from ..findings import Finding
from . import failure, hang, job_wide, link, straggler


@dataclass(frozen=True, slots=True)
class Detector:
    name: str
    """Its module, and its settings' field in ``diagnosis.Settings``."""
    find: Callable[[JobData, Any], list[Finding]]
    alone: bool = False
    """Runs only when the detectors that are not ``alone`` found nothing."""
    exclusive: bool = False
    """When it finds anything, the detectors after it do not run."""


DETECTORS: tuple[Detector, ...] = (
    Detector("failure", failure.find, exclusive=True),
    Detector("hang", hang.find, exclusive=True),
    Detector("straggler", straggler.find),
    Detector("link", link.find),
    Detector("job_wide", job_wide.find, alone=True),
)
