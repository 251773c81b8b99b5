"""Faults applied from outside the training job: a rate-limited network link and a CPU hog.

Both are set up before the job starts, switched on when the job reaches the fault's onset (the
faulty rank writes a marker file), and always torn down in ``cleanup`` — also when the job or the
setup failed half-way.

A slow NIC (``nic``) or a slow switch uplink (``switch``): the faulty ranks join a network namespace
of their own, connected to the machine's namespace by a veth pair. Every rank binds gloo to an
address on that pair (``GLOO_SOCKET_IFNAME``): ranks outside bind to the outer end (their traffic to
each other stays on loopback), ranks inside to the inner end, whose default route leads out through
the pair. At onset, ``tc qdisc ... tbf`` limits both directions of the pair, so everything the ranks
inside exchange with the others crosses one slow link. (netem is not available here.)
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from typing import Any

_SEQ = itertools.count()
"""Numbers the links this process makes, so that a link left behind never blocks the next."""


class Unavailable(RuntimeError):
    """The fault cannot be injected on this machine (no root, no ``ip``/``tc``); the message says why."""


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")


def network_unavailable() -> str:
    """Why a network fault cannot be injected here ('' if it can)."""
    if os.geteuid() != 0:
        return "network faults need root (ip netns, tc); run the suite as root to include them"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"network faults need {' and '.join(missing)} (apt-get install iproute2)"
    return ""


class SlowLink:
    """Ranks behind one veth pair that is rate-limited to ``rate_mbit`` at onset."""

    def __init__(self, ranks: tuple[int, ...], world_size: int, rate_mbit: float) -> None:
        why = network_unavailable()
        if why:
            raise Unavailable(why)
        tag = f"{os.getpid() % 100000}{next(_SEQ) % 100}"
        self.ranks, self.world_size, self.rate_mbit = ranks, world_size, rate_mbit
        self.netns = f"rsfault{tag}"
        self.outer, self.inner = f"rsf{tag}o", f"rsf{tag}i"
        octet = 100 + os.getpid() % 150
        self.outer_ip, self.inner_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
        self._made_ns = self._made_link = self._limited = False

    def setup(self) -> dict[str, Any]:
        """Create the namespace and the link; returns the JobSpec fields that route the ranks over it."""
        try:
            _run("ip", "netns", "add", self.netns)
        except RuntimeError as exc:
            raise Unavailable(f"cannot create a network namespace: {exc}") from exc
        self._made_ns = True
        _run("ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        self._made_link = True
        _run("ip", "link", "set", self.inner, "netns", self.netns)
        _run("ip", "addr", "add", f"{self.outer_ip}/24", "dev", self.outer)
        _run("ip", "link", "set", self.outer, "up")
        ns = ("ip", "netns", "exec", self.netns)
        _run(*ns, "ip", "addr", "add", f"{self.inner_ip}/24", "dev", self.inner)
        _run(*ns, "ip", "link", "set", self.inner, "up")
        _run(*ns, "ip", "link", "set", "lo", "up")
        _run(*ns, "ip", "route", "add", "default", "via", self.outer_ip)
        return {
            "master_addr": self.outer_ip,
            "netns": {r: self.netns for r in self.ranks},
            "ifname": {r: self.inner if r in self.ranks else self.outer for r in range(self.world_size)},
        }

    def start(self) -> None:
        """Rate-limit both directions of the link (tbf shapes what leaves each end)."""
        rate = f"{self.rate_mbit:g}mbit"
        burst = f"{max(32, int(self.rate_mbit * 1e6 / 8 / 250 / 1024))}kb"  # >= rate / HZ
        args = ("root", "tbf", "rate", rate, "burst", burst, "latency", "50ms")
        _run("tc", "qdisc", "add", "dev", self.outer, *args)
        _run("ip", "netns", "exec", self.netns, "tc", "qdisc", "add", "dev", self.inner, *args)
        self._limited = True

    def cleanup(self) -> list[str]:
        """Remove the qdiscs, the link and the namespace; returns what could not be removed."""
        errors = []
        if self._made_link:
            try:  # deleting one end deletes the pair, and its qdiscs with it
                _run("ip", "link", "del", self.outer)
            except RuntimeError as exc:
                errors.append(str(exc))
        if self._made_ns:
            try:
                _run("ip", "netns", "del", self.netns)
            except RuntimeError as exc:
                errors.append(str(exc))
        self._made_ns = self._made_link = self._limited = False
        return errors


_HOG = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end:\n    pass\n"


class CpuHog:
    """``n`` busy-looping processes pinned to ``core`` — the core the victim rank is pinned to."""

    def __init__(self, core: int, n: int, max_s: float) -> None:
        self.core, self.n, self.max_s = core, n, max_s
        self._procs: list[subprocess.Popen] = []

    def setup(self, rank: int) -> dict[str, Any]:
        return {"pin_cpu": {rank: self.core}}

    def start(self) -> None:
        for _ in range(self.n):
            # The hog ends by itself after max_s, should this process die without cleanup.
            p = subprocess.Popen([sys.executable, "-c", _HOG, str(self.max_s)])
            self._procs.append(p)
            os.sched_setaffinity(p.pid, {self.core})

    def cleanup(self) -> list[str]:
        for p in self._procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 5
        errors = []
        for p in self._procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            if p.returncode is None:
                errors.append(f"hog {p.pid} did not exit")
        self._procs = []
        return errors


def hog_core() -> int:
    """The core a host-contention fault pins the victim and the hog to: the last one we may use."""
    return max(os.sched_getaffinity(0))
