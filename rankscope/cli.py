"""The ``rankscope`` command."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from .workload import FAULTS


def _demo(a: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(fault=a.fault, rank=a.rank, out=a.out, seconds=a.seconds, world_size=a.ranks, factor=a.factor)
    return 0


def _ingest(a: argparse.Namespace) -> int:
    from aggregator import Store, ingest

    if not Path(a.spool).is_dir():
        print(f"rankscope ingest: spool directory {a.spool} does not exist", file=sys.stderr)
        return 2
    with Store.embedded(a.store) as store:
        st = ingest(a.spool, store)
    print(
        f"ingested {st.records} records ({st.bytes} bytes) from {st.files} files; {st.dead_letters} dead letters"
    )
    return 0


def _diagnose(a: argparse.Namespace) -> int:
    from aggregator import Store
    from diagnosis import diagnose

    from .render import print_diagnosis

    if not Path(a.store).is_dir():
        print(
            f"rankscope diagnose: store directory {a.store} does not exist; run `rankscope ingest` first",
            file=sys.stderr,
        )
        return 2
    with Store.embedded(a.store) as store:
        jobs = store.jobs()
        if jobs.empty:
            print(f"rankscope diagnose: no jobs in {a.store}", file=sys.stderr)
            return 2
        job = a.job or str(jobs.sort_values(by="last_us")["job"].iloc[-1])
        if job not in set(jobs["job"]):
            print(
                f"rankscope diagnose: no job {job!r} in {a.store}; jobs: {', '.join(jobs['job'])}",
                file=sys.stderr,
            )
            return 2
        data = store.job_data(job)
    d = diagnose(data)
    if a.json:
        print(json.dumps(d.to_dict(), indent=2))
    else:
        print_diagnosis(d)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rankscope", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train a real 4-rank job with an injected fault, then diagnose it")
    d.add_argument("--fault", choices=FAULTS, default="compute", help="fault to inject (default: compute)")
    d.add_argument("--rank", type=int, default=2, help="rank that gets the fault (default: 2)")
    d.add_argument("--out", default="rankscope-demo", help="output directory (default: ./rankscope-demo)")
    d.add_argument("--seconds", type=float, default=60.0, help="training time (default: 60)")
    d.add_argument("--ranks", type=int, default=4, help="number of ranks (default: 4)")
    d.add_argument("--factor", type=float, default=2.0, help="compute fault: slowdown factor (default: 2)")
    d.set_defaults(func=_demo)

    i = sub.add_parser("ingest", help="read a spool directory into the embedded ClickHouse store")
    i.add_argument("--spool", required=True, help="spool directory the hooks wrote")
    i.add_argument("--store", required=True, help="chDB data directory")
    i.set_defaults(func=_ingest)

    g = sub.add_parser("diagnose", help="diagnose a job in the store")
    g.add_argument("--store", required=True, help="chDB data directory")
    g.add_argument("--job", help="job id (default: the most recent job)")
    g.add_argument("--json", action="store_true", help='print {"job": ..., "findings": [...]} as JSON')
    g.set_defaults(func=_diagnose)
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if a.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return int(a.func(a))


if __name__ == "__main__":
    sys.exit(main())
