"""Node checks before training (``rankscope preflight``): devices, compute, memory and the network
among the job's nodes; a node that fails is named, so an init container can fail its pod.

Run one process per node with the job's rendezvous in the environment (``MASTER_ADDR``,
``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``: torchrun, Volcano's pytorch plugin or a Kubernetes
init container set them). :func:`run` measures, gathers every node's results on every node and
judges them (:mod:`preflight.verdict`), so each node knows whether it failed.
"""

from __future__ import annotations

from .verdict import Check, Report, judge

__all__ = ["Check", "Report", "judge"]
