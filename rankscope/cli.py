"""The ``rankscope`` command."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rankscope.wire.errors import NotFoundError, RankscopeError, UsageError, one_line

from .demo import FAULTS


def _demo(a: argparse.Namespace) -> int:
    from .demo import run_demo

    run_demo(fault=a.fault, rank=a.rank, out=a.out, seconds=a.seconds, world_size=a.ranks, factor=a.factor)
    return 0


def _ingest(a: argparse.Namespace) -> int:
    from rankscope.aggregator import Store, ingest

    if not Path(a.spool).is_dir():
        raise NotFoundError(f"spool directory {a.spool} does not exist")
    with Store.embedded(a.store) as store:
        st = ingest(a.spool, store)
    print(
        f"ingested {st.records} records ({st.bytes} bytes) from {st.files} files; {st.dead_letters} dead letters"
    )
    return 0


def _option(kv: str) -> tuple[str, Any]:
    key, sep, value = kv.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {kv!r}")
    try:
        return key, json.loads(value)  # numbers, booleans, lists; anything else stays a string
    except ValueError:
        return key, value


def _clickhouse_address(address: str) -> tuple[str, int | None]:

    host, sep, port = address.partition(":")
    if not host:
        raise UsageError(f"--clickhouse {address}: give HOST or HOST:PORT")
    if not sep:
        return host, None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"--clickhouse {address}: the port must be a number from 1 to 65535")
    return host, int(port)


def _check_store_options(a: argparse.Namespace) -> None:
    from rankscope.aggregator.schema import check_identifier

    check_identifier(a.database)
    if a.clickhouse_cluster and not a.clickhouse:
        raise UsageError("--clickhouse-cluster needs --clickhouse HOST[:PORT]: a server of that cluster")
    if a.clickhouse:
        _clickhouse_address(a.clickhouse)


def _open_store(a: argparse.Namespace, create: bool = True) -> Any:
    """The store the options name: ``--clickhouse`` (a server) or ``--store`` (embedded chDB)."""
    from rankscope.aggregator import Store

    _check_store_options(a)
    if a.clickhouse:
        host, port = _clickhouse_address(a.clickhouse)
        return Store.server(
            host=host,
            port=port,
            username=a.clickhouse_user,
            password=os.environ.get("RANKSCOPE_CLICKHOUSE_PASSWORD", ""),
            database=a.database,
            secure=a.clickhouse_secure,
            cluster=a.clickhouse_cluster,
        )
    return Store.embedded(a.store, database=a.database, create=create)


def _kafka_settings(a: argparse.Namespace) -> Any:
    """The consumer's settings from the Kafka options, checked."""
    from rankscope.aggregator.consumer import KafkaSettings

    kafka = KafkaSettings(
        bootstrap=a.kafka,
        topic=a.topic,
        group=a.group,
        api_version=a.kafka_api_version,
        options=dict(a.kafka_option),
    )
    kafka.check()
    return kafka


def _aggregate(a: argparse.Namespace) -> int:
    from rankscope.aggregator.consumer import Aggregator, BatchSettings
    from rankscope.aggregator.metrics import Metrics

    # Everything the user gave is checked before anything is opened or served.
    if not a.kafka:
        raise UsageError("give --kafka HOST:PORT or set $RANKSCOPE_KAFKA")
    _check_store_options(a)
    kafka = _kafka_settings(a)
    metrics = Metrics()
    if a.metrics_port is not None:
        metrics.serve(a.metrics_port)
    store = _open_store(a)
    agg = Aggregator(store, kafka, BatchSettings(records=a.batch_records, seconds=a.batch_seconds), metrics)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: agg.stop())
    with store:
        st = agg.run(idle_exit_s=a.exit_when_idle)
    print(
        f"consumed {st.consumed} messages: stored {st.stored} records and {st.dead_letters} dead letters "
        f"in {st.batches} batches ({st.insert_failures} failed inserts retried) in {st.seconds:.1f} s"
    )
    return 0


