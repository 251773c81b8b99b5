"""rankscope's errors: one tree, at the bottom floor, so that every package — the hook included —
raises its kinds without importing more than this module.

Each error is one line that says what is wrong (and, where it helps, what to do). The kinds say
how a caller answers them: the ``rankscope`` command maps the whole tree to exit status 2
(``rankscope.cli.main``), the API maps each kind to an HTTP status (``api.app.STATUS``).

- :class:`UsageError` — bad input: an option, a setting, a parameter that does not fit;
- :class:`NotFoundError` — a job, ticket or directory that is not there;
- :class:`UnavailableError` — a store, broker or port that cannot be used now; its kinds
  :class:`StoreError` (the store could not be opened, written or read) and :class:`SchemaError`
  (tables this version cannot use);
- :class:`RecordError` — a value that is not a valid record (kept as a dead letter with the reason);
- :class:`Unauthenticated` and :class:`Forbidden` — the API's tokens: none or unknown, or too small
  a scope.
"""

from __future__ import annotations

import re

_STACK = re.compile(r"[,.;:]?\s*Stack trace\b.*", re.DOTALL)
_SPACE = re.compile(r"\s+")


class RankscopeError(Exception):
    """An error the user can act on; its message says what is wrong."""


class UsageError(RankscopeError, ValueError):
    """An option, setting or parameter the user gave does not fit (an unknown Kafka option, a port
    that is not a number, a negative ``window_s``…)."""


class NotFoundError(RankscopeError, LookupError):
    """What was asked for is not there: a job, a ticket, a job's diagnosis, a directory."""


class UnavailableError(RankscopeError, RuntimeError):
    """A store, broker or port that cannot be used now; the message says which and why."""


class StoreError(UnavailableError):
    """The store could not be opened, written or read; the message says which and why."""


class SchemaError(UnavailableError):
    """The database holds tables this version cannot use, or its name is not a plain identifier."""


class RecordError(RankscopeError, ValueError):
    """A value that is not a valid record; the message is the reason kept with the dead letter."""


class Unauthenticated(RankscopeError):
    """No token, or one that is not known (401)."""


class Forbidden(RankscopeError):
    """A token whose scope is too small for what it asked (403)."""


def one_line(message: str, limit: int = 600) -> str:
    """``message`` on one line, for a terminal: ClickHouse's stack traces cut off, whitespace runs
    (newlines included) made one space, at most ``limit`` characters."""
    text = _SPACE.sub(" ", _STACK.sub("", message)).strip()
    return text if len(text) <= limit else text[: limit - 1] + "…"
