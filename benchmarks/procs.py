"""What the benchmarks and the tests share about processes on this machine: a port to listen on."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A port nothing listens on, from below the kernel's ephemeral range.

    A port the kernel hands out for ``bind(0)`` comes from the range it also takes outgoing
    connections' source ports from, so between this call and its user's ``bind`` any client on the
    machine (a Kafka client reconnecting, a torchrun store) can take it. Below the range only a
    deliberate bind can.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports = random.sample(range(10000, low), min(100, low - 10000)) if low > 10100 else []
    for port in [*ports, 0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise OSError("no free port on 127.0.0.1")
