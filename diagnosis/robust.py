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


def needed(of: int, share: float) -> int:
    """In how many of ``of`` windows (or chunks) a fault must show to count as persistent: ``share``
    of them and two at least. One window, or one burst, is never a finding: a healthy job's single
    window read as contention on rank 0 (0.97) and on a DDP rank (0.985) when one was allowed."""
    return max(2, math.ceil(share * of))
