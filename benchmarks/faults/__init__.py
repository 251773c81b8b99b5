"""The fault suite: real faults injected into real multi-rank jobs, the diagnosis scored.

- ``suite.py``: runs the scenarios and scores them (``python -m benchmarks.faults``, ``__main__.py``);
- ``scenarios.py`` and ``scenarios/``: the scenarios, one YAML file each (``validation/`` and
  ``soak/``: the splits no threshold was set on);
- ``catalogue.py``: the faults and the job they run on (``Fault``, ``JobSpec``); ``workload.py``:
  the suite's own training job, its faults inside its code; ``launch.py``: its ranks spawned,
  watched and stopped; ``torchrun_job.py``: user-style scripts (``benchmarks/jobs/``, ``rankscope/demo_job.py``)
  under ``torchrun``;
- ``injectors.py``: faults from outside the job (the simulated network, CPU hogs);
- ``scoring.py`` and ``timeline.py``: a run's diagnoses against its ground truth, probe by probe;
- ``serve_e2e.py``: ``rankscope serve`` over the suite's live jobs (tickets per healthy job-hour).
"""