def _pick_job(a: argparse.Namespace, store: Any) -> str:
    """``--job``, or the most recent job of the store; a one-line error for none."""

    where = a.store or a.clickhouse
    jobs = store.jobs()
    if jobs.empty:
        raise NotFoundError(f"no jobs in {where}")
    job = a.job if a.job is not None else str(jobs.sort_values(by="last_us")["job"].iloc[-1])
    if job not in set(jobs["job"]):
        raise NotFoundError(f"no job {job!r} in {where}; jobs: {', '.join(map(repr, jobs['job']))}")
    return job


def _reading(a: argparse.Namespace) -> Any:
    """The store a reading command names, opened without creating anything."""

    if a.job == "":
        raise UsageError("--job is empty: give a job id, or leave --job out for the most recent job")
    if a.store and not os.path.lexists(a.store):
        raise NotFoundError(f"store directory {a.store} does not exist; run `rankscope ingest` first")
    return _open_store(a, create=False)  # a directory that is no store stays untouched


def _diagnose(a: argparse.Namespace) -> int:
    from rankscope.diagnosis import diagnose, read_job
    from rankscope.renderers.text import print_diagnosis

    with _reading(a) as store:  # open while it runs: it reads the culprits' functions
        d = diagnose(read_job(store, _pick_job(a, store)))
    if a.json:
        print(json.dumps(d.to_dict(), indent=2))
    else:
        print_diagnosis(d)
    return 0


def _measured_runs(store: Any) -> list[Any]:
    """Every job of the store with steps, measured (``diagnosis.ettr.measure``): the fleet."""
    from rankscope.diagnosis.ettr import measure, read_run

    runs = [read_run(store, str(j)) for j in store.jobs()["job"]]
    return [measure(r) for r in runs if not r.steps.empty]


def _preflight_report(path: str) -> dict[str, Any]:
    try:
        report = json.loads(Path(path).read_text())
        if not isinstance(report, dict) or not isinstance(report.get("nodes"), list):
            raise ValueError("no list of nodes")
        return report
    except (OSError, ValueError) as exc:
        raise UsageError(f"--preflight {path}: not a preflight report ({exc})") from None


def _failing_hosts(a: argparse.Namespace) -> int:
    from dataclasses import replace

    from rankscope.diagnosis.ettr import failing_hosts, failures_by_class
    from rankscope.preflight.verdict import host_verdicts
    from rankscope.renderers.text import format_failing_hosts

    with _reading(a) as store:
        runs = _measured_runs(store)
    hosts, classes = failing_hosts(runs), failures_by_class(runs)
    if a.preflight:
        said = host_verdicts(_preflight_report(path) for path in a.preflight)
        hosts = [replace(h, preflight=said.get(h.host, "not in the reports")) for h in hosts]
    if a.json:
        print(
            json.dumps(
                {"hosts": [h.to_dict() for h in hosts], "classes": [c.to_dict() for c in classes]}, indent=2
            )
        )
    else:
        print(format_failing_hosts(hosts, classes), flush=True)
    return 0


def _reliability(a: argparse.Namespace) -> int:
    from rankscope.diagnosis.ettr import measure, observed_failure_rate, read_run
    from rankscope.renderers.text import format_reliability, printable

    if a.fleet:
        return _failing_hosts(a)
    with _reading(a) as store:
        run = read_run(store, job := _pick_job(a, store))
        others = _measured_runs(store) if a.failures_per_1000_node_days == "store" else []
    if run.steps.empty:
        raise NotFoundError(f"job {printable(job)!r} has no steps yet: nothing to measure")
    rate, note = 6.5e-3, ""
    if a.failures_per_1000_node_days == "store":  # the store's own jobs: their restarts over their node-days
        observed, failures, node_days = observed_failure_rate(others)
        if observed is None:
            note = f"no failure in this store's {node_days:.3g} node-days: projected at the default 6.5 per 1,000"
        else:
            rate, note = (
                observed,
                f"failure rate from this store: {failures} failures in {node_days:.3g} node-days",
            )
    elif a.failures_per_1000_node_days is not None:
        rate = float(a.failures_per_1000_node_days) / 1000
    r = measure(run, failures_per_node_day=rate, restart_s=a.restart_s)
    if note:
        r.notes.append(note)
    print(json.dumps(r.to_dict(), indent=2) if a.json else format_reliability(r), flush=True)
    return 0


