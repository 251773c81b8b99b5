"""Kafka client settings the hook's producer and the aggregator's consumer read alike."""

from __future__ import annotations

from typing import Any


def api_version_kwargs(version: str) -> dict[str, Any]:
    """kafka-python's ``api_version`` argument for ``"0.9"``-style text; none for "" (probe the broker)."""
    return {"api_version": tuple(int(x) for x in version.split("."))} if version else {}
