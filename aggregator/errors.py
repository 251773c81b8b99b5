"""rankscope's user-facing errors: one base class, each error one line.

Whatever the user can act on — a store that another process holds, a store of another schema
version, a full disk, a port in use, an option that does not fit — raises :class:`RankscopeError`
(or a subclass, e.g. ``aggregator.StoreError``) with a message that names the problem. The
``rankscope`` command prints it as one line on stderr and exits with status 2
(``rankscope.cli.main``, the one place that does); library callers catch it like any exception.
"""

from __future__ import annotations

import re

_STACK = re.compile(r"[,.;:]?\s*Stack trace\b.*", re.DOTALL)
_SPACE = re.compile(r"\s+")


class RankscopeError(Exception):
    """An error the user can act on; its message says what is wrong (and, where it helps, what to do)."""


class StoreError(RankscopeError, RuntimeError):
    """The store could not be opened, written or read; the message says which and why."""


class UsageError(RankscopeError):
    """An option or setting the user gave does not fit (an unknown Kafka option, a port that is not a number…)."""


def one_line(message: str, limit: int = 600) -> str:
    """``message`` on one line, for a terminal: ClickHouse's stack traces cut off, whitespace runs
    (newlines included) made one space, at most ``limit`` characters."""
    text = _SPACE.sub(" ", _STACK.sub("", message)).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"