def _efficiency(a: argparse.Namespace) -> int:
    from rankscope.diagnosis.efficiency import read
    from rankscope.renderers.text import format_efficiency, format_fleet, printable

    with _reading(a) as store:
        if not a.fleet:
            if (e := read(store, job := _pick_job(a, store))) is None:
                raise NotFoundError(f"job {printable(job)!r} has no steps yet: nothing to measure")
            print(json.dumps(e.to_dict(), indent=2) if a.json else format_efficiency(e), flush=True)
            return 0
        fleet = [e for job in store.jobs()["job"] if (e := read(store, str(job))) is not None]
    fleet.sort(key=lambda e: -(e.idle_device_hours if e.idle_device_hours is not None else e.device_hours))
    print(json.dumps([e.to_dict() for e in fleet], indent=2) if a.json else format_fleet(fleet), flush=True)
    return 0


def _preflight(a: argparse.Namespace) -> int:
    from rankscope.preflight.run import baseline_of, run
    from rankscope.renderers.text import format_preflight

    baseline = None
    if a.baseline:
        try:
            baseline = baseline_of(json.loads(Path(a.baseline).read_text()))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise UsageError(f"--baseline {a.baseline}: not a preflight report ({exc})") from None
    rendezvous = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    unset = [name for name in rendezvous if name not in os.environ]
    if len(unset) == len(rendezvous):
        # No rendezvous: this node checks itself, a world of one (its devices, and its compute and
        # memory against --baseline where one is given), as DCGM's diagnostics check one node.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")  # 0: any port
        print("rankscope preflight: no rendezvous in the environment: this node alone", file=sys.stderr)
    elif unset:
        raise UsageError(
            f"${unset[0]} is not set: run one preflight per node with the job's rendezvous "
            f"({', '.join('$' + n for n in rendezvous)}), or with none of them to check this node alone"
        )
    report, rank = run(min_ratio=a.min_ratio, baseline=baseline, serial=a.serial)
    mine = [c for c in report.failed if c.rank == rank]
    if a.out and rank == 0:
        Path(a.out).write_text(json.dumps(report.to_dict(), indent=2))
    if a.json:
        print(json.dumps(report.to_dict(), indent=2))
    elif rank == 0:
        print(format_preflight(report))
    if a.taint and mine:
        node = report.nodes[rank]["node"]
        print(f"kubectl taint nodes {node} rankscope.io/preflight=failed:NoSchedule")
    return 1 if mine else 0


def _serve(a: argparse.Namespace) -> int:
    import ipaddress

    import uvicorn

    from rankscope.api import ServeSettings, Service, create_app
    from rankscope.api.auth import Tokens
    from rankscope.api.notify import Webhook
    from rankscope.api.tickets import TicketSettings

    tokens = Tokens.load(a.tokens)
    try:
        loopback = ipaddress.ip_address(a.host).is_loopback
    except ValueError:
        loopback = a.host == "localhost"
    if not loopback and not tokens.enabled and not a.insecure:
        raise UsageError(
            f"--host {a.host} is reachable from other machines and no tokens are set: give --tokens FILE "
            "or $RANKSCOPE_TOKENS, or --insecure to serve without authentication"
        )
    if a.spool and not Path(a.spool).is_dir():
        raise NotFoundError(f"spool directory {a.spool} does not exist")
    kafka = _kafka_settings(a) if a.kafka else None
    settings = ServeSettings(
        spool=a.spool,
        kafka=kafka,
        interval_s=a.interval,
        ended_after_s=a.ended_after,
        tickets=TicketSettings(
            resolve_after_s=a.resolve_after,
            **({} if a.open_after is None else {"open_after_s": a.open_after}),
            **({} if a.open_after_job_wide is None else {"open_after_job_wide_s": a.open_after_job_wide}),
        ),
        webhooks=(*(Webhook(u) for u in a.webhook), *(Webhook(u, "slack") for u in a.slack_webhook)),
        base_url=a.base_url or f"http://{a.host}:{a.port}",
        **({"replica": a.replica} if a.replica else {}),
    )
    with _open_store(a) as store:
        service = Service(store, settings)
        service.start()
        try:
            uvicorn.run(create_app(service, tokens), host=a.host, port=a.port, log_level="warning")
        finally:
            service.stop()
    return 0


