"""The ``rankscope`` command's errors and edge cases, run as a user runs it: a real process each time.

Whatever the user can act on (a store another process holds, a full disk, an option that does not
fit) is one line on stderr and exit status 2, never a traceback; and what came from a training job
reaches the terminal escaped.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from rankscope.aggregator import Store
from rankscope.wire.records import Heartbeat, RankInfo, Record, StepBatch, StepRow, WindowSummary, encode
from tests.commands import rankscope
from tests.kafka_broker import FAST_GROUP, KafkaBroker, produce
from tests.records import assert_stored_once, synthetic_records

T0 = 1_700_000_000_000_000


def one_error(run: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused command printed; asserts exit status 2 and nothing else on stderr."""
    lines = run.stderr.splitlines()
    assert (run.returncode, len(lines)) == (2, 1), f"rc {run.returncode}, stderr:\n{run.stderr[-3000:]}"
    assert lines[0].startswith(f"rankscope {run.args[3]}: ")
    return lines[0]


def write_spool(root: Path, records: Iterable[Record]) -> Path:
    """``records`` as the hook's spool sink writes them (one value per line)."""
    d = root / "job"
    d.mkdir(parents=True, exist_ok=True)
    with (d / "h-rank0-1.jsonl").open("wb") as f:
        for r in records:
            f.write(encode(r)[1] + b"\n")
    return root


def ingested(tmp_path: Path, records: Iterable[Record]) -> Path:
    """A store holding ``records``, made by ``rankscope ingest``."""
    spool, store = write_spool(tmp_path / "spool", records), tmp_path / "store"
    run = rankscope("ingest", "--spool", str(spool), "--store", str(store))
    assert run.returncode == 0, run.stderr
    return store


def rank_infos(job: str, ranks: int) -> list[Record]:
    return [
        RankInfo(job=job, rank=r, host=f"node{r}", time_us=T0, local_rank=0, world_size=ranks, pid=r)
        for r in range(ranks)
    ]


def steps(job: str, ranks: int, n: int, dur_us: int = 10_000, comm_us: int = 2_000) -> list[Record]:
    out: list[Record] = []
    for r in range(ranks):
        for lo in range(0, n, 100):
            rows = tuple(
                StepRow(s, T0 + s * dur_us, dur_us, 0, comm_us, 1, 100, dur_us - comm_us, 0, 1)
                for s in range(lo, min(n, lo + 100))
            )
            out.append(StepBatch(job=job, rank=r, host=f"node{r}", time_us=T0 + lo, rows=rows))
    return out


