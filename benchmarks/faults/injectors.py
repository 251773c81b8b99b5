"""Faults applied from outside the training job: a rate-limited network link and a CPU hog.

Both are set up before the job starts, switched on when the job reaches the fault's onset (the
faulty rank writes a marker file), and always torn down in ``cleanup`` — also when the job or the
setup failed half-way.

A slow NIC (``nic``) or a slow switch uplink (``switch``) needs a network like a cluster's, so
``Fabric`` builds one: each simulated host is a network namespace with one NIC — a veth pair whose
outer end is a port of its switch, a Linux bridge — and each switch has an uplink, another veth
pair, to a spine bridge (one bridge and no spine without switches). Every rank joins its host's
namespace and binds gloo to the NIC (``GLOO_SOCKET_IFNAME``); ranks of one host talk over the host's
own address, as GPUs of one host would over NVLink. At onset, ``tc qdisc ... tbf`` limits both
directions of the faulty host's NIC or the faulty switch's uplink. (netem is not available here.)
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from typing import Any

from benchmarks.faults.catalogue import JobSpec, host_of, switch_of
from rankscope.wire.errors import UnavailableError

_SEQ = itertools.count()
"""Numbers the links this process makes, so that a link left behind never blocks the next."""


class Unavailable(UnavailableError):
    """The fault cannot be injected on this machine (no root, no ``ip``/``tc``); the message says why.
    The suite's own kind, caught apart from a store's: the scenario is skipped, not failed."""


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


class Fabric:
    """Hosts, switches and links for a job's ranks; with a ``nic`` or ``switch`` fault one NIC or
    one uplink is rate-limited at onset, with a ``link`` fault the traffic between two hosts only,
    both ways (the hosts of ``ranks``' first two), each host's other traffic as fast as before (any
    other ``kind``: a healthy network)."""

    def __init__(self, spec: JobSpec, kind: str, ranks: tuple[int, ...], rate_mbit: float) -> None:
        why = network_unavailable()
        if why:
            raise Unavailable(why)

        tag = f"rsf{os.getpid() % 100000}{next(_SEQ) % 100}"
        self.rate_mbit = rate_mbit
        world = range(spec.world_size)
        host_names = sorted({host_of(r, spec) for r in world}, key=lambda h: int(h[4:]))
        host = {r: host_names.index(host_of(r, spec)) for r in world}
        switch_names = sorted({switch_of(r, spec) for r in world} - {""}, key=lambda w: int(w[2:]))
        self.switch_of_host = {
            host[r]: (switch_names.index(switch_of(r, spec)) if switch_names else 0) for r in world
        }
        self.netns = {h: f"{tag}h{h}" for h in self.switch_of_host}
        self.nic = {h: (f"{tag}h{h}o", f"{tag}h{h}i") for h in self.switch_of_host}
        self.bridge = {k: f"{tag}b{k}" for k in set(self.switch_of_host.values())}
        self.spine = f"{tag}sp" if switch_names else ""
        self.uplink = {k: (f"{tag}u{k}a", f"{tag}u{k}b") for k in self.bridge} if switch_names else {}
        octet = 100 + os.getpid() % 150
        self.ip = {h: f"10.213.{octet}.{h + 1}" for h in self.switch_of_host}
        self.rank_host = host
        faulty = {host[r] for r in ranks}
        self.slow: list[tuple[str, str]] = []
        """The veth pairs limited at onset: the faulty hosts' NICs or their switches' uplinks."""
        self.pair: tuple[int, int] | None = None
        """A ``link`` fault's two hosts: what each sends to the other is limited at onset."""
        if kind == "link":
            ends = sorted({host[r] for r in ranks}, key=[host[r] for r in ranks].index)
            if len(ends) != 2:
                raise ValueError("a link fault needs ranks on exactly two hosts (fault.rank and fault.ranks)")
            self.pair = (ends[0], ends[1])
        elif kind == "nic":
            self.slow = [self.nic[h] for h in sorted(faulty)]
        elif kind == "switch":
            self.slow = [self.uplink[k] for k in sorted({self.switch_of_host[h] for h in faulty})]
            if not self.slow:
                raise ValueError("a switch fault needs switches (the scenario's 'switches')")
        self._made: list[tuple[str, ...]] = []
        """What to delete, in order of creation: ('link', name) or ('netns', name)."""
        self._limited: list[tuple[str, str]] = []

    def setup(self) -> dict[str, Any]:
        """Build the network; returns the JobSpec fields that put the ranks on it."""
        try:
            _run("ip", "netns", "add", self.netns[0])
        except RuntimeError as exc:
            raise Unavailable(f"cannot create a network namespace: {exc}") from exc
        self._made.append(("netns", self.netns[0]))
        for name in [*self.bridge.values(), *([self.spine] if self.spine else [])]:
            _run("ip", "link", "add", name, "type", "bridge")
            self._made.append(("link", name))
            _run("ip", "link", "set", name, "up")
        for k, (a, b) in self.uplink.items():
            _run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
            self._made.append(("link", a))
            for end, bridge in ((a, self.bridge[k]), (b, self.spine)):
                _run("ip", "link", "set", end, "master", bridge)
                _run("ip", "link", "set", end, "up")
        for h, (outer, inner) in self.nic.items():
            if h:
                _run("ip", "netns", "add", self.netns[h])
                self._made.append(("netns", self.netns[h]))
            _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
            self._made.append(("link", outer))
            _run("ip", "link", "set", inner, "netns", self.netns[h])
            _run("ip", "link", "set", outer, "master", self.bridge[self.switch_of_host[h]])
            _run("ip", "link", "set", outer, "up")
            ns = ("ip", "netns", "exec", self.netns[h])
            _run(*ns, "ip", "addr", "add", f"{self.ip[h]}/24", "dev", inner)
            _run(*ns, "ip", "link", "set", inner, "up")
            _run(*ns, "ip", "link", "set", "lo", "up")
        return {
            "master_addr": self.ip[self.rank_host[0]],
            "netns": {r: self.netns[h] for r, h in self.rank_host.items()},
            "ifname": {r: self.nic[h][1] for r, h in self.rank_host.items()},
        }

    def start(self) -> None:
        """Rate-limit both directions of the faulty links (tbf shapes what leaves each end)."""
        rate = f"{self.rate_mbit:g}mbit"
        burst = f"{max(32, int(self.rate_mbit * 1e6 / 8 / 250 / 1024))}kb"  # >= rate / HZ
        args = ("root", "tbf", "rate", rate, "burst", burst, "latency", "50ms")
        inner_ns = {inner: self.netns[h] for h, (_, inner) in self.nic.items()}
        for pair in self.slow:
            for end in pair:
                where = ("ip", "netns", "exec", inner_ns[end]) if end in inner_ns else ()
                _run(*where, "tc", "qdisc", "add", "dev", end, *args)
        if self.pair is not None:  # htb: a slow class for the one peer, the rest unlimited
            for a, b in (self.pair, self.pair[::-1]):
                tc = ("ip", "netns", "exec", self.netns[a], "tc")
                dev = self.nic[a][1]
                _run(*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
                for classid, limit in (("1:10", ("rate", "100gbit")), ("1:20", ("rate", rate, "ceil", rate))):
                    _run(*tc, "class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb", *limit)
                match = ("u32", "match", "ip", "dst", f"{self.ip[b]}/32", "flowid", "1:20")
                _run(*tc, "filter", "add", "dev", dev, "protocol", "ip", "parent", "1:", "prio", "1", *match)

    def cleanup(self) -> list[str]:
        """Remove the links (and their qdiscs), bridges and namespaces; returns what could not be removed."""
        errors = []
        for what, name in reversed(self._made):  # deleting one end of a veth deletes the pair
            try:
                _run("ip", what, "del", name)
            except RuntimeError as exc:
                errors.append(str(exc))
        self._made = []
        return errors


_HOG = "import sys, time\nend = time.time() + float(sys.argv[1])\nwhile time.time() < end:\n    pass\n"


class CpuHog:
    """``n`` busy-looping processes pinned to ``core``, the core of the victim's simulated host.

    Simulated hosts share one machine's cores; a hog on one of them would slow every rank that
    the scheduler moves there. So each simulated host gets cores of its own (where the machine has
    as many cores as hosts): its ranks are pinned to them, as a real host's ranks are confined to
    its CPUs, and a hog on the victim host's core slows that host's ranks, no other's.
    """

    def __init__(self, core: int, n: int, max_s: float) -> None:
        self.core, self.n, self.max_s = core, n, max_s
        self._procs: list[subprocess.Popen] = []

    def setup(self, victim: int, spec: JobSpec) -> dict[str, Any]:
        """The ranks' cores: the victim's host on ``core``, the other hosts on the other cores."""
        others = sorted(os.sched_getaffinity(0) - {self.core})
        hosts = sorted({host_of(r, spec) for r in range(spec.world_size)} - {host_of(victim, spec)})
        if len(others) < len(hosts):  # too few cores for a core per host: pin the victim alone
            return {"pin_cpu": {victim: self.core}}
        core_of = {h: others[i] for i, h in enumerate(hosts)} | {host_of(victim, spec): self.core}
        return {"pin_cpu": {r: core_of[host_of(r, spec)] for r in range(spec.world_size)}}

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
