"""The rank's own network send rate, from the kernel's TCP_INFO of its TCP connections (Linux).

With ring collectives one slow link slows every rank's collectives alike, and a rank that waits for
a late peer spends the wait inside the collective too, so neither names the link. The kernel
knows better: for every TCP connection it counts the bytes the peer acknowledged
(``tcpi_bytes_acked``) and the time the connection was busy sending (``tcpi_busy_time``), part of
which was spent blocked on the receiver's window (``tcpi_rwnd_limited``: a slow *receiver*, not
this rank's link). Busy time minus receive-window time, per byte, is this rank's time per byte on
the wire; a rate-limited NIC or link makes it grow on the ranks behind it and nowhere else.

Gloo moves tensors over TCP, so this covers CPU jobs; NCCL over InfiniBand/RoCE needs the NIC's
counters or NCCL's profiler plugin instead (not read here). Reading is ~10 µs per connection; the
watchdog thread reads at every heartbeat, so each heartbeat carries its rank's sends since the last.

Example::

    links = LinkMeter()
    links.read()
    ...  # a heartbeat's seconds
    sends = links.read()  # {"10.0.0.2>10.0.0.1": (bytes, µs)}
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
from collections.abc import Iterable, Iterator

MIN_BYTES = 64 << 10
"""Connections that sent less than this between readings (control traffic, the store) are left out."""

_TCP_INFO_LEN = 232
_ESTABLISHED = 1
_BYTES_ACKED = struct.Struct("<Q")  # at offset 120
_CHRONO = struct.Struct("<QQQ")  # busy, rwnd_limited, sndbuf_limited (µs) at offset 168, Linux 4.10+

Counters = dict[tuple[int, str, str], tuple[int, int]]
"""(fd, local IP, peer IP:port) -> (bytes acknowledged, µs busy sending less µs blocked on the receiver)."""


def tcp_counters(loopback: bool = False, fds: Iterable[int] | None = None) -> Counters:
    """Send counters of this process's established TCP connections (empty where unsupported), of
    the descriptors ``fds`` only if given.

    Connections within the host (to a loopback address or to the host's own address) are left out
    unless ``loopback``: they never touch a NIC, and their "send time" is CPU time of this host,
    which scheduling noise moves (ranks on one host would otherwise look like slow links).
    """
    out: Counters = {}
    tcp_info: int = getattr(socket, "TCP_INFO", -1)  # Linux only
    if tcp_info < 0:
        return out
    try:
        names = [str(fd) for fd in fds] if fds is not None else os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            fd = int(name)
            s = socket.socket(fileno=os.dup(fd))
        except (OSError, ValueError):
            continue
        try:
            if s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            info = s.getsockopt(socket.IPPROTO_TCP, tcp_info, _TCP_INFO_LEN)
            if len(info) < _CHRONO.size + 168 or info[0] != _ESTABLISHED:
                continue
            peer, local = s.getpeername(), s.getsockname()[0]
            if not loopback and (ipaddress.ip_address(peer[0].split("%")[0]).is_loopback or peer[0] == local):
                continue
        except (OSError, ValueError):
            continue
        finally:
            s.close()  # the duplicate only
        (acked,) = _BYTES_ACKED.unpack_from(info, 120)
        busy, rwnd, _sndbuf = _CHRONO.unpack_from(info, 168)
        out[(fd, local, f"{peer[0]}:{peer[1]}")] = (acked, busy - rwnd)
    return out


BULK_SHARE = 0.1
"""Links that carried less than this share of the busiest link's bytes are left out: their time per
byte is the latency of a few small messages (a delayed ACK holds one 40 ms), not bandwidth; with 8
ranks over gloo, each rank's 100 MB per 5 s to one peer came with 0.07–0.3 MB to another, at 500
to 20,000 times the time per byte."""
MAX_SCAN = 256
"""Up to this many open descriptors every one is read at each reading (~10 µs each); a process with
more (rank 0 serving the job's store to thousands of ranks) reads all of them every ``RESCAN``-th
reading, and in between only the connections that were sending bulk."""
RESCAN = 12


class LinkMeter:
    """This process's network sends per link between one :meth:`read` and the next."""

    def __init__(self, loopback: bool = False) -> None:
        self._loopback = loopback
        self._last: Counters = {}
        self._bulk: list[int] = []
        self._reads = 0

    def read(self) -> dict[str, tuple[int, int]]:
        """Per pair of hosts, ``"<local IP>><peer IP>"`` -> (bytes, µs sending) over the bulk
        connections from this host's address to the peer's since the last read (empty the first
        time): which links are slow, and which endpoint they share, names the NIC. Time per byte is
        what tells a slow link, so a connection read less often (see ``MAX_SCAN``) still counts."""
        try:
            names = os.listdir("/proc/self/fd")
        except OSError:
            return {}
        full = len(names) <= MAX_SCAN or self._reads % RESCAN < 2
        self._reads += 1
        now = tcp_counters(self._loopback, [int(n) for n in names] if full else self._bulk)
        deltas = list(_deltas(self._last, now))
        self._bulk = [key[0] for key, nbytes, _ in deltas if nbytes >= MIN_BYTES]
        self._last = now if full else {**self._last, **now}  # full: closed connections go
        return _per_link(deltas)


def _deltas(before: Counters, after: Counters) -> Iterator[tuple[tuple[int, str, str], int, int]]:
    """(connection, bytes, µs) sent between the readings, of the connections in both."""
    for key, (acked, busy) in after.items():
        if key in before:
            yield key, acked - before[key][0], max(busy - before[key][1], 0)


def _per_link(deltas: Iterable[tuple[tuple[int, str, str], int, int]]) -> dict[str, tuple[int, int]]:
    """Sums per link, of the links that carried at least ``BULK_SHARE`` of the busiest one's bytes."""
    pairs: dict[str, tuple[int, int]] = {}
    for (_, local, peer), d_bytes, d_us in deltas:
        if d_bytes >= MIN_BYTES:  # d_us may be 0: busy time is counted in jiffies
            pair = f"{local}>{peer.rsplit(':', 1)[0]}"
            nbytes, us = pairs.get(pair, (0, 0))
            pairs[pair] = (nbytes + d_bytes, us + d_us)
    most = max((nbytes for nbytes, _ in pairs.values()), default=0)
    return {pair: v for pair, v in sorted(pairs.items()) if v[0] >= BULK_SHARE * most}
