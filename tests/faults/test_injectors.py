"""The faults the suite injects, on real processes and a real simulated network: a slow device's
padding, a switch's slow uplink, a slow link between two hosts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.faults.catalogue import JobSpec
from benchmarks.faults.injectors import Fabric, Unavailable
from benchmarks.faults.workload import model_of, padding_rows

_RECEIVE = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
while conn.recv(1 << 20):
    pass
"""
_SEND = """
import socket, sys, time
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as s:
    t = time.perf_counter()
    s.sendall(b"x" * (4 << 20))
    s.shutdown(socket.SHUT_WR)
    s.recv(1)  # the receiver closes once it has read everything
    print(time.perf_counter() - t)
"""


@pytest.mark.alone  # the padding is found by timing the model
def test_a_slow_device_pads_more_rows_the_slower_it_is_and_leaves_no_gradients() -> None:
    import torch

    torch.manual_seed(0)
    model, x = model_of(256), torch.randn(32, 128)
    assert padding_rows(model, x, 1.0) == 0
    mild, heavy = padding_rows(model, x, 1.5), padding_rows(model, x, 3.0)
    assert 1 <= mild < heavy, (mild, heavy)
    assert mild >= 16 and heavy >= 64, (mild, heavy)  # never below (factor - 1) of the 32 rows
    assert all(p.grad is None for p in model.parameters()), "the timing runs must not leak into training"


def _transfer_s(fabric: Fabric, src_host: int, dst_host: int) -> float:
    """Seconds to move 4 MB from one simulated host to another, through the fabric."""
    ns, ip = fabric.netns, fabric.ip
    rx = subprocess.Popen(
        ["ip", "netns", "exec", ns[dst_host], sys.executable, "-c", _RECEIVE, ip[dst_host]],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rx.stdout is not None
        port = rx.stdout.readline().strip()
        out = subprocess.run(
            ["ip", "netns", "exec", ns[src_host], sys.executable, "-c", _SEND, ip[dst_host], port],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return float(out.stdout)
    finally:
        rx.kill()
        rx.wait()


def test_the_fabric_limits_only_the_faulty_switch_uplink_and_leaves_nothing_behind() -> None:
    # Six hosts on three switches (two each); sw1's uplink is limited to 16 Mbit/s (2 MB/s) at onset.
    spec = JobSpec(job="fabric", world_size=6, hosts=6, switches=3)
    try:
        fabric = Fabric(spec, "switch", (2, 3), 16)
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        fields = fabric.setup()
        assert fields["ifname"][2] != fields["ifname"][3] and fields["netns"][0] != fields["netns"][1]
        assert _transfer_s(fabric, 1, 2) < 1.0  # fast before onset
        fabric.start()
        assert _transfer_s(fabric, 1, 2) > 1.2  # 4 MB at 2 MB/s: sw0 -> sw1 crosses the slow uplink
        assert _transfer_s(fabric, 2, 3) < 1.0  # within sw1: not through its uplink
        assert _transfer_s(fabric, 0, 5) < 1.0  # sw0 -> sw2: through the spine, not sw1's uplink
    finally:
        errors = fabric.cleanup()
    assert errors == []
    left = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert not [n for n in fabric.netns.values() if n in left]
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [n for n in fabric.netns.values() if n in namespaces]


def test_a_link_fault_limits_the_two_hosts_traffic_with_each_other_and_no_other() -> None:
    # Four hosts, a rank each; the link between hosts 2 and 3 limited to 16 Mbit/s (2 MB/s) both ways.
    spec = JobSpec(job="fabric", world_size=4, hosts=4)
    try:
        fabric = Fabric(spec, "link", (2, 3), 16)
    except Unavailable as exc:
        pytest.skip(str(exc))
    try:
        fabric.setup()
        assert _transfer_s(fabric, 2, 3) < 1.0  # fast before onset
        fabric.start()
        assert _transfer_s(fabric, 2, 3) > 1.2 and _transfer_s(fabric, 3, 2) > 1.2  # 4 MB at 2 MB/s
        assert _transfer_s(fabric, 2, 0) < 1.0 and _transfer_s(fabric, 1, 3) < 1.0  # each end's others
    finally:
        assert fabric.cleanup() == []
