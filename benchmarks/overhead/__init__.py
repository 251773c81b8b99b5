"""What the hook costs: ``hook.py`` times it inside one process (in-run A/B), ``job.py`` as separate
runs with and without it of jobs users run (``benchmarks/jobs/``)."""
