"""``rankscope preflight``: the verdict on measurements, and a real run on four simulated hosts
(network namespaces) whose one NIC is rate-limited, which must be named."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.faults.catalogue import JobSpec
from benchmarks.faults.injectors import Fabric, Unavailable
from benchmarks.procs import free_port
from rankscope.preflight import judge


def _node(rank: int, send: float = 1.0, gflops: float = 30.0, gbps: float = 15.0, **extra: object) -> dict:
    return {
        "rank": rank,
        "node": f"n{rank}",
        "matmul_gflops": gflops,
        "memory_gbps": gbps,
        "send_gbps": send,
        **extra,
    }


def test_a_node_whose_links_both_ways_are_slow_is_named_a_link_alone_as_the_link() -> None:
    nic = judge([_node(0), _node(1, send=0.05), _node(2), _node(3)], 1.0)  # n1 -> n2 slow
    ((link,),) = [nic.failed]
    assert (link.check, link.node, link.rank) == ("link", "n1->n2", 1), "a slow link between fast nodes"
    both = judge([_node(0, send=0.05), _node(1, send=0.04), _node(2), _node(3)], 1.0)  # n0->n1, n1->n2
    assert [(c.check, c.node) for c in both.failed] == [("network", "n1")] and both.failed_ranks == {1}
    assert "NIC" in both.failed[0].message


def test_compute_memory_and_gpu_errors_against_the_median_or_a_baseline() -> None:
    r = judge(
        [
            _node(0),
            _node(1, gflops=10),
            _node(2, gbps=5),
            _node(3, gpu_errors=["GPU 3: 2 uncorrected ECC errors"]),
        ],
        1.0,
    )
    assert sorted((c.rank, c.check) for c in r.failed) == [(1, "compute"), (2, "memory"), (3, "gpu")]
    fast = judge([_node(i) for i in range(4)], 1.0, baseline={"matmul_gflops": 100.0})
    assert {c.check for c in fast.failed} == {"compute"} and fast.failed_ranks == {0, 1, 2, 3}
    two = judge([_node(0), _node(1, send=0.01)], 1.0)
    assert not two.failed and "below 3" in two.notes[0], "two nodes cannot tell a link from a node"


@pytest.mark.slow
def test_preflight_on_four_hosts_names_the_one_behind_a_rate_limited_nic(tmp_path: Path) -> None:
    spec = JobSpec(job="preflight", world_size=4, hosts=4)
    try:
        fabric = Fabric(spec, "nic", (2,), 200)  # host 2's NIC: 200 Mbit/s both ways, the rest veth speed
    except Unavailable as exc:
        pytest.skip(str(exc))
    port = str(free_port())
    procs = []
    try:
        where = fabric.setup()
        fabric.start()
        for rank in range(4):
            env = {
                **os.environ,
                "MASTER_ADDR": where["master_addr"],
                "MASTER_PORT": port,
                "RANK": str(rank),
                "WORLD_SIZE": "4",
                "GLOO_SOCKET_IFNAME": where["ifname"][rank],
                "RANKSCOPE_HOST": f"node{rank}",
            }
            cmd = [
                "ip",
                "netns",
                "exec",
                where["netns"][rank],
                sys.executable,
                "-m",
                "rankscope.cli",
                "preflight",
            ]
            cmd += ["--serial", "--taint", *(["--out", str(tmp_path / "report.json")] if rank == 0 else [])]
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            )
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            p.kill()
        errors = fabric.cleanup()
    assert errors == []
    print(outs[0][0])
    codes = [p.returncode for p in procs]
    assert codes == [0, 0, 1, 0], (codes, [o[1][-2000:] for o in outs])
    assert "kubectl taint nodes node2 rankscope.io/preflight=failed:NoSchedule" in outs[2][0]
    report = json.loads((tmp_path / "report.json").read_text())
    named = [(c["node"], c["check"]) for c in report["failed"]]
    assert ("node2", "network") in named and not [
        n for n in named if n[1] in ("network", "link") and n[0] != "node2"
    ]
    assert report["allreduce_busbw_gbps"] > 0 and "FAILED: node2" in outs[0][0], outs[0][0]


@pytest.mark.alone
def test_a_node_without_a_rendezvous_checks_itself_against_its_baseline(tmp_path: Path) -> None:
    """Without ``$MASTER_ADDR`` and the rest, ``rankscope preflight`` checks this node alone (a world
    of one, as DCGM's diagnostics check one node): against a fleet's baseline it is judged, a
    partial rendezvous is refused."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
    }
    cmd = [sys.executable, "-m", "rankscope.cli", "preflight"]
    alone = subprocess.run(
        [*cmd, "--out", str(tmp_path / "me.json")], env=env, capture_output=True, text=True, timeout=300
    )
    assert alone.returncode == 0, alone.stderr[-2000:]
    assert "this node alone" in alone.stderr
    me = json.loads((tmp_path / "me.json").read_text())
    assert len(me["nodes"]) == 1 and me["nodes"][0]["matmul_gflops"] > 0 and me["failed"] == []
    # A fleet whose nodes multiply 10x as fast: this one is slow against it.
    fleet = {"nodes": [{**me["nodes"][0], "matmul_gflops": 10 * me["nodes"][0]["matmul_gflops"]}]}
    (tmp_path / "fleet.json").write_text(json.dumps(fleet))
    slow = subprocess.run(
        [*cmd, "--baseline", str(tmp_path / "fleet.json")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert slow.returncode == 1 and "compute" in slow.stdout, (slow.stdout, slow.stderr[-2000:])
    partial = subprocess.run(
        cmd, env={**env, "MASTER_ADDR": "127.0.0.1"}, capture_output=True, text=True, timeout=60
    )
    assert partial.returncode == 2 and "$MASTER_PORT is not set" in partial.stderr
