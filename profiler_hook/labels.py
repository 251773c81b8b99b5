"""Topology from the cluster: Kubernetes node labels mapped onto the levels the diagnosis uses.

A pod learns its node's labels through the downward API (a volume file of ``key="value"`` lines,
``/etc/podinfo/labels`` by convention) or through the environment. Which label names which level
is the cluster's choice, so it is configured::

    RANKSCOPE_TOPOLOGY="switch=aiops.io/switch,spine=volcano.sh/hypernode-spine"
    RANKSCOPE_LABELS_FILE=/etc/podinfo/labels        # default; or, inline:
    RANKSCOPE_LABELS="aiops.io/switch=leaf3,volcano.sh/hypernode-spine=s1"

Levels: ``host``, ``nic``, ``switch`` (the leaf), ``spine``. ``host`` defaults to the label
``kubernetes.io/hostname``. ``$RANKSCOPE_HOST``, ``$RANKSCOPE_NIC``, ``$RANKSCOPE_SWITCH`` and
``$RANKSCOPE_SPINE`` win over labels. A malformed entry (no ``=``, an unknown level, a label
value that is not a quoted string) is reported once, in one warning, and ignored.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)

LEVELS = ("host", "nic", "switch", "spine")
LABELS_FILE = "/etc/podinfo/labels"
DEFAULT_TOPOLOGY = {"host": "kubernetes.io/hostname"}


def _pairs(text: str, sep: str, bad: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in text.split(sep):
        item = item.strip()
        if not item:
            continue
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            bad.append(f"{what}: {item!r:.80}")
            continue
        out[key.strip()] = value.strip()
    return out


def _file_labels(path: str, bad: list[str]) -> dict[str, str]:
    """The downward API's labels file: one ``key="value"`` per line (the value JSON-quoted)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return {}
    out = {}
    for key, value in _pairs(text, "\n", bad, path).items():
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = None
        if not isinstance(parsed, str):
            bad.append(f"{path}: {key}={value!r:.80} is not a quoted string")
            continue
        out[key] = parsed
    return out


def topology(env: Mapping[str, str]) -> dict[str, str]:
    """The ``LEVELS`` this process's labels and environment name ('' for a level none names)."""
    bad: list[str] = []
    labels = _file_labels(env.get("RANKSCOPE_LABELS_FILE", LABELS_FILE), bad)
    labels.update(_pairs(env.get("RANKSCOPE_LABELS", ""), ",", bad, "RANKSCOPE_LABELS"))
    mapping = dict(DEFAULT_TOPOLOGY)
    for level, label in _pairs(env.get("RANKSCOPE_TOPOLOGY", ""), ",", bad, "RANKSCOPE_TOPOLOGY").items():
        if level in LEVELS:
            mapping[level] = label
        else:
            bad.append(f"RANKSCOPE_TOPOLOGY: unknown level {level!r:.40} (levels: {', '.join(LEVELS)})")
    if bad:
        log.warning("rankscope: ignored malformed topology labels: %s", "; ".join(bad))
    return {
        level: env.get(f"RANKSCOPE_{level.upper()}") or labels.get(mapping.get(level, ""), "")
        for level in LEVELS
    }
