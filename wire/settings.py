"""The one rule every settings class of the project keeps for its numbers, checked in its
``__post_init__``: thresholds, periods, sizes and shares are finite and never negative. A class adds
its own narrower rules after it; each names the field it refuses (``Class.field``)."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

from .errors import UsageError


def check_numbers(settings: Any) -> None:
    """Raise :class:`UsageError` naming the first number of dataclass ``settings`` that is not a
    finite number >= 0 (booleans, strings and nested settings are left to their own checks)."""
    for f in fields(settings):
        value = getattr(settings, f.name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value) or value < 0:
            raise UsageError(
                f"{type(settings).__name__}.{f.name} must be a finite number >= 0, got {value!r}"
            )
