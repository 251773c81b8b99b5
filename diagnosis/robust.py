"""The robust statistics every detector shares: median / MAD per group, and persistence."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd


def spread(
    values: pd.Series, by: Any, mad_floor: float, tiny: float
) -> tuple[pd.Series, pd.Series, pd.Series]:
    """Per group of ``by`` (columns as for ``Series.groupby``), aligned with ``values``: the group's
    median, its robust standard deviation (1.4826 MAD, never below ``mad_floor`` x the median nor
    ``tiny``), and the group's size."""
    groups = values.groupby(by)
    med = groups.transform("median")
    mad = (values - med).abs().groupby(by).transform("median") * 1.4826
    return med, np.maximum(np.maximum(mad, mad_floor * med), tiny), groups.transform("size")


def evenly(xs: np.ndarray, n: int) -> np.ndarray:
    """At most ``n`` of ``xs``, evenly spread over them (peers to compare with, at any scale)."""
    return xs[(np.arange(n) * (xs.size / n)).astype(np.int64)] if xs.size > n else xs


def needed(of: int, share: float) -> int:
    """In how many of ``of`` windows (or chunks) a fault must show to count as persistent: ``share``
    of them and two at least. One window, or one burst, is never a finding: a single window of a
    healthy job can read as contention at a confidence of 0.97."""
    return max(2, math.ceil(share * of))


def dense_index(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted distinct values, each value's position among them), like ``np.unique(values,
    return_inverse=True)`` but without its sort where the values are dense (rank numbers): 20 ms
    instead of 1.1 s for 6 million steps."""
    lo, hi = int(values.min()), int(values.max())
    if hi - lo > 4 * len(values) + 1024:
        return np.unique(values, return_inverse=True)
    present = np.zeros(hi - lo + 1, dtype=bool)  # rank numbers are dense: no sort needed
    present[values - lo] = True
    position = np.cumsum(present) - 1
    return np.flatnonzero(present) + lo, position[values - lo]