_LOG_RECORD_FIELDS = {*vars(logging.makeLogRecord({})), "message", "asctime"}


class TextFormatter(logging.Formatter):
    """``LEVEL logger: message``, with what the job sent (job ids, paths) :func:`printable`."""

    def __init__(self) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        from rankscope.renderers.text import printable

        return "\n".join(printable(line) for line in super().format(record).split("\n"))


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the fields given in ``extra``."""

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        d.update((k, v) for k, v in vars(record).items() if k not in _LOG_RECORD_FIELDS)
        if record.exc_info:
            d["exception"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rankscope", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="json: one object per line")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train a real 4-rank job with an injected fault, then diagnose it")
    d.add_argument(
        "--fault", choices=list(FAULTS), default="compute", help="fault to inject (default: compute)"
    )
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

    a = sub.add_parser(
        "aggregate",
        help="consume the hooks' records from Kafka into ClickHouse (one consumer-group member)",
    )
    _kafka_options(a)
    _store_options(a)
    a.add_argument("--batch-records", type=int, default=5000, help="write every N messages (default: 5000)")
    a.add_argument("--batch-seconds", type=float, default=1.0, help="…or every S seconds (default: 1)")
    a.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    a.add_argument(
        "--exit-when-idle",
        type=float,
        metavar="SECONDS",
        help="stop after SECONDS without messages, once the group has stored the whole topic",
    )
    a.set_defaults(func=_aggregate)

    g = sub.add_parser("diagnose", help="diagnose a job in the store")
    _store_options(g)
    g.add_argument("--job", help="job id (default: the most recent job)")
    g.add_argument("--json", action="store_true", help='print {"job": ..., "findings": [...]} as JSON')
    g.set_defaults(func=_diagnose)

    r = sub.add_parser("reliability", help="a job's ETTR, the time it lost by cause, its MTTF at scale")
    _store_options(r)
    r.add_argument("--job", help="job id (default: the most recent job)")
    r.add_argument("--json", action="store_true", help="print the measurement as JSON")
    r.add_argument(
        "--failures-per-1000-node-days",
        type=lambda v: v if v == "store" else _positive(v),
        metavar="R|store",
        help="node failure rate to project MTTF with (default: 6.5, Meta's clusters; "
        "'store': this store's jobs' restarts over their node-days)",
    )
    r.add_argument(
        "--restart-s", type=_positive, help="restart time to project with when the job had no restart"
    )
    r.add_argument(
        "--fleet",
        action="store_true",
        help="every job in the store: the hosts whose ranks failed attempts first, by class; "
        "lemon nodes (2+ hardware failures) first",
    )
    r.add_argument(
        "--preflight",
        action="append",
        metavar="REPORT",
        help="with --fleet: a preflight report (rankscope preflight --out) whose verdicts go beside "
        "the hosts (repeatable; a later report's word on a node replaces an earlier's)",
    )
    r.set_defaults(func=_reliability)

    e = sub.add_parser(
        "efficiency", help="where a job's time goes per rank; --fleet: jobs by idle device-hours"
    )
    _store_options(e)
    e.add_argument("--job", help="job id (default: the most recent job)")
    e.add_argument(
        "--fleet", action="store_true", help="every job in the store, most idle device-hours first"
    )
    e.add_argument("--json", action="store_true", help="print the measurement as JSON")
    e.set_defaults(func=_efficiency)

    f = sub.add_parser(
        "preflight", help="check this node (devices, compute, memory, network) before training"
    )
    f.add_argument(
        "--min-ratio", type=_positive, default=0.7, help="fail below this share of the reference (0.7)"
    )
    f.add_argument("--baseline", help="an earlier report (--out): hold the nodes to its medians")
    f.add_argument("--out", help="rank 0 writes the report here (JSON)")
    f.add_argument("--json", action="store_true", help="print the report as JSON")
    f.add_argument(
        "--taint", action="store_true", help="print the kubectl taint command for this node if it fails"
    )
    f.add_argument(
        "--serial", action="store_true", help="nodes sharing a machine take turns on the local probes"
    )
    f.set_defaults(func=_preflight)

    v = sub.add_parser(
        "serve", help="the always-on service: ingest, diagnose every job, tickets, API and web page"
    )
    _store_options(v)
    v.add_argument("--spool", help="spool directory the hooks write, watched continuously")
    _kafka_options(
        v, "also consume the hooks' Kafka topic from these bootstrap servers (default: $RANKSCOPE_KAFKA)"
    )
    v.add_argument("--host", default="127.0.0.1", help="listen address (default: 127.0.0.1)")
    v.add_argument("--port", type=int, default=8080, help="listen port (default: 8080)")
    v.add_argument("--interval", type=float, default=5.0, help="seconds between cycles (default: 5)")
    v.add_argument("--replica", help="this replica's name among those sharing the store (default: HOST-PID)")
    v.add_argument(
        "--resolve-after", type=float, default=60.0, help="resolve a ticket healthy this long (default: 60 s)"
    )
    v.add_argument(
        "--open-after",
        type=float,
        help="open a slowdown's ticket once it held this long; hangs and failures at once (default: 15 s)",
    )
    v.add_argument(
        "--open-after-job-wide",
        type=float,
        help="open a job-wide slowdown's ticket once it held this long (default: 300 s)",
    )
    v.add_argument(
        "--ended-after", type=float, default=60.0, help="a job silent this long has ended (default: 60 s)"
    )
    v.add_argument("--webhook", action="append", default=[], metavar="URL",
                   help="POST Alertmanager-style JSON on ticket open/resolve (repeatable)")  # fmt: skip
    v.add_argument("--slack-webhook", action="append", default=[], metavar="URL",
                   help="POST Slack-style text on ticket open/resolve (repeatable)")  # fmt: skip
    v.add_argument(
        "--base-url", help="where people reach this service, for links (default: from --host/--port)"
    )
    v.add_argument("--tokens", help="file of 'TOKEN read|write' lines (also: $RANKSCOPE_TOKENS)")
    v.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without tokens")
    v.set_defaults(func=_serve)
    return p


def _kafka_options(
    p: argparse.ArgumentParser, help_: str = "bootstrap servers (default: $RANKSCOPE_KAFKA)"
) -> None:
    p.add_argument(
        "--kafka",
        default=os.environ.get("RANKSCOPE_KAFKA"),
        help=help_,
    )
    p.add_argument("--topic", default="rankscope", help="topic the hooks produce to (default: rankscope)")
    p.add_argument(
        "--group", default="rankscope-aggregator", help="consumer group (default: rankscope-aggregator)"
    )
    p.add_argument("--kafka-api-version", default="", help="e.g. 0.9 for old brokers (default: probe)")
    p.add_argument(
        "--kafka-option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to KafkaConsumer, e.g. security_protocol=SASL_SSL (repeatable)",
    )


def _store_options(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--store", help="embedded chDB data directory")
    where.add_argument(
        "--clickhouse", metavar="HOST[:PORT]", help="ClickHouse server (HTTP port, default 8123)"
    )
    p.add_argument(
        "--clickhouse-user", default="default", help="password from $RANKSCOPE_CLICKHOUSE_PASSWORD"
    )
    p.add_argument("--clickhouse-secure", action="store_true", help="HTTPS (default port 8443)")
    p.add_argument(
        "--clickhouse-cluster",
        default="",
        metavar="NAME",
        help="the store spans this ClickHouse cluster, sharded by job (docs/operations.md)",
    )
    p.add_argument("--database", default="rankscope", help="database (default: rankscope)")


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status. An error the user can act on (:class:`RankscopeError`:
    a store in use, a full disk, an option that does not fit…) is one line on stderr and status 2."""
    a = parser().parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if a.log_format == "json" else TextFormatter())
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, handlers=[handler])

    try:
        return int(a.func(a))
    except RankscopeError as exc:
        from rankscope.renderers.text import printable

        print(f"rankscope {a.command}: {printable(one_line(str(exc)))}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
