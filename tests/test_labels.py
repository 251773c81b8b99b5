"""A rank's topology labels (``profiler_hook.labels``): host, NIC, switch and spine from the
environment or Kubernetes node labels."""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path

import pytest

from rankscope.profiler_hook.config import Identity


def test_topology_comes_from_kubernetes_node_labels_through_a_configured_mapping(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from rankscope.profiler_hook.labels import topology

    labels = tmp_path / "labels"  # as the downward API writes it
    labels.write_text(
        'kubernetes.io/hostname="node-7"\naiops.io/switch="leaf3"\nvolcano.sh/spine="s1"\n'
        "not a label\nbroken=unquoted\n"
    )
    env = {
        "RANKSCOPE_LABELS_FILE": str(labels),
        "RANKSCOPE_TOPOLOGY": "switch=aiops.io/switch,spine=volcano.sh/spine",
    }
    with caplog.at_level(logging.WARNING, logger="rankscope.profiler_hook.labels"):
        assert topology(env) == {"host": "node-7", "nic": "", "switch": "leaf3", "spine": "s1"}
    (warning,) = caplog.records  # every malformed entry in one warning, the rest used
    assert "not a label" in warning.message and "broken" in warning.message
    inline = {**env, "RANKSCOPE_LABELS": "aiops.io/switch=leaf9", "RANKSCOPE_SPINE": "s2"}
    assert topology(inline) == {"host": "node-7", "nic": "", "switch": "leaf9", "spine": "s2"}, "env wins"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rankscope.profiler_hook.labels"):
        assert (
            topology({"RANKSCOPE_LABELS_FILE": str(tmp_path / "none"), "RANKSCOPE_TOPOLOGY": "rack=x"})[
                "switch"
            ]
            == ""
        )
    assert "unknown level 'rack'" in caplog.text
    ident = Identity.from_env(rank=0, world_size=1)  # this machine: no labels file, its host name
    assert ident.host == (os.environ.get("RANKSCOPE_HOST") or socket.gethostname())