def store_holder(path: Path) -> subprocess.Popen[str]:
    """A process holding the store at ``path`` open, as a running ``rankscope aggregate`` does."""
    code = "import sys; from aggregator import Store; s = Store.embedded(sys.argv[1]); print('open', flush=True); sys.stdin.read()"
    p = subprocess.Popen(
        [sys.executable, "-c", code, str(path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "open"
    return p


# --- issue 12, item 5: one line and status 2 instead of a traceback -----------------------------------------


def test_a_store_another_process_holds_is_refused_in_one_line(tmp_path: Path) -> None:
    spool = write_spool(tmp_path / "spool", rank_infos("j", 2))
    holder = store_holder(tmp_path / "store")
    try:
        for run in (
            rankscope("ingest", "--spool", str(spool), "--store", str(tmp_path / "store")),
            rankscope("diagnose", "--store", str(tmp_path / "store")),
        ):
            assert "is in use by another process" in one_error(run)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(60)


def test_a_store_path_that_is_a_file_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "spool").mkdir()
    store = tmp_path / "store.txt"
    store.write_text("notes\n")
    for run in (
        rankscope("ingest", "--spool", str(tmp_path / "spool"), "--store", str(store)),
        rankscope("diagnose", "--store", str(store)),
        rankscope("aggregate", "--kafka", "127.0.0.1:9", "--store", str(store)),
    ):
        assert f"the store path {store} is not a directory" in one_error(run)
    assert store.read_text() == "notes\n"


def test_a_store_of_another_schema_version_is_refused_in_one_line(tmp_path: Path) -> None:
    store = ingested(tmp_path, rank_infos("j", 2))
    old = "from aggregator import Store; import sys; s = Store.embedded(sys.argv[1]); s.client.command(\"ALTER TABLE rankscope.steps MODIFY COMMENT 'rankscope schema 0'\"); s.close()"
    subprocess.run([sys.executable, "-c", old, str(store)], check=True, timeout=120)
    for run in (
        rankscope("ingest", "--spool", str(tmp_path / "spool"), "--store", str(store)),
        rankscope("diagnose", "--store", str(store)),
    ):
        assert "has tables from another schema version" in one_error(run)


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A directory on a 4 MiB tmpfs filled to the last byte (needs root, as mounting does)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a tmpfs")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with (mnt / "filler").open("wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_a_full_store_disk_is_refused_in_one_line(tmp_path: Path, full_disk: Path) -> None:
    spool = write_spool(tmp_path / "spool", [*rank_infos("j", 2), *steps("j", 2, 300)])
    run = rankscope("ingest", "--spool", str(spool), "--store", str(full_disk / "store"))
    assert "not enough space" in one_error(run)


def test_a_metrics_port_in_use_is_refused_in_one_line_before_anything_is_opened(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = rankscope(
            "aggregate",
            "--kafka",
            "127.0.0.1:9",
            "--store",
            str(tmp_path / "db"),
            "--metrics-port",
            str(port),
        )
    assert f"cannot serve metrics on 0.0.0.0:{port}: Address already in use" in one_error(run)
    assert not (tmp_path / "db").exists()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--database", "x;DROP"], "database name 'x;DROP' must match"),
        (["--clickhouse", "h:abc"], "--clickhouse h:abc: the port must be a number from 1 to 65535"),
        (["--clickhouse-cluster", "prod"], "--clickhouse-cluster needs --clickhouse HOST[:PORT]"),
        (["--kafka-option", "bogus_key=1"], "unknown Kafka consumer option 'bogus_key'"),
        (["--kafka-option", "sesion_timeout_ms=1"], "(did you mean session_timeout_ms?)"),
        (["--kafka-option", "session_timeout_ms=abc"], "session_timeout_ms='abc' must be an integer"),
        (["--kafka-option", "enable_auto_commit=1"], "enable_auto_commit=1 must be true or false"),
    ],
)
def test_aggregate_options_that_do_not_fit_are_refused_in_one_line(
    tmp_path: Path, args: list[str], says: str
) -> None:
    where = [] if "--clickhouse" in args else ["--store", str(tmp_path / "db")]
    run = rankscope("aggregate", "--kafka", "127.0.0.1:9", *where, *args, timeout=60)
    assert says in one_error(run)
    assert not (tmp_path / "db").exists()


# --- issue 12, item 11: the small ones -------------------------------------------------------------------------


def test_diagnose_refuses_an_empty_job_id(tmp_path: Path) -> None:
    store = ingested(tmp_path, [*rank_infos("older", 2), *rank_infos("latest", 2)])
    assert "--job is empty" in one_error(rankscope("diagnose", "--store", str(store), "--job", ""))


def test_diagnose_refuses_a_directory_that_is_not_a_store_and_leaves_it_as_it_was(tmp_path: Path) -> None:
    notes, empty = tmp_path / "notes", tmp_path / "empty"
    notes.mkdir()
    (notes / "todo.txt").write_text("x")
    empty.mkdir()
    for d in (notes, empty):
        assert "is not a rankscope store" in one_error(rankscope("diagnose", "--store", str(d)))
    assert [p.name for p in notes.iterdir()] == ["todo.txt"] and not any(empty.iterdir())
    # ingest and aggregate make a store in a new or empty directory, not among other files.
    (tmp_path / "spool").mkdir()
    run = rankscope("ingest", "--spool", str(tmp_path / "spool"), "--store", str(notes))
    assert "holds no chDB store" in one_error(run)
    assert [p.name for p in notes.iterdir()] == ["todo.txt"]


def test_a_job_with_heartbeats_only_is_not_called_healthy(tmp_path: Path) -> None:
    beats = [
        Heartbeat(job="starting", rank=r, host=f"node{r}", time_us=T0 + i, step=-1, progress_age_s=1.0)
        for r in range(2)
        for i in range(3)
    ]
    run = rankscope("diagnose", "--store", str(ingested(tmp_path, [*rank_infos("starting", 2), *beats])))
    assert run.returncode == 0, run.stderr
    assert "no steps yet" in run.stdout and "keeps pace" not in run.stdout


def test_negative_durations_and_rank_minus_one_are_dead_lettered_not_stored(tmp_path: Path) -> None:
    good = [*rank_infos("neg", 2), *steps("neg", 2, 10)]
    row = StepRow(10, T0, 10_000, 0, 2_000, 1, -1, 8_000, 0, 1)  # first_coll_us -1: no collective
    window = next(r for r in synthetic_records("neg", ranks=1) if isinstance(r, WindowSummary))
    bad = [
        StepBatch(job="neg", rank=0, host="node0", time_us=T0, rows=(row._replace(dur_us=-5),)),
        StepBatch(job="neg", rank=0, host="node0", time_us=T0, rows=(row._replace(cpu_us=-1),)),
        StepBatch(job="neg", rank=-1, host="node0", time_us=T0, rows=(row,)),
        dataclasses.replace(window, dur_us=-1),  # parsed by ClickHouse, held to the same rules
    ]
    ok = StepBatch(job="neg", rank=1, host="node1", time_us=T0, rows=(row,))
    spool = write_spool(tmp_path / "spool", [*good, *bad, ok])
    run = rankscope("ingest", "--spool", str(spool), "--store", str(tmp_path / "store"))
    assert run.returncode == 0, run.stderr
    assert f"ingested {len(good) + 1} records" in run.stdout and "; 4 dead letters" in run.stdout


def test_a_job_whose_steps_are_all_collective_wait_prints_no_warning(tmp_path: Path) -> None:
    # Own time (step minus collectives) is 0 on every rank and step: the job-wide check divides
    # 0 by 0 for every rank. 3,000 steps of 10 ms make the 20 s it needs before it looks.
    store = ingested(tmp_path, [*rank_infos("allwait", 4), *steps("allwait", 4, 3000, comm_us=10_000)])
    run = rankscope("diagnose", "--store", str(store))
    assert run.returncode == 0 and run.stderr == "", run.stderr


def test_job_ids_reach_the_terminal_escaped(tmp_path: Path) -> None:
    job = "evil\x1b[2J\x1b]0;owned\x07\u202ejob"
    store = ingested(tmp_path, [*rank_infos(job, 2), *steps(job, 2, 50)])
    run = rankscope("diagnose", "--store", str(store))
    assert run.returncode == 0, run.stderr
    assert "\x1b" not in run.stdout and "\x07" not in run.stdout and "\u202e" not in run.stdout
    assert "job evil\\x1b[2J\\x1b]0;owned\\x07\\u202ejob:" in run.stdout
    refused = one_error(rankscope("diagnose", "--store", str(store), "--job", "nope\x1b[31m"))
    assert "\x1b" not in refused and "nope\\x1b[31m" in refused


# --- issue 12, item 4: no broker at start-up is an outage, waited out ------------------------------------------


def aggregate_argv(broker: KafkaBroker, topic: str, store: Path, *extra: str) -> list[str]:
    argv = [sys.executable, "-m", "rankscope.cli", "aggregate", "--kafka", broker.bootstrap]
    argv += ["--topic", topic, "--store", str(store), *extra]
    return argv + [f"--kafka-option={k}={v}" for k, v in FAST_GROUP.items()]


def popen(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.kafka
def test_an_aggregator_started_before_the_broker_waits_for_it_then_stores_everything(
    broker_home: Path, tmp_path: Path
) -> None:
    late = KafkaBroker(broker_home, tmp_path / "kafka")  # its port is chosen; nothing listens yet
    records = synthetic_records("early")
    # As in production, no API version: the client asks a broker for it while it is made, here
    # for 1 s at a time (the default is 10 s). The test broker (0.9) cannot answer that question,
    # so this one only shows that no broker is waited out and that SIGTERM stops the wait.
    probing = popen(
        aggregate_argv(
            late, "early", tmp_path / "probing", "--exit-when-idle", "1",
            "--kafka-option", "bootstrap_timeout_ms=1000",
        )
    )  # fmt: skip
    # With the API version given the client is made at once and reaches the broker once it is up.
    waiting = popen(
        aggregate_argv(late, "early", tmp_path / "db", "--kafka-api-version", "0.9", "--exit-when-idle", "4")
    )
    try:
        time.sleep(6)  # several attempts, and longer than either idle time
        assert probing.poll() is None, probing.communicate()[1][-3000:]
        assert waiting.poll() is None, waiting.communicate()[1][-3000:]
        probing.send_signal(signal.SIGTERM)
        out, err = probing.communicate(timeout=30)
        assert probing.returncode == 0, err[-3000:]
        assert "Traceback" not in err and "no Kafka broker answers at" in err
        assert out.startswith("consumed 0 messages")
        late.start()
        produce(late, "early", (encode(r) for r in records))
        out, err = waiting.communicate(timeout=180)
    finally:
        for p in (probing, waiting):
            p.kill()
        late.stop()
    assert waiting.returncode == 0, err[-3000:]
    assert out.startswith(f"consumed {len(records)} messages"), out
    with Store.embedded(tmp_path / "db") as store:
        assert_stored_once(store, "early", records)
