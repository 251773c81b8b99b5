"""The rank's own network send rate, from the kernel's TCP_INFO of its TCP connections (Linux).

With ring collectives one slow link slows every rank's collectives alike, and a rank that waits for
a late peer spends the wait inside the collective too, so neither names the link. The kernel
knows better: for every TCP connection it counts the bytes the peer acknowledged
(``tcpi_bytes_acked``) and the time the connection was busy sending (``tcpi_busy_time``), part of
which was spent blocked on the receiver's window (``tcpi_rwnd_limited``: a slow *receiver*, not
this rank's link). Busy time minus receive-window time, per byte, is this rank's time per byte on
the wire; a rate-limited NIC or link makes it grow on the ranks behind it and nowhere else.

Gloo moves tensors over TCP, so this covers CPU jobs; NCCL over InfiniBand/RoCE needs the NIC's
counters or NCCL's profiler plugin instead (not read here). Reading is ~10 µs per connection and
happens only at a profiling window's start and end.

Example::

    before = tcp_counters()
    ...  # the window's steps
    patterns = send_patterns(before, tcp_counters())
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

from wire.records import FunctionPattern

SEND_PATTERN = "net_send@tcp"
"""The name of the pattern in a window summary (``collective`` kind, as diagnosis.communication reads)."""
MIN_BYTES = 64 << 10
"""Connections that sent less than this in the window (control traffic, the store) are left out."""

_TCP_INFO_LEN = 232
_ESTABLISHED = 1
_BYTES_ACKED = struct.Struct("<Q")  # at offset 120
_CHRONO = struct.Struct("<QQQ")  # busy, rwnd_limited, sndbuf_limited (µs) at offset 168, Linux 4.10+

Counters = dict[tuple[int, str, str], tuple[int, int]]
"""(fd, local IP, peer IP:port) -> (bytes acknowledged, µs busy sending less µs blocked on the receiver)."""


def tcp_counters(loopback: bool = False) -> Counters:
    """Send counters of this process's established TCP connections (empty where unsupported).

    Connections within the host (to a loopback address or to the host's own address) are left out
    unless ``loopback``: they never touch a NIC, and their "send time" is CPU time of this host,
    which scheduling noise moves (ranks on one host would otherwise look like slow links).
    """
    out: Counters = {}
    tcp_info: int = getattr(socket, "TCP_INFO", -1)  # Linux only
    try:
        names = os.listdir("/proc/self/fd") if tcp_info >= 0 else []
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


def send_patterns(before: Counters, after: Counters) -> list[FunctionPattern]:
    """The window's network sends, one pattern per pair of hosts: bytes and send time over the bulk
    connections from this host's address to the peer's. The pair is the pattern's ``stack``,
    ``"<local IP>><peer IP>"``: which links are slow, and which endpoint they share, names the NIC."""
    pairs: dict[str, list[int]] = {}
    for key, (acked, busy) in after.items():
        if key not in before:
            continue
        d_bytes, d_us = acked - before[key][0], busy - before[key][1]
        if d_bytes >= MIN_BYTES:  # d_us may be 0: busy time is counted in jiffies
            sums = pairs.setdefault(f"{key[1]}>{key[2].rsplit(':', 1)[0]}", [0, 0, 0])
            sums[0], sums[1], sums[2] = sums[0] + d_bytes, sums[1] + d_us, sums[2] + 1
    out = []
    for pair, (nbytes, us, conns) in sorted(pairs.items()):
        mean = round(us / conns, 2)
        out.append(
            FunctionPattern(
                "collective",
                SEND_PATTERN,
                pair,
                conns,
                float(us),
                mean,
                mean,
                mean,
                mean,
                0.0,
                0.0,
                0.0,
                nbytes,
            )
        )
    return out
